"""Chooses cuBLAS, the skinny Triton GEMM, the decode GEMV or the decode MMA per weight shape and row
count, from a measured table.

``infer bench gemm --save-dispatch FILE`` writes a ``ChoiceTable``: per weight shape (N, K, dtype)
one set of ``SkinnySettings`` and, per measured row count, which of ``F.linear`` (cuBLAS), the
skinny kernel, the decode GEMV and the decode MMA was fastest; for each row count that chose the
MMA, the MMA settings it was timed with. ``SkinnyDispatch(table)`` is a ``linear(x, weight)`` that
follows it.

* A call with M rows uses the smallest measured row count ≥ M (its "M bucket"); "ours" runs
  ``skinny_gemm`` with the shape's recorded settings, "gemv" runs ``fused_gemv`` plain (its settings
  a function of the shape; only for buckets up to its ``MAX_ROWS``), "mma" runs ``fused_mma`` plain
  (``Fusion()``) with the bucket's recorded ``MmaSettings`` (only for buckets up to its
  ``MAX_ROWS``; the kernel's row block follows the call's M, so with buckets 8 and 64 a call of 12
  rows would run the 16-row block with the 64 bucket's settings), "cublas" runs ``F.linear``.
* Anything the table does not cover (no entry for the shape or dtype, M beyond the largest measured
  bucket, operands the kernel refuses) runs ``F.linear`` and is logged once per shape and reason,
  naming the shape: never silently, never a wrong result.
* The skinny settings are one per shape, never per bucket, so every bucket that chose "ours"
  computes a row the same way. The MMA's settings are one per shape and row block (1-16 and 17-64
  rows, ``fused_mma.row_block``; the bench keeps one per block and a table holding two in one
  block is refused), and the MMA runs a row the same way at any M of one row block, so its
  buckets within one row block are batch-invariant too; the GEMV's settings depend on the shape
  only. Across a bucket boundary where the choice switches backend, or across the MMA's 16/17
  rows, the dispatch is not (docs/kernels.md).

The `tuned` policy follows the table measured on the device it runs on (`measured_table`), and
cuBLAS for every projection on a device with none (kernels/gemm/dispatch.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.reference import GatedActivation
from kernels.triton.fused_gemv import MAX_ROWS as GEMV_MAX_ROWS
from kernels.triton.fused_gemv import FusedGemvError, Fusion, fused_gemv
from kernels.triton.fused_mma import MAX_ROWS as MMA_MAX_ROWS
from kernels.triton.fused_mma import FusedMmaError, MmaSettings, fused_mma, row_block
from kernels.triton.skinny_gemm import MAX_ROWS, SkinnySettings, SkinnyShapeError, json_int, skinny_gemm

log = logging.getLogger("infer.gemm")

TABLE_FORMAT = "infer-skinny-dispatch/1"

# Tables measured by `infer bench gemm --save-dispatch` (docs/benchmarks/gemm.md), by the device
# name torch reports; files beside this module.
MEASURED_TABLES = {
    "NVIDIA H200": "skinny_dispatch_h200.json",
    "NVIDIA H100 80GB HBM3": "skinny_dispatch_h100.json",
}


# The gated epilogue serves GEMV calls of at most this many rows; wider ones compose the plain GEMV
# and the activation kernel. On an H100 (2026-12-07, 38b9790, docs/benchmarks/gemma4.md) Gemma 4
# 12B's gate/up at M = 2 took the whole decode step to 9.929 / 9.926 ms with the epilogue against
# 9.677 / 9.687 composed, while at M = 1 it gained there (8.922 / 8.922 against 9.019 / 9.008 ms)
# and on Qwen3.5-4B (3.590 / 3.586 against 3.617 / 3.613 ms) and Qwen3-4B (docs/benchmarks/qwen3.md).
GATED_MAX_ROWS = 1


class DispatchTableError(ValueError):
    """A dispatch table that cannot be read; the message names the file or the entry."""


class Backend(StrEnum):
    OURS = "ours"
    CUBLAS = "cublas"
    GEMV = "gemv"
    MMA = "mma"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class ShapeChoice:
    """One weight shape's settings and, per measured row count (ascending), the faster backend;
    ``mma``: per row count that chose the MMA (ascending), the MMA settings it was timed with."""

    n: int
    k: int
    dtype: str
    settings: SkinnySettings
    rows: tuple[tuple[int, Backend], ...]
    mma: tuple[tuple[int, MmaSettings], ...] = ()

    def __post_init__(self) -> None:
        name = f"[{self.n}, {self.k}] {self.dtype}"
        for kernel, backend, limit in (
            ("GEMV", Backend.GEMV, GEMV_MAX_ROWS),
            ("MMA", Backend.MMA, MMA_MAX_ROWS),
        ):
            past = [m for m, chosen in self.rows if chosen is backend and m > limit]
            if past:
                raise DispatchTableError(
                    f"{name}: row counts {past} choose the {kernel}, which takes at most {limit} rows"
                )
        counts = [m for m, _ in self.rows]
        if not counts or counts != sorted(set(counts)) or counts[0] < 1 or counts[-1] > MAX_ROWS:
            raise DispatchTableError(
                f"{name}: row counts {counts} must be distinct, ascending, 1..{MAX_ROWS}"
            )
        mma_rows = [m for m, backend in self.rows if backend is Backend.MMA]
        if [m for m, _ in self.mma] != mma_rows:
            raise DispatchTableError(
                f"{name}: MMA settings for row counts {[m for m, _ in self.mma]}, but the row counts "
                f"choosing the MMA are {mma_rows}: one settings each, no others"
            )
        per_block: dict[int, MmaSettings] = {}
        for m, settings in self.mma:
            kept = per_block.setdefault(row_block(m), settings)
            if kept != settings:
                raise DispatchTableError(
                    f"{name}: row count {m} runs the MMA with {settings.label}, another of its "
                    f"{row_block(m)}-row block with {kept.label}: the settings are one per row block"
                )

    def backend(self, m: int) -> tuple[int, Backend] | None:
        """The bucket for ``m`` rows (the smallest measured row count ≥ m) and its backend."""
        for bucket, backend in self.rows:
            if m <= bucket:
                return bucket, backend
        return None

    def mma_settings(self, bucket: int) -> MmaSettings:
        """The MMA settings recorded for a bucket that chose the MMA (``__post_init__`` holds one)."""
        return next(settings for m, settings in self.mma if m == bucket)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "n": self.n,
            "k": self.k,
            "dtype": self.dtype,
            "settings": self.settings.to_json(),
            "rows": {str(m): backend.value for m, backend in self.rows},
        }
        if self.mma:  # absent where no row chose the MMA: such an entry reads as before the MMA
            data["mma_settings"] = {str(m): settings.to_json() for m, settings in self.mma}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ShapeChoice:
        rows = data.get("rows")
        settings = data.get("settings")
        mma = data.get("mma_settings", {})
        if not isinstance(rows, dict) or not isinstance(settings, dict) or not isinstance(mma, dict):
            raise DispatchTableError(
                f"dispatch entry {data}: 'rows', 'settings' and 'mma_settings' must be objects"
            )
        try:
            parsed = tuple(sorted((int(m), Backend(b)) for m, b in rows.items()))
            parsed_mma = tuple(
                sorted(((int(m), MmaSettings.from_json(s)) for m, s in mma.items()), key=lambda e: e[0])
            )
        except (ValueError, TypeError) as exc:  # FusedMmaError is a ValueError
            raise DispatchTableError(f"dispatch entry {data}: {exc}") from None
        try:
            return cls(
                n=json_int(data, "n", 0),
                k=json_int(data, "k", 0),
                dtype=str(data["dtype"]),
                settings=SkinnySettings.from_json(settings),
                rows=parsed,
                mma=parsed_mma,
            )
        except (KeyError, SkinnyShapeError) as exc:
            raise DispatchTableError(f"dispatch entry {dict(data)}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ChoiceTable:
    """Every measured shape's choice, plus where it was measured (informational)."""

    shapes: tuple[ShapeChoice, ...]
    device: str = ""
    measured_at: str = ""
    _index: dict[tuple[int, int, str], ShapeChoice] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[tuple[int, int, str], ShapeChoice] = {}
        for choice in self.shapes:
            key = (choice.n, choice.k, choice.dtype)
            if key in index:
                raise DispatchTableError(
                    f"dispatch table lists [{choice.n}, {choice.k}] {choice.dtype} twice"
                )
            index[key] = choice
        object.__setattr__(self, "_index", index)

    def lookup(self, n: int, k: int, dtype: torch.dtype) -> ShapeChoice | None:
        return self._index.get((n, k, dtype_name(dtype)))

    def to_json(self) -> dict[str, object]:
        return {
            "format": TABLE_FORMAT,
            "device": self.device,
            "measured_at": self.measured_at,
            "shapes": [choice.to_json() for choice in self.shapes],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ChoiceTable:
        if data.get("format") != TABLE_FORMAT:
            raise DispatchTableError(
                f"dispatch table format {data.get('format')!r}; expected {TABLE_FORMAT!r}"
            )
        shapes = data.get("shapes")
        if not isinstance(shapes, list):
            raise DispatchTableError("dispatch table: 'shapes' must be a list")
        return cls(
            shapes=tuple(ShapeChoice.from_json(entry) for entry in shapes),
            device=str(data.get("device", "")),
            measured_at=str(data.get("measured_at", "")),
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> ChoiceTable:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DispatchTableError(f"dispatch table {path}: {exc}") from None
        return cls.from_json(data)

    @classmethod
    def merged(cls, tables: Iterable[ChoiceTable]) -> ChoiceTable:
        """One table holding every shape of ``tables`` (a shape in two tables is refused)."""
        held = tuple(tables)
        return cls(
            shapes=tuple(choice for table in held for choice in table.shapes),
            device=", ".join(sorted({t.device for t in held if t.device})),
            measured_at=", ".join(sorted({t.measured_at for t in held if t.measured_at})),
        )


def measured_table(device_name: str) -> ChoiceTable | None:
    """The shipped table measured on a device of this name, or None."""
    name = MEASURED_TABLES.get(device_name)
    return None if name is None else ChoiceTable.load(Path(__file__).with_name(name))


class SkinnyDispatch:
    """``linear(x, weight)`` for x [..., K]: the table's backend per shape and M bucket, else F.linear."""

    def __init__(self, table: ChoiceTable) -> None:
        self.table = table
        self._logged: set[tuple[int, int, str, str]] = set()

    def _log_once(self, weight: torch.Tensor, kind: str, what: str, why: str, level: int) -> None:
        n, k = int(weight.shape[0]), int(weight.shape[-1])
        key = (n, k, dtype_name(weight.dtype), kind)
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, "skinny GEMM: weight [%d, %d] %s %s: %s", n, k, key[2], what, why)

    def _fall_back(
        self, x: torch.Tensor, weight: torch.Tensor, kind: str, why: str, level: int = logging.WARNING
    ) -> torch.Tensor:
        self._log_once(weight, kind, "runs F.linear", why, level)
        return F.linear(x, weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() != 2:
            return F.linear(x, weight)  # not a projection; F.linear states its own errors
        n, k = int(weight.shape[0]), int(weight.shape[1])
        choice = self.table.lookup(n, k, weight.dtype)
        if choice is None:
            return self._fall_back(x, weight, "no entry", "no entry in the dispatch table")
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        m = rows.shape[0]
        picked = choice.backend(m)
        if picked is None:
            largest = choice.rows[-1][0]
            # Prefill: cuBLAS is the design past the skinny range, so this is news, not a warning.
            why = f"M={m} is beyond the largest measured M={largest}"
            return self._fall_back(x, weight, "rows", why, level=logging.INFO)
        if picked[1] is Backend.CUBLAS:
            return F.linear(x, weight)
        bucket, backend = picked
        try:
            if backend is Backend.GEMV:
                y = fused_gemv(rows, weight)
            elif backend is Backend.MMA:
                y = fused_mma(rows, weight, Fusion(), choice.mma_settings(bucket))
            else:
                y = skinny_gemm(rows, weight, choice.settings)
        except (SkinnyShapeError, FusedGemvError, FusedMmaError) as exc:
            return self._fall_back(x, weight, "refused", str(exc))
        return y.reshape(*x.shape[:-1], n)

    def linear_gated(
        self, x: torch.Tensor, weight: torch.Tensor, kind: GatedActivation
    ) -> torch.Tensor | None:
        """``reference.linear_gated(x, weight, kind)`` as one launch of the decode GEMV with its gated
        epilogue where the table sends this fused ``[2I, K]`` gate/up weight at x's M to the GEMV
        and M is at most ``GATED_MAX_ROWS``; None elsewhere (the caller composes the linear and the
        activation). The GEMV stores the rounded ``act(gate) · up`` itself, so the step skips the
        activation launch and its link in the PDL chain (docs/kernels.md, "The fused decode GEMV")."""
        if weight.dim() != 2 or x.dim() != 2 or x.shape[0] > GATED_MAX_ROWS:
            return None
        choice = self.table.lookup(int(weight.shape[0]), int(weight.shape[1]), weight.dtype)
        picked = None if choice is None else choice.backend(x.shape[0])
        if picked is None or picked[1] is not Backend.GEMV:
            return None
        try:
            return fused_gemv(x, weight, Fusion(activation=kind))
        except FusedGemvError as exc:
            self._log_once(weight, "gated", "composes its activation", str(exc), logging.WARNING)
            return None
