"""`infer bench`: the benchmark commands and the measurements behind them (docs/layers.md says why
they live here, outside the runtime)."""
