"""The seam between the generic scheduler and a model: one step's batch in, sampled tokens out.

The scheduler decides which tokens of which requests run this step and where their KV lives; a
`ModelRunner` runs the forward over exactly that and samples. It never sees queues or lifecycles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.contract import SamplingParams, TokenLogprob


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One request's share of a step: a prefill chunk or a single decode token."""

    request_id: str
    token_ids: tuple[int, ...]
    # Position of token_ids[0] in the request's sequence.
    start_pos: int
    # Per KV group, the page ids covering positions [0, start_pos + len(token_ids)); index i holds
    # positions [16i, 16i + 16). Pages a sliding group has released read as the padding page 0.
    page_tables: tuple[tuple[int, ...], ...]
    # Whether the row's last token yields a new token (a decode row, or a prompt's last chunk).
    sample: bool
    sampling: SamplingParams
    # Prompt plus generated tokens so far, read-only; for runners whose output depends on history.
    context: Sequence[int]
    num_generated: int

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepBatch:
    rows: tuple[BatchRow, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


class ModelRunner(Protocol):
    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        """One forward over the batch; a token for each row with `sample`, None for the others."""
        ...
