"""Per-request state slots for models with recurrent layers (Qwen3.5's Gated DeltaNet), beside
the paged KV groups and not inside them.

A model declares its state once, as a `StateShape`; `StatePools` holds one conv-state and one
recurrent-state tensor for all of its recurrent layers, indexed by slot; `SlotPool` is the
scheduler's bookkeeping of which slots are taken. Slot 0 is padding, as page 0 is: CUDA-graph
filler rows and diagnostic forwards (start-up profiling, scoring) read and write it, no request
ever holds it. A request holds one slot from admission to its finish, abort or preemption; the slot
addresses every recurrent layer. With prefix caching, the pool's last `snapshot_slots` slots hold
state snapshots instead (engine/kv/snapshots.py), filled and read by `copy_slots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PADDING_SLOT = 0


@dataclass(frozen=True, slots=True)
class StateShape:
    """The state one request keeps per recurrent layer: the conv's last inputs ``conv`` =
    ``(W - 1, channels)`` in the model's dtype, and the recurrent state ``recurrent`` =
    ``(value heads, V, K)`` in fp32."""

    num_layers: int
    conv: tuple[int, int]
    recurrent: tuple[int, int, int]

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        conv = self.conv[0] * self.conv[1] * torch.empty((), dtype=conv_dtype).element_size()
        recurrent = self.recurrent[0] * self.recurrent[1] * self.recurrent[2] * 4
        return self.num_layers * (conv + recurrent)


class StatePools:
    """The device tensors: ``conv [layers, slots, W - 1, D]`` and ``recurrent [layers, slots, Hv,
    V, K]`` fp32, zero-filled; empty until start-up allocates them."""

    def __init__(self, shape: StateShape, conv_dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        self.conv_dtype = conv_dtype
        self.device = device
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.snapshot_slots = 0

    @property
    def num_slots(self) -> int:
        """Slots allocated, the padding slot and the snapshot slots included (0 before allocation)."""
        return 0 if self.recurrent is None else int(self.recurrent.shape[1])

    @property
    def running_slots(self) -> int:
        """Slots for running requests, the padding slot included: ids [0, running_slots)."""
        return self.num_slots - self.snapshot_slots

    def snapshot_ids(self) -> range:
        """The snapshot slots' ids: the last `snapshot_slots` of the pool."""
        return range(self.running_slots, self.num_slots)

    def bytes_per_slot(self) -> int:
        return self.shape.bytes_per_slot(self.conv_dtype)

    def allocate(self, slots: int, snapshots: int = 0) -> None:
        """`slots` slots for running requests (the padding slot included), then `snapshots` more."""
        if slots < 2:
            raise ValueError(f"a state pool needs at least 2 slots (slot 0 is padding), got {slots}")
        if snapshots < 0:
            raise ValueError(f"snapshots must not be negative, got {snapshots}")
        s = self.shape
        self.snapshot_slots = snapshots
        slots += snapshots
        self.conv = self.recurrent = None
        self.conv = torch.zeros((s.num_layers, slots, *s.conv), dtype=self.conv_dtype, device=self.device)
        self.recurrent = torch.zeros(
            (s.num_layers, slots, *s.recurrent), dtype=torch.float32, device=self.device
        )

    def copy_slots(self, copies: Sequence[tuple[int, int]]) -> None:
        """For each (source, destination), the source slot's state of every layer into the
        destination, in order, on the device's current stream; nothing waits on the host."""
        if self.conv is None or self.recurrent is None:
            raise RuntimeError("the state pool is not allocated yet (start-up allocates it)")
        n = self.num_slots
        for src, dst in copies:
            if not (0 < src < n and 0 < dst < n) or src == dst:
                raise ValueError(f"state copy {src} -> {dst}: slots must differ and lie in 1..{n - 1}")
            self.conv[:, dst].copy_(self.conv[:, src])
            self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def conv_layer(self, index: int) -> torch.Tensor:
        if self.conv is None:
            raise RuntimeError("the state pool is not allocated yet (start-up allocates it)")
        return self.conv[index]

    def recurrent_layer(self, index: int) -> torch.Tensor:
        if self.recurrent is None:
            raise RuntimeError("the state pool is not allocated yet (start-up allocates it)")
        return self.recurrent[index]


class SlotPool:
    """Which of `num_slots` slots are taken (slot 0 never is). Lowest free slot first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1 (slot 0 is padding), got {num_slots}")
        self.total = num_slots - 1
        self._free = list(range(num_slots - 1, PADDING_SLOT, -1))
        self._taken: set[int] = set()

    @property
    def used(self) -> int:
        return len(self._taken)

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._taken.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._taken:
            raise RuntimeError(f"state slot {slot} released but not taken")
        self._taken.remove(slot)
        self._free.append(slot)


def state_pools_of(model: object) -> StatePools | None:
    """The state pools a model declares (its `state` attribute), None for a model without."""
    state = getattr(model, "state", None)
    return state if isinstance(state, StatePools) else None
