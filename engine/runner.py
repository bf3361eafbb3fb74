"""The seam between the generic scheduler and a model: one step's batch in, sampled tokens out.

The scheduler decides which tokens of which requests run this step and where their KV lives; a
`ModelRunner` runs the forward over exactly that and samples. It never sees queues or lifecycles.
Overlapped prefill adds `launch_prefill` (docs/engine.md): a runner with no second stream gets it
from `launch_prefill(runner, batch)`, which runs the forward at once and hands back a done handle.
Async scheduling adds `launch_step` the same way: a step launched before the previous one's tokens
are read, its decode rows fed from that step's sampled ids where they live (`BatchRow.feed_from`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from engine.contract import SamplingParams, TokenLogprob

# The host's stand-in for a token still on the device (`BatchRow.feed_from`): not a token id, so a
# runner that used it as one fails instead of computing with a wrong token.
FED_TOKEN = -1


@dataclass(slots=True)
class BatchRow:
    """One request's share of a step: a prefill chunk or a single decode token. Read-only by
    convention, not frozen: one is built per row per step, and a frozen dataclass's constructor
    costs 2.5× a plain one's there (docs/benchmarks/host-cpu.md); the same holds for
    `SampledToken` and `engine.contract.RequestUpdate`."""

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
    # The request's state slot (recurrent models, engine/kv/state_pool.py); 0, the padding slot,
    # for models without state and for diagnostic rows.
    state_slot: int = 0
    # Async scheduling: this decode row's one token is the one sampled for row `feed_from` of the
    # step launched just before it, not yet known on the host; `token_ids` then holds
    # `FED_TOKEN` and `context` lacks that token.
    feed_from: int | None = None

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @classmethod
    def whole_prompt(
        cls, request_id: str, token_ids: Sequence[int], page_tables: tuple[tuple[int, ...], ...]
    ) -> BatchRow:
        """A prompt prefilled in one row from position 0, greedy (start-up profiling, scoring)."""
        tokens = tuple(token_ids)
        return cls(request_id, tokens, 0, page_tables, True, SamplingParams(), tokens, 0)


@dataclass(frozen=True, slots=True)
class StepBatch:
    rows: tuple[BatchRow, ...]
    # Recurrent models with prefix caching (engine/kv/snapshots.py): state-slot copies (source,
    # destination) a runner makes in order before the forward (a prefix hit's snapshot into the
    # request's slot) and after it (a row's slot into a snapshot, at a page boundary it ended on).
    restore_state: tuple[tuple[int, int], ...] = ()
    snapshot_state: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


class ModelRunner(Protocol):
    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        """One forward over the batch; a token for each row with `sample`, None for the others."""
        ...


class PrefillHandle(Protocol):
    """A prefill forward launched to run beside the decode steps; collected exactly once."""

    def done(self) -> bool:
        """Whether every kernel of the forward has finished. Never blocks."""
        ...

    def collect(self) -> list[SampledToken | None]:
        """Wait for the forward if it is still running, then sample: a token for each row with
        `sample`, None for the others (as `ModelRunner.execute` answers)."""
        ...


@dataclass(slots=True)
class ReadyPrefill:
    """A forward (a prefill, or a step under async scheduling) that already ran to completion when
    it was launched: its results are on the host."""

    results: list[SampledToken | None]

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def collect(self) -> list[SampledToken | None]:
        return self.results


@runtime_checkable
class OverlappingRunner(ModelRunner, Protocol):
    def launch_prefill(self, batch: StepBatch) -> PrefillHandle:
        """Start one forward over `batch` (prefill rows) on the runner's own stream and attention
        state, and return without waiting for it. The caller keeps every page in the rows' tables
        allocated to them, and each row's `context` unchanged, until the handle is collected. If
        this raises, nothing it started is still running."""
        ...


def launch_prefill(runner: ModelRunner, batch: StepBatch) -> PrefillHandle:
    """`runner.launch_prefill(batch)`, or, for a runner that cannot overlap, the forward run now."""
    if isinstance(runner, OverlappingRunner):
        return runner.launch_prefill(batch)
    return ReadyPrefill(runner.execute(batch))


class StepHandle(Protocol):
    """A step launched under async scheduling; collected exactly once, in launch order."""

    def done(self) -> bool:
        """Whether the step's tokens are ready to read. Never blocks."""
        ...

    def wait(self) -> None:
        """Block until the step has finished on the device, without reading its tokens (`collect`
        still reads them, once)."""
        ...

    def collect(self) -> list[SampledToken | None]:
        """Wait for the step if it is still running and read its tokens: one for each row with
        `sample`, None for the others (as `ModelRunner.execute` answers)."""
        ...


@runtime_checkable
class PipelinedRunner(ModelRunner, Protocol):
    def launch_step(self, batch: StepBatch, feed: StepHandle | None) -> StepHandle:
        """Start one step over `batch` and return without waiting for it or for `feed`, the step
        launched just before (None when there is none, or it was collected). A row with `feed_from`
        takes as its token the one `feed` sampled for that row, resolved where `feed`'s tokens are
        (on the device), and samples with `num_generated` as given (it counts the fed token). The
        batch's state copies run as `execute` runs them: the restores before the forward, the
        snapshots after it, queued behind every step launched before. The caller keeps every page
        in the rows' tables and every row's state slot allocated until the handle is collected. If
        this raises, nothing it started is still running."""
        ...


class FeedError(RuntimeError):
    """A row asked for a fed token that the step it names cannot give."""


def resolve_feeds(batch: StepBatch, feed: StepHandle | None) -> StepBatch:
    """`batch` with every `feed_from` row's token read from `feed`, a step whose results are on the
    host already (a `ReadyPrefill`): what a runner that cannot keep tokens on a device runs."""
    if all(row.feed_from is None for row in batch.rows):
        return batch
    if not isinstance(feed, ReadyPrefill):
        raise FeedError(f"rows are fed from {type(feed).__name__}, which holds no host results")
    rows = []
    for row in batch.rows:
        if row.feed_from is not None:
            if not 0 <= row.feed_from < len(feed.results):
                raise FeedError(
                    f"row of {row.request_id!r}: feed_from={row.feed_from} is outside the feeding "
                    f"step's {len(feed.results)} rows"
                )
            sampled = feed.results[row.feed_from]
            if sampled is None:
                raise FeedError(
                    f"row of {row.request_id!r}: feed_from={row.feed_from} names a row that sampled nothing"
                )
            row = replace(row, token_ids=(sampled.token_id,), feed_from=None)
        rows.append(row)
    return replace(batch, rows=tuple(rows))


def launch_step(runner: ModelRunner, batch: StepBatch, feed: StepHandle | None) -> StepHandle:
    """`runner.launch_step(batch, feed)`, or, for a runner that keeps nothing on a device, the step
    run now over `batch` with its fed tokens resolved from `feed`'s results."""
    # A `PipelinedRunner` is a `ModelRunner` with `launch_step`: asked by attribute, as isinstance
    # against a runtime-checkable protocol costs about 5 µs, and this runs once per step.
    launch = getattr(runner, "launch_step", None)
    if launch is not None:
        return launch(batch, feed)
    return ReadyPrefill(runner.execute(resolve_feeds(batch, feed)))
