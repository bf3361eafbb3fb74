"""Tensor parallelism: how a model's dimensions split over ranks (`sharding`), the collectives a
sharded forward runs (`group`), the worker processes the engine starts and supervises (`workers`)
and the runner that hands every step to every rank (`runner`). docs/tensor-parallel.md."""
