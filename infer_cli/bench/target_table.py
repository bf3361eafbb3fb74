"""Issue #18's target table from saved `infer bench latency` results, with vLLM's decode beside them.

Each `--save-result` file of `infer bench latency` is one labelled run (a decode path, a commit);
`docs/benchmarks/scripts/vllm_decode.py --save` writes vLLM's decode per step on the same
checkpoint. The table puts every run's whole-step time and its % of that run's own floor (each run
measures its ceilings) in the columns the targets name, the targets above them, vLLM below them and
each run's step over vLLM's; `breakdown_rows` gives where each step went (--breakdown runs only).
This reads files and formats text: nothing here measures.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infer_cli.bench.step_profile import StepBreakdown

# Issue #18's targets (docs/benchmarks/qwen3.md, gemma4.md): % of floor per decode batch, and of the
# matmul floor per prefill length; the same for Qwen3-4B and Gemma 4 12B.
DECODE_TARGETS = {1: 85.0, 8: 80.0, 64: 70.0}
PREFILL_TARGETS = {1024: 50.0, 8192: 75.0}


class ResultFileError(ValueError):
    """A file that is not what the table reads; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One measurement: the whole step's ms, its floor and, for decode, the stream-rate floor."""

    ms: float
    floor_ms: float
    stream_floor_ms: float | None
    breakdown: StepBreakdown | None
    allocator: Mapping[str, int] | None

    @property
    def pct(self) -> float:
        return 100.0 * self.floor_ms / self.ms

    @property
    def stream_pct(self) -> float | None:
        return None if self.stream_floor_ms is None else 100.0 * self.stream_floor_ms / self.ms


@dataclass(frozen=True, slots=True)
class Column:
    kind: str  # "decode" (key: batch) or "prefill" (key: tokens)
    key: int

    @property
    def title(self) -> str:
        if self.kind == "decode":
            return f"batch {self.key}"
        return f"prefill {self.key // 1024}k" if self.key % 1024 == 0 else f"prefill {self.key}"

    @property
    def target(self) -> float | None:
        return (DECODE_TARGETS if self.kind == "decode" else PREFILL_TARGETS).get(self.key)


@dataclass(frozen=True, slots=True)
class LatencyRun:
    """One `infer bench latency` result file, read for one numeric policy."""

    label: str
    device: str
    cells: Mapping[Column, Cell]
    flags: tuple[str, ...]


def _field(data: Mapping[str, object], key: str, path: Path) -> object:
    if key not in data:
        raise ResultFileError(f"{path}: no {key!r} field (not an `infer bench latency --save-result` file?)")
    return data[key]


def _number(data: Mapping[str, object], key: str, path: Path) -> float:
    value = _field(data, key, path)
    if not isinstance(value, int | float):
        raise ResultFileError(f"{path}: {key!r} is {value!r}, not a number")
    return float(value)


def _breakdown(row: Mapping[str, object], path: Path) -> StepBreakdown | None:
    saved = row.get("breakdown")
    if not isinstance(saved, dict):
        return None
    try:
        return StepBreakdown.from_saved(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise ResultFileError(f"{path}: a breakdown that cannot be read ({exc!r})") from None


def load_latency_run(path: Path, label: str | None = None, policy: str = "tuned") -> LatencyRun:
    """The rows of `path` run under `policy`; the label defaults to the file's stem."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultFileError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ResultFileError(f"{path}: not a JSON object")
    cells: dict[Column, Cell] = {}
    for kind, key, ms_key in (("decode", "batch", "step_ms"), ("prefill", "tokens", "ms")):
        rows = _field(data, kind, path)
        if not isinstance(rows, list):
            raise ResultFileError(f"{path}: {kind!r} is not a list")
        for row in rows:
            if not isinstance(row, dict) or row.get("policy", "tuned") != policy:
                continue
            stream = row.get("stream_floor_ms")
            cells[Column(kind, int(_number(row, key, path)))] = Cell(
                ms=_number(row, ms_key, path),
                floor_ms=_number(row, "floor_ms", path),
                stream_floor_ms=float(stream) if isinstance(stream, int | float) else None,
                breakdown=_breakdown(row, path),
                allocator=row.get("allocator") if isinstance(row.get("allocator"), dict) else None,
            )
    if not cells:
        raise ResultFileError(f"{path}: no decode or prefill row under policy {policy!r}")
    return LatencyRun(label or path.stem, str(data.get("device", "?")), cells, run_flags(data))


def run_flags(settings: Mapping[str, object]) -> tuple[str, ...]:
    """What a run set apart from the defaults, from the settings `infer bench latency` saves with
    its results (the same words its table title prints)."""
    flags: list[str] = []
    if settings.get("async_scheduling"):
        flags.append("async scheduling")
    if settings.get("prefill_graphs"):
        flags.append("prefill graphs")
    if settings.get("attention_backend"):
        flags.append(f"attention {settings['attention_backend']}")
    if settings.get("decode_fusion"):
        flags.append("decode fusion")
    temperature = settings.get("temperature")
    if isinstance(temperature, int | float) and temperature > 0:
        flags.append(f"temperature {temperature:g}, {settings.get('sampling_backend')} draw")
    tp = settings.get("tensor_parallel_size")
    if isinstance(tp, int) and tp > 1:
        flags.append(f"TP {tp}")
    if settings.get("graphs") is False:
        flags.append("eager")
    return tuple(flags)


def load_vllm_decode(path: Path) -> dict[int, float]:
    """vLLM's decode ms per step by batch, from `vllm_decode.py --save`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultFileError(f"{path}: {exc}") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ResultFileError(f"{path}: no 'rows' list (not a vllm_decode.py --save file?)")
    return {int(_number(r, "batch", path)): _number(r, "decode_ms_per_step", path) for r in rows}


def columns_of(runs: Sequence[LatencyRun]) -> list[Column]:
    """Every measured column, decode batches then prefill lengths, each ascending."""
    seen = {column for run in runs for column in run.cells}
    return sorted(seen, key=lambda c: (c.kind != "decode", c.key))


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return ""
    if cell.stream_pct is None:
        return f"{cell.ms:.2f} ms ({cell.pct:.1f} %)"
    return f"{cell.ms:.2f} ms ({cell.pct:.1f} %; stream {cell.stream_pct:.1f} %)"


def target_rows(
    runs: Sequence[LatencyRun], vllm: Mapping[int, float] | None = None, vllm_label: str = "vLLM 0.24"
) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the target table: targets, each run, the first run's floors, vLLM,
    each run over vLLM, and whether each run met each target."""
    if not runs:
        raise ValueError("no latency runs to tabulate")
    columns = columns_of(runs)
    header = ["", *(c.title for c in columns)]
    rows = [["target", *(f"≥ {c.target:.0f} %" if c.target is not None else "" for c in columns)]]
    for run in runs:
        rows.append([f"infer step, {run.label}", *(_cell_text(run.cells.get(c)) for c in columns)])
    first = runs[0]
    rows.append(
        [
            f"floor ({first.label})",
            *(f"{first.cells[c].floor_ms:.2f} ms" if c in first.cells else "" for c in columns),
        ]
    )
    if vllm:
        rows.append(
            [
                f"{vllm_label} decode per step",
                *(f"{vllm[c.key]:.2f} ms" if _vllm_has(vllm, c) else "" for c in columns),
            ]
        )
        for run in runs:
            rows.append(
                [
                    f"infer / vLLM, {run.label}",
                    *(
                        f"{run.cells[c].ms / vllm[c.key]:.2f}"
                        if c in run.cells and _vllm_has(vllm, c)
                        else ""
                        for c in columns
                    ),
                ]
            )
    for run in runs:
        rows.append([f"met, {run.label}", *(_met(run.cells.get(c), c) for c in columns)])
    return header, rows


def _vllm_has(vllm: Mapping[int, float], column: Column) -> bool:
    return column.kind == "decode" and column.key in vllm


def _met(cell: Cell | None, column: Column) -> str:
    if cell is None or column.target is None:
        return ""
    return "yes" if cell.pct >= column.target else "no"


def breakdown_rows(runs: Sequence[LatencyRun]) -> tuple[list[str], list[list[str]]]:
    """Per run and step: ms, device busy, host gap, kernels, and the allocator's device calls."""
    header = [
        "run",
        "step",
        "step ms",
        "busy ms",
        "host gap ms",
        "kernels",
        "allocator (allocs/frees/retries)",
    ]
    rows: list[list[str]] = []
    for run in runs:
        for column in columns_of([run]):
            cell = run.cells[column]
            b = cell.breakdown
            alloc = cell.allocator
            rows.append(
                [
                    run.label,
                    column.title,
                    f"{cell.ms:.3f}",
                    "" if b is None else f"{b.busy_ms:.3f}",
                    "" if b is None else f"{b.host_gap_ms:.3f}",
                    "" if b is None else f"{b.kernels_per_step:.0f}",
                    ""
                    if alloc is None
                    else "/".join(
                        str(alloc.get(k, "?")) for k in ("device_allocs", "device_frees", "retries")
                    ),
                ]
            )
    return header, rows


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
