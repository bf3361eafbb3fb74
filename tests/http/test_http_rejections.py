"""The engine's `Rejected` terminals, as HTTP errors."""

from __future__ import annotations

import pytest

from engine.contract import Rejected, RejectReason
from infer_cli.http.generation import rejection_error


@pytest.mark.parametrize(
    ("reason", "code", "param"),
    [
        (RejectReason.CONTEXT_LENGTH, "context_length_exceeded", "messages"),
        (RejectReason.KV_BUDGET, "kv_cache_capacity_exceeded", None),
        (RejectReason.INVALID_INPUT, "invalid_value", None),
    ],
)
def test_every_rejection_is_a_400_that_keeps_the_engine_message(
    reason: RejectReason, code: str, param: str | None
) -> None:
    error = rejection_error(Rejected(reason, "the scheduler's own words"), prompt_param="messages")
    assert error.status == 400
    assert error.code == code
    assert error.param == param
    assert "the scheduler's own words" in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
