"""`load_checked` with a rank's slices: a `TensorSlice` reads one range of one dimension, a
`JoinedSlices` several ranges of one dimension joined in order (Qwen3.5's q | k | v sections); both
are checked against the expected shape before anything is read, and a cached slice is keyed by
the part it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from models.checkpoint import (
    JoinedSlices,
    TensorPart,
    TensorSlice,
    TensorSpec,
    WeightCache,
    load_checked,
    reusing_weights,
    stored_tensors,
)

FUSED = torch.arange(10 * 3 * 2, dtype=torch.float32).reshape(10, 3, 2)
EXPECTED = {"fused": TensorSpec((10, 3, 2)), "norm": TensorSpec((2,))}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_file({"fused": FUSED, "norm": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _load(checkpoint: Path, slices: dict[str, TensorPart]) -> dict[str, torch.Tensor]:
    return load_checked(
        checkpoint,
        EXPECTED,
        stored_tensors(checkpoint),
        torch.device("cpu"),
        torch.float32,
        slices=slices,
    )


def test_joined_slices_read_their_ranges_in_order(checkpoint: Path) -> None:
    joined = JoinedSlices((TensorSlice(0, 6, 8), TensorSlice(0, 1, 2), TensorSlice(0, 9, 10)))
    loaded = _load(checkpoint, {"fused": joined})
    assert torch.equal(loaded["fused"], FUSED[[6, 7, 1, 9]])
    assert torch.equal(loaded["norm"], torch.ones(2))
    inner = _load(checkpoint, {"fused": JoinedSlices((TensorSlice(1, 2, 3), TensorSlice(1, 0, 1)))})
    assert torch.equal(inner["fused"], FUSED[:, [2, 0]])


def test_a_range_outside_the_shape_is_refused_by_tensor_name(checkpoint: Path) -> None:
    joined = JoinedSlices((TensorSlice(0, 0, 2), TensorSlice(0, 8, 11)))
    with pytest.raises(ValueError, match=r"fused: slice TensorSlice\(dim=0, start=8, stop=11\) outside"):
        _load(checkpoint, {"fused": joined})


def test_joined_slices_take_one_dimension() -> None:
    with pytest.raises(ValueError, match="single dimension"):
        JoinedSlices((TensorSlice(0, 0, 1), TensorSlice(1, 0, 1)))
    with pytest.raises(ValueError, match="single dimension"):
        JoinedSlices(())


def test_cached_parts_are_keyed_by_the_part(checkpoint: Path) -> None:
    first = JoinedSlices((TensorSlice(0, 0, 2), TensorSlice(0, 4, 6)))
    second = JoinedSlices((TensorSlice(0, 0, 2), TensorSlice(0, 6, 8)))
    cache = WeightCache()
    with reusing_weights(cache):
        a = _load(checkpoint, {"fused": first})
        b = _load(checkpoint, {"fused": second})
        again = _load(checkpoint, {"fused": first})
    assert torch.equal(a["fused"], FUSED[[0, 1, 4, 5]])
    assert torch.equal(b["fused"], FUSED[[0, 1, 6, 7]])
    assert again["fused"] is a["fused"]
