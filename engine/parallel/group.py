"""The collectives a sharded forward runs, behind one small interface.

`SingleRank` is the group of one: every collective is the identity, so a model line's forward is
the same code at any size. `ProcessRankGroup` runs them over a torch.distributed process group:
gloo when the ranks run on the CPU, NCCL when each rank has a GPU of its own (`cuda:RANK`; this
path has not run yet, docs/tensor-parallel.md). Each wait is bounded by the group's timeout: a rank
that stops answering fails the step with an error instead of hanging it. On gloo the host waits,
bounded; on NCCL a wait only orders the current stream after the collective (the host never blocks,
so a step's collectives can be captured in a CUDA graph and launched ahead), and the bound is NCCL's
own watchdog, which aborts a collective that outlives the group's timeout. The group connects on
its first collective; rank 0 first waits for every peer to reach that point while it checks that
their processes are alive (`peers_alive`), so a worker that dies while loading fails start-up at
once (a live one gets `JOIN_TIMEOUT_S`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from engine.contract import EngineFatalError

ROOT = 0


class CollectiveError(EngineFatalError):
    """A collective that failed or did not complete in time; names the operation and the rank. The
    ranks are out of step after it, so it ends the engine."""


class RankGroup(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> torch.device | None:
        """The device this rank runs on when the group fixes it (one GPU per rank), else None."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place; returned for chaining."""
        ...

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` [rows, n] side by side in rank order on rank 0 ([rows, size·n]);
        the other ranks get an empty [rows, 0]: only rank 0 samples."""
        ...

    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        """The elementwise minimum of `values` over the ranks, on every rank."""
        ...


class SingleRank:
    rank = 0
    size = 1
    device = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        return list(values)


SINGLE_RANK = SingleRank()

# Rank 0's poll interval while it waits for its peers to join the group, and how long a live peer
# may take to get there: joining comes after loading the weights, which takes minutes on a large
# checkpoint, so it is not held to the collective timeout; a peer that dies fails it at once.
_JOIN_POLL_S = 0.2
JOIN_TIMEOUT_S = 900.0


def _joined_key(rank: int) -> str:
    return f"joined/{rank}"


class BackendUnavailableError(RuntimeError):
    """The collective backend the ranks' device needs is not in this torch build."""


def rank_device(device_type: str, rank: int) -> torch.device | None:
    """Where rank `rank` runs: its own GPU (`cuda:RANK`) on CUDA; on the CPU the group fixes none."""
    return torch.device("cuda", rank) if device_type == "cuda" else None


def _process_group(
    store: dist.Store, rank: int, size: int, timeout: timedelta, device: torch.device | None
) -> Any:
    """gloo on the CPU, NCCL on GPUs (each rank's tensors on its own device)."""
    if device is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not dist.is_nccl_available():
        raise BackendUnavailableError(
            f"tensor parallelism on {device.type}: this torch build ({torch.__version__}) has no NCCL"
        )
    torch.cuda.set_device(device)
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, size, options)


class ProcessRankGroup:
    """One rank's membership of a process group over `store`: gloo when `device` is None (CPU
    ranks), NCCL when it names this rank's GPU."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout_s: float,
        peers_alive: Callable[[], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._store = store
        self._rank = rank
        self._size = size
        self._device = device
        self.timeout = timedelta(seconds=timeout_s)
        self._peers_alive = peers_alive
        # A ProcessGroupGloo or ProcessGroupNCCL: their collectives are bound methods the type
        # stubs do not declare.
        self._group: Any = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def backend(self) -> str:
        return "gloo" if self._device is None else "nccl"

    def _pg(self) -> Any:
        if self._group is None:
            self._store.set(_joined_key(self._rank), "1")
            if self._rank == ROOT:
                self._wait_for_peers()
            self._group = _process_group(self._store, self._rank, self._size, self.timeout, self._device)
        return self._group

    def _wait_for_peers(self) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        waiting = [_joined_key(r) for r in range(1, self._size)]
        while waiting:
            if self._peers_alive is not None:
                self._peers_alive()
            if time.monotonic() > deadline:
                raise CollectiveError(f"{waiting} did not join within {JOIN_TIMEOUT_S} s")
            waiting = [key for key in waiting if not self._store.check([key])]
            if waiting:
                time.sleep(_JOIN_POLL_S)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            if self._device is None:
                work.wait(self.timeout)
            else:
                # A timeout here would make the host poll the collective to completion: a sync per
                # all-reduce, and illegal inside a graph capture. The watchdog holds the timeout.
                work.wait()
        except RuntimeError as exc:
            raise CollectiveError(f"rank {self._rank}: {what} failed: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._wait(self._pg().allreduce([tensor]), "all-reduce")
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        options = dist.GatherOptions()
        options.rootRank = ROOT
        if self._rank != ROOT:
            self._wait(self._pg().gather([], [tensor], options), "gather")
            return tensor.new_empty((tensor.shape[0], 0))
        parts = [torch.empty_like(tensor) for _ in range(self._size)]
        self._wait(self._pg().gather([parts], [tensor], options), "gather")
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        group = self._pg()
        tensor = torch.tensor(list(values), dtype=torch.long, device=self._device)
        self._wait(group.allreduce([tensor], dist.ReduceOp.MIN), "min all-reduce")
        return [int(v) for v in tensor.tolist()]
