"""The ledger is the lifecycle's guard: every illegal transition raises, aborted requests go quiet."""

from __future__ import annotations

import pytest

from engine.contract import (
    Failed,
    Finished,
    FinishReason,
    Rejected,
    RejectReason,
    Request,
    RequestUpdate,
    TokenLogprob,
)
from engine.ledger import LifecycleError, RequestLedger


def _opened(*ids: str) -> RequestLedger:
    ledger = RequestLedger()
    for rid in ids:
        ledger.open(Request(rid, (1, 2, 3)))
    return ledger


def test_admit_twice_raises() -> None:
    ledger = _opened("a")
    ledger.admit("a")
    with pytest.raises(LifecycleError) as info:
        ledger.admit("a")
    assert info.value.request_id == "a" and info.value.transition == "admit"


@pytest.mark.parametrize(
    "transition",
    [
        lambda ledger: ledger.commit("a", (5,)),
        lambda ledger: ledger.finish("a", FinishReason.STOP),
        lambda ledger: ledger.record_cached("a", 16),
    ],
    ids=["tokens", "finish", "cached_tokens"],
)
def test_facts_before_admission_raise(transition) -> None:
    ledger = _opened("a")
    with pytest.raises(LifecycleError):
        transition(ledger)


def test_reject_after_admission_raises() -> None:
    ledger = _opened("a")
    ledger.admit("a")
    with pytest.raises(LifecycleError):
        ledger.reject("a", RejectReason.KV_BUDGET, "too big")


@pytest.mark.parametrize("terminal", ["finish", "reject", "fail"])
@pytest.mark.parametrize("after", ["admit", "commit", "finish", "reject", "fail", "record_cached"])
def test_anything_after_a_terminal_raises(terminal: str, after: str) -> None:
    ledger = _opened("a")
    if terminal == "finish":
        ledger.admit("a")
        ledger.finish("a", FinishReason.LENGTH)
    elif terminal == "reject":
        ledger.reject("a", RejectReason.CONTEXT_LENGTH, "long")
    else:
        ledger.fail("a", "boom")
    calls = {
        "admit": lambda: ledger.admit("a"),
        "commit": lambda: ledger.commit("a", (1,)),
        "finish": lambda: ledger.finish("a", FinishReason.STOP),
        "reject": lambda: ledger.reject("a", RejectReason.KV_BUDGET, "x"),
        "fail": lambda: ledger.fail("a", "again"),
        "record_cached": lambda: ledger.record_cached("a", 0),
    }
    with pytest.raises(LifecycleError):
        calls[after]()


def test_open_twice_raises_while_open_and_after_retiring() -> None:
    ledger = _opened("a")
    with pytest.raises(LifecycleError):
        ledger.open(Request("a", (9,)))
    ledger.admit("a")
    ledger.finish("a", FinishReason.STOP)
    with pytest.raises(LifecycleError):
        ledger.open(Request("a", (9,)))


def test_unknown_request_raises() -> None:
    with pytest.raises(LifecycleError):
        RequestLedger().admit("ghost")


def test_aborted_requests_late_updates_are_dropped() -> None:
    ledger = _opened("a", "b")
    ledger.admit("a")
    ledger.admit("b")
    ledger.commit("a", (7,))
    assert ledger.abort("a") is True
    # Late facts for the aborted request are swallowed, not raised and not emitted.
    ledger.commit("a", (8,))
    ledger.record_cached("a", 16)
    ledger.finish("a", FinishReason.STOP)
    ledger.fail("a", "late")
    ledger.commit("b", (9,))
    updates = ledger.drain().updates
    assert [u.request_id for u in updates] == ["b"]
    assert ledger.abort("a") is False
    assert not ledger.is_open("a")


def test_one_update_per_request_per_drain_with_tallied_terminal() -> None:
    ledger = _opened("a")
    ledger.admit("a", scheduled_time=5.0)
    ledger.record_cached("a", 16)
    lp = TokenLogprob(4, -0.5)
    ledger.commit("a", (4,), [lp])
    ledger.commit("a", (6,), [TokenLogprob(6, -0.25)])
    ledger.finish("a", FinishReason.LENGTH)
    (update,) = ledger.drain().updates
    assert update.admission is not None and update.admission.prompt_tokens == 3
    assert update.admission.scheduled_time == 5.0
    assert update.new_token_ids == (4, 6)
    assert update.logprobs is not None and update.logprobs[0] == lp
    assert update.cached_tokens == 16
    assert update.terminal == Finished(FinishReason.LENGTH, prompt_tokens=3, completion_tokens=2)
    assert not ledger.drain()


def test_reject_and_fail_terminals_are_emitted_once() -> None:
    ledger = _opened("r", "f")
    ledger.reject("r", RejectReason.CONTEXT_LENGTH, "too long")
    ledger.fail("f", "broken")
    terminals = {u.request_id: u.terminal for u in ledger.drain().updates}
    assert terminals == {"r": Rejected(RejectReason.CONTEXT_LENGTH, "too long"), "f": Failed("broken")}
    assert len(ledger) == 0


def test_updates_come_in_first_fact_order_and_a_drained_update_never_changes() -> None:
    ledger = _opened("a", "b", "c")
    for rid in ("a", "b", "c"):
        ledger.admit(rid, scheduled_time=1.0)
    ledger.drain()
    lp = TokenLogprob(2, -1.0)
    ledger.commit("b", (1,))
    ledger.commit("a", (2,), [lp])
    ledger.finish("b", FinishReason.STOP)
    ledger.record_cached("c", 16)
    first = ledger.drain().updates
    assert first == (
        RequestUpdate("b", new_token_ids=(1,), terminal=Finished(FinishReason.STOP, 3, 1)),
        RequestUpdate("a", new_token_ids=(2,), logprobs=(lp,)),
        RequestUpdate("c", cached_tokens=16),
    )
    # The next step's facts start new updates: what was handed out stays as it was.
    ledger.commit("a", (3,))
    ledger.commit("a", (4,), [TokenLogprob(4, -2.0)])
    (second,) = ledger.drain().updates
    assert first[1] == RequestUpdate("a", new_token_ids=(2,), logprobs=(lp,))
    # Log-probs cover the tokens committed with them (the first commit of this step had none).
    assert second == RequestUpdate("a", new_token_ids=(3, 4), logprobs=(TokenLogprob(4, -2.0),))
