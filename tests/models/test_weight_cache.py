"""`reusing_weights`: a process building several engines over one checkpoint reads it once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from models.checkpoint import WeightCache, load_checked, reusing_weights, stored_tensors
from models.qwen3.config import parse_qwen3_config
from models.qwen3.weights import expected_tensors, ignored_tensor


def _load(path: Path) -> dict[str, torch.Tensor]:
    expected = expected_tensors(parse_qwen3_config(path))
    return load_checked(
        path,
        expected,
        stored_tensors(path),
        torch.device("cpu"),
        torch.float32,
        ignore=ignored_tensor,
    )


def test_a_second_load_reads_nothing_and_shares_the_tensors(tiny_qwen3: Path) -> None:
    cache = WeightCache()
    with reusing_weights(cache):
        first = _load(tiny_qwen3)
        reads = cache.reads
        second = _load(tiny_qwen3)
    assert reads == len(first) > 0
    assert cache.reads == reads, "the second load read tensors again"
    assert cache.hits == len(first)
    assert list(second) == list(first)
    assert all(second[name] is first[name] for name in first)


def test_outside_the_block_nothing_is_cached(tiny_qwen3: Path) -> None:
    cache = WeightCache()
    with reusing_weights(cache):
        first = _load(tiny_qwen3)
    again = _load(tiny_qwen3)
    assert cache.reads == len(first) and cache.hits == 0
    assert all(again[name] is not first[name] and torch.equal(again[name], first[name]) for name in first)


def test_a_rewritten_shard_is_read_again(tiny_qwen3: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3, copy)
    cache = WeightCache()
    with reusing_weights(cache):
        first = _load(copy)
        for shard in copy.glob("*.safetensors"):
            stat = shard.stat()
            os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        second = _load(copy)
    assert cache.reads == 2 * len(first)
    assert all(second[name] is not first[name] for name in first)


def test_checks_still_run_on_a_cached_load(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A cached tensor never hides a fault: the second load asks for a tensor the checkpoint lacks."""
    cache = WeightCache()
    path = tiny_qwen3
    expected = dict(expected_tensors(parse_qwen3_config(path)))
    with reusing_weights(cache):
        _load(path)
        name = next(iter(expected))
        expected[name + ".extra"] = expected[name]
        try:
            load_checked(path, expected, stored_tensors(path), torch.device("cpu"), torch.float32)
        except ValueError as error:
            assert name + ".extra: missing" in str(error)
        else:
            raise AssertionError("a load expecting a tensor the checkpoint lacks succeeded from the cache")
