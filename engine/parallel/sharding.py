"""The arithmetic of splitting a model over N ranks, checked before any weight is read.

Query heads, MLP columns and the vocabulary are cut into N equal contiguous ranges. KV heads (and
Gated DeltaNet key heads, which value heads share as query heads share KV heads) are cut the same
way when N divides them; when they are fewer than the ranks, every KV head is replicated on N / KV
consecutive ranks, so each rank's query heads still find their KV head locally. Anything else is
refused with a `ShardError` naming the config field and its value. A model line states which of
its fields are cut (its `sharding.py`); this module knows no model.
"""

from __future__ import annotations

from dataclasses import dataclass


class ShardError(ValueError):
    """A config field the requested tensor-parallel size cannot split; carries field and value."""

    def __init__(self, field: str, value: int, ranks: int, why: str) -> None:
        super().__init__(f"--tensor-parallel-size {ranks}: field {field!r} = {value}: {why}")
        self.field = field
        self.value = value
        self.ranks = ranks
        self.why = why


@dataclass(frozen=True, slots=True)
class Span:
    """Indices [start, stop) of one rank's share."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def _check_ranks(ranks: int) -> None:
    if ranks < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {ranks}")


@dataclass(frozen=True, slots=True)
class DimSplit:
    """A dimension cut into `ranks` equal contiguous ranges (MLP columns, the vocabulary)."""

    field: str
    total: int
    ranks: int

    @classmethod
    def of(cls, field: str, total: int, ranks: int) -> DimSplit:
        _check_ranks(ranks)
        if total % ranks:
            raise ShardError(field, total, ranks, f"not divisible by {ranks} ranks")
        return cls(field, total, ranks)

    @property
    def per_rank(self) -> int:
        return self.total // self.ranks

    def span(self, rank: int) -> Span:
        return Span(rank * self.per_rank, (rank + 1) * self.per_rank)


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Heads over ranks: cut when `ranks` divides them, else (fewer heads than ranks, `ranks` a
    multiple of them) each head replicated on `replicas` consecutive ranks."""

    field: str
    total: int
    ranks: int

    @classmethod
    def of(cls, field: str, total: int, ranks: int, *, replicable: bool) -> HeadSplit:
        _check_ranks(ranks)
        if total % ranks == 0:
            return cls(field, total, ranks)
        if not replicable:
            raise ShardError(field, total, ranks, f"{total} heads do not split over {ranks} ranks")
        if total > ranks or ranks % total:
            raise ShardError(
                field,
                total,
                ranks,
                f"{total} heads neither split over {ranks} ranks nor replicate evenly across them",
            )
        return cls(field, total, ranks)

    @property
    def replicated(self) -> bool:
        return self.total < self.ranks

    @property
    def replicas(self) -> int:
        """Ranks holding each head (1 when the heads are cut)."""
        return self.ranks // self.total if self.replicated else 1

    @property
    def per_rank(self) -> int:
        return 1 if self.replicated else self.total // self.ranks

    def span(self, rank: int) -> Span:
        if self.replicated:
            head = rank // self.replicas
            return Span(head, head + 1)
        return Span(rank * self.per_rank, (rank + 1) * self.per_rank)

    def ranks_of(self, head: int) -> range:
        """The ranks that hold `head`."""
        if self.replicated:
            return range(head * self.replicas, (head + 1) * self.replicas)
        return range(head // self.per_rank, head // self.per_rank + 1)


@dataclass(frozen=True, slots=True)
class GroupedHeads:
    """Query-like heads that share key-like heads in equal groups (attention's Q over KV, Gated
    DeltaNet's value heads over key heads): the first are cut, the second cut or replicated, so that
    every rank holds the shared heads its own heads read."""

    heads: HeadSplit
    shared: HeadSplit

    @classmethod
    def of(cls, heads_field: str, heads: int, shared_field: str, shared: int, ranks: int) -> GroupedHeads:
        if shared < 1 or heads % shared:
            raise ShardError(shared_field, shared, ranks, f"must divide {heads_field} ({heads})")
        return cls(
            HeadSplit.of(heads_field, heads, ranks, replicable=False),
            HeadSplit.of(shared_field, shared, ranks, replicable=True),
        )

    @property
    def group(self) -> int:
        """Heads per shared head."""
        return self.heads.total // self.shared.total

    def shared_of(self, head: int) -> int:
        return head // self.group


@dataclass(frozen=True, slots=True)
class LayerSplit:
    """One decoder layer's split: its attention (query over KV heads) or Gated DeltaNet (value over
    key heads) mixer, and its MLP columns."""

    index: int
    kind: str
    mlp: DimSplit
    attention: GroupedHeads | None = None
    gdn: GroupedHeads | None = None


@dataclass(frozen=True, slots=True)
class ShardPlan:
    ranks: int
    vocab: DimSplit
    layers: tuple[LayerSplit, ...]

    def replicated_kv_layers(self) -> tuple[int, ...]:
        """Layers whose KV heads are replicated (fewer KV heads than ranks)."""
        return tuple(
            layer.index
            for layer in self.layers
            if layer.attention is not None and layer.attention.shared.replicated
        )
