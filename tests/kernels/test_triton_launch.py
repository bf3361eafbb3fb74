"""FastLaunch reuses a compiled kernel only for a call Triton would specialise the same way.

A stand-in kernel records whether a call went through Triton's dispatch (which compiles when it
must and returns the compiled kernel) or straight to the compiled kernel's launcher, and with what
arguments. The GPU side (the same bits through both paths, and under graph capture) is
test_triton_launch_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kernels.triton import launch
from kernels.triton.launch import FastLaunch

NO_DEFAULT = object()


@dataclass
class _Param:
    name: str
    is_constexpr: bool = False
    default: object = NO_DEFAULT


@dataclass
class _Compiled:
    calls: list[tuple[object, ...]]
    function: str = "function"
    packed_metadata: str = "metadata"

    def run(self, *args: object) -> None:
        self.calls.append(args)


@dataclass
class _Kernel:
    params: list[_Param]
    dispatched: list[tuple[tuple[int, ...], tuple[object, ...], dict[str, object]]] = field(
        default_factory=list
    )
    launched: list[tuple[object, ...]] = field(default_factory=list)

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def dispatch(*args: object, **kwargs: object) -> _Compiled:
            self.dispatched.append((grid, args, kwargs))
            return _Compiled(self.launched)

        return dispatch


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> _Kernel:
    monkeypatch.setattr(launch, "_launchable", lambda _: True)
    monkeypatch.setattr(launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(launch, "_current_device_and_stream", lambda: (0, 777))
    return _Kernel(
        [
            _Param("x_ptr"),
            _Param("n"),
            _Param("eps"),
            _Param("BLOCK", is_constexpr=True),
            _Param("MODE", is_constexpr=True, default=3),
        ]
    )


def _buffer(offset: int = 0) -> torch.Tensor:
    return torch.zeros(64, dtype=torch.bfloat16)[offset:]


def test_a_second_call_of_the_same_specialization_goes_straight_to_the_launcher(kernel: _Kernel) -> None:
    fast = FastLaunch(kernel)
    x = _buffer()
    fast[(4,)](x, 32, 1e-6, BLOCK=128, num_warps=4)
    assert len(kernel.dispatched) == 1 and not kernel.launched
    y = _buffer()  # another aligned buffer, another multiple of 16, another float
    fast[(5, 2)](y, 48, 1e-5, BLOCK=128, num_warps=4)
    assert len(kernel.dispatched) == 1
    # grid padded to three, the stream, the compiled handles, no launch metadata or hooks, then
    # every parameter in order: positional, keywords, defaults
    assert kernel.launched == [(5, 2, 1, 777, "function", "metadata", None, None, None, y, 48, 1e-5, 128, 3)]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((0, 32), (1, 32)),  # an address 16-byte aligned, then not
        ((0, 32), (0, 33)),  # a multiple of 16, then not
        ((0, 17), (0, 1)),  # then 1 (which Triton makes a constant)
        ((0, 17), (0, 2**31)),  # past int32
        ((0, 17), (0, 2**63)),  # past int64
    ],
    ids=["alignment", "multiple-of-16", "one", "int64", "uint64"],
)
def test_a_call_triton_would_specialise_differently_is_dispatched(
    kernel: _Kernel, first: tuple[int, int], second: tuple[int, int]
) -> None:
    fast = FastLaunch(kernel)
    fast[(1,)](_buffer(first[0]), first[1], 1e-6, BLOCK=128)
    fast[(1,)](_buffer(second[0]), second[1], 1e-6, BLOCK=128)
    assert len(kernel.dispatched) == 2 and not kernel.launched
    fast[(1,)](_buffer(second[0]), second[1], 1e-6, BLOCK=128)  # now seen: straight to the launcher
    assert len(kernel.dispatched) == 2 and len(kernel.launched) == 1


def test_constexprs_and_launch_options_key_by_value(kernel: _Kernel) -> None:
    fast = FastLaunch(kernel)
    x = _buffer()
    fast[(1,)](x, 16, 1e-6, BLOCK=128)
    fast[(1,)](x, 16, 1e-6, BLOCK=256)
    fast[(1,)](x, 16, 1e-6, BLOCK=128, MODE=4)
    fast[(1,)](x, 16, 1e-6, BLOCK=128, num_warps=8)
    fast[(1,)](x, 16, 1e-6, 256)  # a constexpr given by position: its value keys too
    assert len(kernel.dispatched) == 5 and not kernel.launched
    fast[(1,)](x, 16, 1e-6, BLOCK=128, MODE=4)
    assert kernel.launched[-1][-2:] == (128, 4)


def test_a_dtype_change_is_dispatched(kernel: _Kernel) -> None:
    fast = FastLaunch(kernel)
    fast[(1,)](torch.zeros(8, dtype=torch.bfloat16), 16, 1e-6, BLOCK=128)
    fast[(1,)](torch.zeros(8, dtype=torch.float32), 16, 1e-6, BLOCK=128)
    assert len(kernel.dispatched) == 2


def test_arguments_it_does_not_know_always_take_triton_s_path(kernel: _Kernel) -> None:
    fast = FastLaunch(kernel)
    for _ in range(2):
        fast[(1,)](_buffer(), [16], 1e-6, BLOCK=128)  # a list
        fast[(1,)](_buffer(), 16, object(), BLOCK=128)  # an object of no known kind
        fast[(1,)](16, 1e-6, BLOCK=128, x_ptr=_buffer())  # a tensor by keyword
        fast[(1,)](_buffer(), 16, 1e-6, BLOCK=[128])  # an unhashable constexpr
    assert len(kernel.dispatched) == 8 and not kernel.launched


def test_an_installed_launch_hook_keeps_every_call_on_triton_s_path(
    kernel: _Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch, "_hooks_installed", lambda: True)
    fast = FastLaunch(kernel)
    for _ in range(3):
        fast[(1,)](_buffer(), 16, 1e-6, BLOCK=128)
    assert len(kernel.dispatched) == 3 and not kernel.launched


def test_a_kernel_that_is_not_a_jit_function_always_takes_its_own_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interpreter's kernels (TRITON_INTERPRET, every CPU test) and autotuners."""
    stand_in = _Kernel([_Param("x_ptr")])
    fast = FastLaunch(stand_in)  # the real _launchable: not a JITFunction
    for _ in range(2):
        fast[(1,)](_buffer())
    assert len(stand_in.dispatched) == 2 and not stand_in.launched


def _sample_arguments() -> list[object]:
    ints = [-(2**63), -(2**31) - 1, -(2**31), -17, -16, -1, 0, 1, 2, 15, 16, 17, 32, 48]
    ints += [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
    tensors = [
        torch.zeros(40, dtype=dtype)[offset:]
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64)
        for offset in (0, 1, 2, 8)
    ]
    return [*ints, True, False, 0.5, -2.0, None, *tensors]


def test_equal_keys_mean_equal_triton_specializations() -> None:
    """The key is at least as fine as what the installed Triton specialises on: any two arguments
    with the same key get the same specialization from Triton's own function (the finest form,
    value and alignment specialisation both on)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    samples = _sample_arguments()
    keys = [launch._call_key(0, (value,), (False,), {}) for value in samples]
    triton_says = [native_specialize_impl(BaseBackend, value, False, True, True) for value in samples]
    assert None not in keys
    for i, (key_a, spec_a) in enumerate(zip(keys, triton_says, strict=True)):
        for key_b, spec_b, value_b in zip(keys[i + 1 :], triton_says[i + 1 :], samples[i + 1 :], strict=True):
            if key_a == key_b:
                assert spec_a == spec_b, f"{samples[i]!r} and {value_b!r} share a key, not a specialization"
