"""`--gdn-backend auto`: per phase (prefill, decode), the fastest backend on this device among those
that agree with the spec (kernels/gdn/agreement.py).

The choice comes from `RECORDED` when it holds this device and geometry (rows written from
`infer bench gdn` and the agreement gate on that device), otherwise from a measurement at start-up
(`warm_up`: every available backend on one prefill batch and one decode step of the model's
geometry, checked for agreement, then timed). Until `warm_up` runs, each phase uses the first
available backend of `UNMEASURED_ORDER`. Every choice is logged with its reason.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kernels.gdn.agreement import AgreementCase, AgreementRun
from kernels.gdn.base import GDNBackend, GDNGeometry, StateRows
from kernels.reference import SpecError

log = logging.getLogger("infer.kernels.gdn")

PHASES = ("prefill", "decode")
# Before any measurement: fla-core's prefill (verified by the gate before FlashInfer's) and the
# slot-indexed Triton decode step it carries, then torch.
UNMEASURED_ORDER = ("fla", "torch")
# The start-up measurement's batches: a prefill of mixed lengths and a 64-row decode step.
MEASURE_LENGTHS = (1, 63, 64, 65, 1000)
MEASURE_DECODE_ROWS = 64
TIMED_RUNS = 5


@dataclass(frozen=True, slots=True)
class RecordedChoice:
    prefill: str
    decode: str
    source: str  # where the figures are: a docs/benchmarks page and its date


# (torch.cuda.get_device_name(), geometry) → choice, for the geometries whose agreement gate and
# `infer bench gdn` ran on that device; start-up measures where it holds nothing (other devices,
# a rank's share of the heads under tensor parallelism).
RECORDED: dict[tuple[str, GDNGeometry], RecordedChoice] = {
    # Qwen3.5-4B and 9B (one GDN geometry). Prefill: FlashInfer 1.7-8.4x faster than fla-core at
    # 1k-32k tokens. Decode: both run infer's slot-indexed Triton step, within noise of each other.
    ("NVIDIA H200", GDNGeometry(16, 32, 128, 128)): RecordedChoice(
        prefill="flashinfer", decode="fla", source="docs/benchmarks/qwen35.md, 2026-12-05"
    ),
}


class AutoGDN(GDNBackend):
    """Routes prefill batches (host boundaries given) and decode steps to the backend chosen for
    each phase; the conv runs on the chosen backend's (the GPU backends share kernels/gdn/triton_conv.py)."""

    name = "auto"

    def __init__(self, device: torch.device, available: Mapping[str, GDNBackend]) -> None:
        if "torch" not in available:
            raise ValueError("auto needs the torch backend among the available ones")
        self.device = device
        self.available = dict(available)
        first = next(name for name in (*UNMEASURED_ORDER, "torch") if name in self.available)
        self.chosen = {phase: self.available[first] for phase in PHASES}
        self._measured: set[GDNGeometry] = set()
        log.info(
            "--gdn-backend auto on %s: %s for both phases until start-up measures (available: %s)",
            device,
            first,
            ", ".join(self.available),
        )

    def describe(self) -> str:
        return f"auto (prefill: {self.chosen['prefill'].name}, decode: {self.chosen['decode'].name})"

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, rows: StateRows, conv_pool: torch.Tensor
    ) -> torch.Tensor:
        return self._for(rows).conv(x, weight, rows, conv_pool)

    def conv_pieces(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: StateRows,
        conv_pool: torch.Tensor,
        widths: Sequence[int],
    ) -> tuple[torch.Tensor, ...]:
        return self._for(rows).conv_pieces(x, weight, rows, conv_pool, widths)

    def delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        state_pool: torch.Tensor,
    ) -> torch.Tensor:
        return self._for(rows).delta_rule(q, k, v, g, beta, rows, state_pool)

    def _for(self, rows: StateRows) -> GDNBackend:
        """The backend chosen for the step's phase: prefill with host `cu_seqlens`, else decode."""
        return self.chosen["prefill" if rows.cu_seqlens is not None else "decode"]

    def warm_up(self, geometry: GDNGeometry, dtype: torch.dtype, device: torch.device) -> None:
        if geometry in self._measured:
            return
        self._measured.add(geometry)
        usable = self._covering(geometry, dtype)
        for backend in usable.values():
            backend.warm_up(geometry, dtype, device)
        if len(usable) == 1:
            self.chosen = {phase: usable["torch"] for phase in PHASES}
            log.info("--gdn-backend auto on %s: torch, the only backend here for %s", device, geometry)
            return
        key = (torch.cuda.get_device_name(device), geometry)
        recorded = RECORDED.get(key)
        if recorded is not None and {recorded.prefill, recorded.decode} <= set(usable):
            self.chosen = {"prefill": usable[recorded.prefill], "decode": usable[recorded.decode]}
            log.info(
                "--gdn-backend auto: %s, recorded for %s %s (%s)", self.describe(), *key, recorded.source
            )
            return
        for phase in PHASES:
            self.chosen[phase] = self._measure(phase, usable, geometry, dtype, device)
        log.info("--gdn-backend auto: %s, measured at start-up on %s", self.describe(), key[0])

    def _covering(self, geometry: GDNGeometry, dtype: torch.dtype) -> dict[str, GDNBackend]:
        """The available backends that cover this geometry and dtype (torch covers all)."""
        usable: dict[str, GDNBackend] = {}
        for name, backend in self.available.items():
            try:
                backend.check(geometry, dtype)
            except SpecError as exc:
                log.info("--gdn-backend auto: %s left out for %s, %s: %s", name, geometry, dtype, exc)
                continue
            usable[name] = backend
        return usable

    def _measure(
        self,
        phase: str,
        usable: Mapping[str, GDNBackend],
        geometry: GDNGeometry,
        dtype: torch.dtype,
        device: torch.device,
    ) -> GDNBackend:
        lengths = MEASURE_LENGTHS if phase == "prefill" else None
        sequences = len(MEASURE_LENGTHS) if phase == "prefill" else MEASURE_DECODE_ROWS
        run = AgreementRun(AgreementCase(geometry, lengths, sequences, True, dtype), device)
        timings: dict[str, float] = {}
        for name, backend in usable.items():
            agreement = run.check(backend)
            if not agreement.passed:
                log.warning("--gdn-backend auto: %s left out of %s: %s", name, phase, agreement.line())
                continue
            timings[name] = _time(run.timed_call(backend), device)
        best = min(timings, key=timings.__getitem__)
        log.info(
            "--gdn-backend auto, %s: %s",
            phase,
            ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in sorted(timings.items(), key=lambda kv: kv[1])),
        )
        return usable[best]


def _time(call: Callable[[], object], device: torch.device) -> float:
    """Median seconds of `call` after one untimed run."""
    call()
    times = []
    for _ in range(TIMED_RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
