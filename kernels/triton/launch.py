"""Launch a ``@triton.jit`` kernel through its compiled kernel's own launcher, skipping Triton's
per-call dispatch once Triton has compiled the kernel for a call's specialization.

Why: an eager step (a prefill, a mixed step) launches every Triton kernel from Python, and on the
H100 with Triton 3.6 an RMSNorm call through Triton's dispatch in ``JITFunction.run`` (binding,
specialising every argument, the cache key, launch metadata) cost the host 92 µs, its argument
checks included, against 8.5 µs for the compiled kernel's launcher alone
(docs/benchmarks/scripts/host_launch_costs.py, 2026-12-05). A 1k-token prefill makes ~145 such
launches and was host-bound.

The invariant: a call reuses a compiled kernel only when everything Triton specialises on is the
same as in the call that compiled it. The key here is at least as fine as Triton's: every
constexpr and launch option by value; a tensor by dtype and 16-byte alignment of its address; an
integer by whether it is 1, a multiple of 16, and which integer type holds it; a float or bool by
its type; ``None`` as itself. Any other argument, a kernel that is not a ``JITFunction`` (the
interpreter's, an autotuner), or a launch hook installed (a profiler) takes Triton's own path on
every call. Triton's check that a kernel's globals did not change after it compiled is skipped:
the kernels here read only module constants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from kernels.triton.storage import interpreted

_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63


def _launchable(kernel: object) -> bool:
    return not interpreted() and isinstance(kernel, JITFunction)


def _hooks_installed() -> bool:
    """Whether a launch hook (a profiler's) is installed: Triton's own path then runs it."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _current_device_and_stream() -> tuple[int, int]:
    """The current device and its current stream's handle, as Triton's CUDA driver reads them."""
    device = torch.cuda.current_device()
    return device, torch._C._cuda_getCurrentRawStream(device)


def _call_key(
    device: int,
    args: tuple[object, ...],
    constexpr: tuple[bool, ...],
    kwargs: dict[str, object],
) -> tuple[object, ...] | None:
    """The key of one call: a constexpr positional argument by value, any other by what Triton
    may specialise it on, then the keywords by value in the call's own order; ``None`` for an
    argument this module does not know (the call then takes Triton's path).

    One pass, the commonest kinds first and no function call per argument: a 1k prefill keys
    ~146 launches of ~16 arguments each (an attention-prep call's key: 8.8 µs on the CPU box,
    11.2 with a call per argument)."""
    key: list[object] = [device]
    append = key.append
    for value, is_constexpr in zip(args, constexpr, strict=False):
        if is_constexpr:
            append(value)
        elif type(value) is int:
            # 1, a multiple of 16, and the integer type that holds it, as one small int.
            append(
                (value == 1)
                | (value % 16 == 0) << 1
                | (_I32_MIN <= value <= _I32_MAX) << 2
                | (value >= _U64_MIN) << 3
            )
        elif isinstance(value, torch.Tensor):
            append((value.dtype, value.data_ptr() % 16 == 0))
        elif value is None or type(value) is bool or type(value) is float:
            append(None if value is None else type(value))
        else:
            return None
    # In the call's own order: a call site names its keywords in one order, and another order
    # only costs a dispatch.
    for item in kwargs.items():
        if isinstance(item[1], torch.Tensor):  # a runtime argument by name: not worth a fast path
            return None
        append(item)
    return tuple(key)


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](*args, **kwargs)``
    does (same compiled kernel, same arguments), at the launcher's cost once the specialization has
    been seen. Positional arguments fill the kernel's parameters in order; keywords name the rest
    (and Triton's launch options)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._direct = _launchable(kernel)
        params: Sequence[Any] = kernel.params if self._direct else ()
        self._names = tuple(p.name for p in params)
        self._constexpr = tuple(bool(p.is_constexpr) for p in params)
        self._defaults = tuple(p.default for p in params)
        # key -> (compiled kernel, the values of the parameters after the positional ones)
        self._compiled: dict[tuple[object, ...], tuple[Any, tuple[object, ...]]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if not self._direct or _hooks_installed():
            self.kernel[grid](*args, **kwargs)
            return
        device, stream = _current_device_and_stream()
        key = _call_key(device, args, self._constexpr, kwargs)
        try:
            found = None if key is None else self._compiled.get(key)
        except TypeError:  # an unhashable constexpr
            key = found = None
        if found is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and compiled is not None:
                tail = tuple(
                    kwargs.get(name, default)
                    for name, default in zip(
                        self._names[len(args) :], self._defaults[len(args) :], strict=True
                    )
                )
                self._compiled[key] = (compiled, tail)
            return
        compiled, tail = found
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(
            g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail
        )
