"""The sharding arithmetic (engine.parallel.sharding) over every preset `infer synth` knows, each
config parsed by its own line, at 1, 2, 4 and 8 ranks: what splits, what is replicated (Gemma 4's
global layers: 1 KV head on the 12B, 4 on the 31B; Gemma 3's single KV head), and what is refused,
by field and value."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.parallel.sharding import DimSplit, GroupedHeads, HeadSplit, ShardError, ShardPlan, Span
from models.gemma3.config import parse_gemma3_config
from models.gemma3.sharding import shard_plan as gemma3_plan
from models.gemma4.config import parse_gemma4_config
from models.gemma4.sharding import shard_plan as gemma4_plan
from models.qwen3.config import parse_qwen3_config
from models.qwen3.sharding import shard_plan as qwen3_plan
from models.qwen35.config import parse_qwen35_config
from models.qwen35.sharding import shard_plan as qwen35_plan
from models.synth.families import FAMILIES

RANKS = (1, 2, 4, 8)

# Per family: its line's parser and plan.
LINES: dict[str, tuple[Callable[[Path], Any], Callable[[Any, int], ShardPlan]]] = {
    "qwen3": (parse_qwen3_config, qwen3_plan),
    "gemma3": (parse_gemma3_config, gemma3_plan),
    "gemma4": (parse_gemma4_config, gemma4_plan),
    "qwen35": (parse_qwen35_config, qwen35_plan),
}

PRESETS = [(family, preset) for family in sorted(FAMILIES) for preset in FAMILIES[family].presets]


def parsed(tmp_path: Path, family_name: str, preset_name: str) -> Any:
    family = FAMILIES[family_name]
    preset = family.preset(preset_name)
    body = {
        **preset.fields,
        "model_type": family.model_type,
        family.dtype_key: preset.default_dtype,
        "eos_token_id": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(body))
    return LINES[family_name][0](tmp_path)


# (family, preset, ranks) -> the field the plan refuses: every other pair splits.
REFUSED = {
    ("gemma3", "270m", 8): ("num_attention_heads", 4),
    ("gemma3", "1b", 8): ("num_attention_heads", 4),
    ("gemma3", "tiny", 8): ("num_attention_heads", 4),
    ("gemma4", "tiny", 8): ("num_attention_heads", 4),
    ("qwen3", "tiny", 8): ("num_attention_heads", 4),
    ("qwen35", "tiny", 8): ("num_attention_heads", 4),
}


def test_the_refusal_table_names_only_presets_that_exist() -> None:
    assert {(f, p) for f, p, _ in REFUSED} <= set(PRESETS)


@pytest.mark.parametrize(("family", "preset"), PRESETS, ids=[f"{f}-{p}" for f, p in PRESETS])
def test_every_preset_splits_consistently_or_is_refused_by_field(
    tmp_path: Path, family: str, preset: str
) -> None:
    config = parsed(tmp_path, family, preset)
    for ranks in RANKS:
        refused = REFUSED.get((family, preset, ranks))
        if refused is not None:
            with pytest.raises(ShardError) as caught:
                LINES[family][1](config, ranks)
            assert (caught.value.field, caught.value.value) == refused
            assert refused[0] in str(caught.value) and str(refused[1]) in str(caught.value)
            continue
        plan = LINES[family][1](config, ranks)
        assert plan.ranks == ranks and len(plan.layers) == config.num_layers
        assert_covers(plan.vocab, config.vocab_size)
        for layer in plan.layers:
            assert_covers(layer.mlp, config.intermediate_size)
            mixer = layer.attention or layer.gdn
            assert mixer is not None and (layer.attention is None) != (layer.gdn is None)
            assert_grouped(mixer)


def assert_covers(split: DimSplit, total: int) -> None:
    spans = [split.span(r) for r in range(split.ranks)]
    assert split.total == total
    assert [i for s in spans for i in range(s.start, s.stop)] == list(range(total))


def assert_grouped(grouped: GroupedHeads) -> None:
    """Every rank's heads read only shared heads that rank holds; heads are cut exactly once and
    each shared head is held by `replicas` ranks."""
    heads, shared = grouped.heads, grouped.shared
    held: dict[int, int] = {}
    for rank in range(heads.ranks):
        own, local = heads.span(rank), shared.span(rank)
        assert own.size == heads.total // heads.ranks
        for head in range(own.start, own.stop):
            assert local.start <= grouped.shared_of(head) < local.stop
        for s in range(local.start, local.stop):
            held[s] = held.get(s, 0) + 1
            assert rank in shared.ranks_of(s)
    assert held == {s: shared.replicas for s in range(shared.total)}
    assert sorted(
        i for r in range(heads.ranks) for i in range(heads.span(r).start, heads.span(r).stop)
    ) == list(range(heads.total))


def test_gemma4_global_layers_replicate_their_few_kv_heads(tmp_path: Path) -> None:
    g12 = gemma4_plan(parsed(tmp_path, "gemma4", "12b"), 2)
    globals_12 = [layer.index for layer in g12.layers if layer.kind == "full_attention"]
    assert g12.replicated_kv_layers() == tuple(globals_12) == tuple(range(5, 48, 6))
    kv = g12.layers[5].attention
    assert kv is not None
    # The 12B's one global KV head lives on both ranks; the sliding layers' 8 split 4 + 4.
    assert (kv.shared.total, kv.shared.replicas) == (1, 2)
    assert kv.shared.span(0) == kv.shared.span(1) == Span(0, 1)
    sliding = g12.layers[0].attention
    assert sliding is not None and not sliding.shared.replicated and sliding.shared.per_rank == 4

    g31 = parsed(tmp_path, "gemma4", "31b")
    # The 31B's 4 global KV heads split at 2 and 4 ranks and replicate (twice each) at 8.
    assert gemma4_plan(g31, 4).replicated_kv_layers() == ()
    at8 = gemma4_plan(g31, 8)
    assert at8.replicated_kv_layers() == tuple(range(5, 60, 6))
    full = at8.layers[5].attention
    assert full is not None and full.shared.replicas == 2
    assert [full.shared.span(r).start for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert full.heads.per_rank == 4


def test_qwen35_gdn_splits_by_value_head(tmp_path: Path) -> None:
    plan = qwen35_plan(parsed(tmp_path, "qwen35", "9b"), 4)
    gdn = plan.layers[0].gdn
    assert gdn is not None and plan.layers[3].attention is not None
    assert (gdn.heads.field, gdn.heads.per_rank, gdn.shared.field, gdn.shared.per_rank) == (
        "linear_num_value_heads",
        8,
        "linear_num_key_heads",
        4,
    )
    assert plan.replicated_kv_layers() == ()
    assert qwen35_plan(parsed(tmp_path, "qwen35", "9b"), 8).replicated_kv_layers() == tuple(range(3, 32, 4))


def test_tiny_qwen3_replicates_its_two_kv_heads_at_four_ranks(tmp_path: Path) -> None:
    plan = qwen3_plan(parsed(tmp_path, "qwen3", "tiny"), 4)
    attention = plan.layers[0].attention
    assert attention is not None
    assert [attention.shared.span(r).start for r in range(4)] == [0, 0, 1, 1]
    assert plan.vocab.per_rank == 256 and plan.layers[0].mlp.per_rank == 48


@pytest.mark.parametrize(
    ("split", "field", "value"),
    [
        (lambda: HeadSplit.of("num_attention_heads", 6, 4, replicable=False), "num_attention_heads", 6),
        (lambda: HeadSplit.of("num_key_value_heads", 3, 4, replicable=True), "num_key_value_heads", 3),
        (lambda: HeadSplit.of("num_key_value_heads", 6, 4, replicable=True), "num_key_value_heads", 6),
        (lambda: DimSplit.of("intermediate_size", 100, 8), "intermediate_size", 100),
        (
            lambda: GroupedHeads.of("num_attention_heads", 8, "num_key_value_heads", 3, 2),
            "num_key_value_heads",
            3,
        ),
    ],
)
def test_splits_that_do_not_divide_are_refused_by_field(
    split: Callable[[], object], field: str, value: int
) -> None:
    with pytest.raises(ShardError) as caught:
        split()
    assert (caught.value.field, caught.value.value) == (field, value)
