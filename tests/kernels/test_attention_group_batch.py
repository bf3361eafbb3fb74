"""GroupBatch refuses a step its backends cannot run, naming the sequence and what is wrong."""

from __future__ import annotations

import pytest

from kernels.attention.base import GroupBatch
from kernels.kv_layout import PAGE_SIZE


def test_a_valid_batch_is_kept_as_given() -> None:
    # Row 1 fills its two pages exactly; row 2 is a prefill chunk inside one page.
    batch = GroupBatch((1, 1, 5), (17, 32, 9), ((5, 9), (1, 2), (7,)), PAGE_SIZE)
    assert batch.num_tokens == 7 and batch.page_tables == ((5, 9), (1, 2), (7,))


@pytest.mark.parametrize(
    ("q_lens", "kv_lens", "tables", "message"),
    [
        ((1, 1), (17,), ((5, 9), (1,)), "GroupBatch: 2 q_lens, 1 kv_lens, 2 tables"),
        ((1,), (1,), ((1,), (2,)), "GroupBatch: 1 q_lens, 1 kv_lens, 2 tables"),
        ((1, 0), (17, 3), ((5, 9), (1,)), "GroupBatch: sequence 1 has q_len 0 and kv_len 3"),
        ((1, 4), (17, 3), ((5, 9), (1,)), "GroupBatch: sequence 1 has q_len 4 and kv_len 3"),
        ((1, 1), (17, 3), ((5,), (1,)), "GroupBatch: sequence 0 needs 17 slots but its table has 1 pages"),
        ((1, 1), (16, 33), ((5,), (1, 2)), "GroupBatch: sequence 1 needs 33 slots but its table has 2 pages"),
        # Two bad rows: the first is named, whatever is wrong with the later one.
        (
            (1, 0, 1),
            (40, 3, 3),
            ((5,), (1,), ()),
            "GroupBatch: sequence 0 needs 40 slots but its table has 1 pages",
        ),
    ],
)
def test_a_bad_batch_is_refused_naming_its_first_bad_sequence(
    q_lens: tuple[int, ...], kv_lens: tuple[int, ...], tables: tuple[tuple[int, ...], ...], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        GroupBatch(q_lens, kv_lens, tables, PAGE_SIZE)
    assert str(info.value) == message
