"""Qwen3.5 under tensor parallelism on CPU over gloo (docs/tensor-parallel.md), on the tiny synthetic
checkpoint: its full-attention layers have 4 query heads over 2 KV heads (split 2 + 2 at TP = 2,
each KV head replicated on two ranks at TP = 4), its Gated DeltaNet layers 4 value heads over 2 key
heads (two value heads and their key head per rank at TP = 2; one value head per rank at TP = 4,
each key head replicated on two ranks). 3 and 8 ranks do not split its 4 query heads and are
refused. Against one rank: teacher-forced log-probs within a bound measured in the same run,
identical greedy streams (with `--decode-fusion` too, at TP = 2), prefill in several chunks (the state carried across chunk boundaries on
every rank), aborts that give back pages and state slots, prefix-cache hits that restore every
rank's state snapshot, an untied LM head, and the whole checkpoint still checked by a sharded load."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_tensor_parallel import ENGINE, PROMPTS, greedy, load, scheduler_of, streams, tp_runner

from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.parallel.sharding import ShardError
from models.registry import LoadedModel, ModelOptions, load_model

TOKENS = [(7 * i + 3) % 1000 + 1 for i in range(60)]
PAGES = [1, 2, 3, 4]
# TP = N against TP = 1 may differ by at most this multiple of TP = 1's own fp32 error (max |Δ
# log-prob| against transformers in float64 over the same 60-token prompt, measured here: 7.1e-7).
# The row-parallel sums of O, out_proj and down meet in another order; measured 9.5e-7 (1.35×) at
# TP = 2 and 4.
BOUND_FACTOR = 4.0


@pytest.fixture(scope="module")
def tiny(tiny_qwen35: Path) -> Path:
    return tiny_qwen35


@pytest.fixture(scope="module")
def engines(tiny: Path) -> Iterator[dict[int, LoadedModel]]:
    loaded = {ranks: load(tiny, ranks) for ranks in (1, 2, 4)}
    yield loaded
    for ranks in (2, 4):
        tp_runner(loaded[ranks]).close()


def score(model: LoadedModel, tokens: list[int], pages: list[int]) -> torch.Tensor:
    runner = scheduler_of(model).runner
    assert hasattr(runner, "score")
    logprobs: torch.Tensor = runner.score(tokens, pages).log_softmax(-1)
    return logprobs


@pytest.fixture(scope="module")
def fp32_error(tiny: Path, engines: dict[int, LoadedModel]) -> float:
    """TP = 1's max |Δ log-prob| against transformers run in float64 on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float64).eval()
    with torch.inference_mode():
        exact = hf(torch.tensor([TOKENS])).logits[0].log_softmax(-1)
    error = (score(engines[1], TOKENS, PAGES).double() - exact).abs().max().item()
    print(f"qwen35 tp=1 fp32 against fp64: max |Δ log-prob| {error:.3g}")
    assert 0.0 < error < 1e-5, error
    return error


@pytest.mark.parametrize("ranks", [2, 4])
def test_teacher_forced_logprobs_match_one_rank(
    engines: dict[int, LoadedModel], fp32_error: float, ranks: int
) -> None:
    reference = score(engines[1], TOKENS, PAGES)
    sharded = score(engines[ranks], TOKENS, PAGES)
    assert sharded.shape == reference.shape == (60, 1024)
    delta = (sharded - reference).abs().max().item()
    print(f"qwen35 tp={ranks}: max |Δ log-prob| {delta:.3g} ({delta / fp32_error:.2f}× the fp32 error)")
    assert delta <= BOUND_FACTOR * fp32_error, (delta, fp32_error)
    assert sharded.argmax(-1).tolist() == reference.argmax(-1).tolist()


def logprobs_of(
    model: LoadedModel, requests: list[Request]
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    scheduler = scheduler_of(model)
    tokens, logprobs = streams(scheduler, requests)
    load_after = scheduler.load()
    assert load_after.kv_pages_used == 0 and load_after.state_slots_used == 0
    return tokens, logprobs


def assert_logprobs_close(
    got: dict[str, list[float]], expected: dict[str, list[float]], bound: float
) -> None:
    assert got.keys() == expected.keys()
    for request_id, values in got.items():
        delta = max(abs(a - b) for a, b in zip(values, expected[request_id], strict=True))
        assert delta <= bound, (request_id, delta)


@pytest.mark.parametrize("ranks", [2, 4])
def test_greedy_streams_match_one_rank(
    engines: dict[int, LoadedModel], fp32_error: float, ranks: int
) -> None:
    # A 48-token step budget cuts the 40-token prompt beside the others: mixed prefill and decode.
    expected, expected_logprobs = logprobs_of(engines[1], greedy(f"a{ranks}-"))
    got, got_logprobs = logprobs_of(engines[ranks], greedy(f"a{ranks}-"))
    assert got == expected
    assert all(len(t) == 12 for t in got.values()) and len(got) == len(PROMPTS)
    assert_logprobs_close(got_logprobs, expected_logprobs, BOUND_FACTOR * fp32_error)


def test_decode_fusion_at_two_ranks_gives_one_ranks_tokens(
    tiny: Path, engines: dict[int, LoadedModel], fp32_error: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--decode-fusion`` at TP = 2, every rank's decode steps through the fused GEMV (under the
    interpreter): the input norms fuse into in_proj and QKV and the post-attention norm into gate/up
    (SiLU·mul); out_proj, O and down compose around the all-reduce. One rank's greedy tokens and
    log-probs within the bound, and rank 0 launched the kernel (only rank 0 is in this process)."""
    import kernels.triton.fused_gemv as fused_module

    expected, expected_logprobs = logprobs_of(engines[1], greedy("f-"))
    launched: list[str] = []
    real = fused_module.fused_gemv

    def spied(x: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        fusion = args[0] if args else kwargs.get("fusion")
        launched.append(getattr(fusion, "name", "gemv"))
        return real(x, weight, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_module, "fused_gemv", spied)
    config = EngineConfig(**{**ENGINE, "tensor_parallel_size": 2, "collective_timeout_s": 30.0})  # type: ignore[arg-type]
    model = load_model(str(tiny), ModelOptions(engine=config, device="cpu", decode_fusion=True))
    try:
        got, got_logprobs = logprobs_of(model, greedy("f-"))
    finally:
        tp_runner(model).close()
    assert got == expected
    assert_logprobs_close(got_logprobs, expected_logprobs, BOUND_FACTOR * fp32_error)
    assert {"norm+gemv", "norm+gemv+silu"} <= set(launched), sorted(set(launched))
    assert "gemv+residual" not in launched


@pytest.mark.parametrize("ranks", [2, 4])
def test_prefill_in_several_chunks_carries_the_state_on_every_rank(
    engines: dict[int, LoadedModel], fp32_error: float, ranks: int
) -> None:
    """A 133-token prompt under a 48-token step budget prefills in chunks of 48, 48 and 37: each
    rank's GDN layers continue their own heads' conv and recurrent state across both boundaries
    (mid-way through the torch backend's 64-token chunks). Its first token's log-prob matches the
    one-forward prefill of the whole prompt on one rank, and its stream matches one rank's."""
    prompt = [(11 * i + 5) % 1000 + 1 for i in range(133)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    expected, _ = logprobs_of(engines[1], [Request(f"long{ranks}", tuple(prompt), params)])
    got, got_logprobs = logprobs_of(engines[ranks], [Request(f"long{ranks}", tuple(prompt), params)])
    assert got == expected
    whole = score(engines[1], prompt, list(range(1, 10)))[-1]
    first = got[f"long{ranks}"][0]
    assert first == int(whole.argmax())
    delta = abs(got_logprobs[f"long{ranks}"][0] - whole[first].item())
    assert delta <= BOUND_FACTOR * fp32_error, delta


@pytest.mark.parametrize("ranks", [2, 4])
def test_abort_gives_pages_and_state_slots_back_on_every_rank(
    engines: dict[int, LoadedModel], fp32_error: float, ranks: int
) -> None:
    """Pages and state slots are rank 0's bookkeeping: a slot id names the same slot in every rank's
    state pool. Aborts mid-decode free both; the next requests take the same slots (lowest free
    first) over the state the aborted ones left on every rank, start from zero state there, and
    still give one rank's tokens and log-probs (the tiny model's greedy streams repeat a token, so
    the log-probs carry the comparison)."""
    scheduler = scheduler_of(engines[ranks])
    for request in greedy(f"b{ranks}-", max_tokens=40):
        scheduler.submit(request)
    for _ in range(4):
        scheduler.step()
    before = scheduler.load()
    assert before.kv_pages_used > 0 and before.state_slots_used == len(PROMPTS)
    scheduler.abort(f"b{ranks}-2")
    after_one = scheduler.load()
    assert after_one.kv_pages_used < before.kv_pages_used
    assert after_one.state_slots_used == len(PROMPTS) - 1
    for index in (0, 1, 3):
        scheduler.abort(f"b{ranks}-{index}")
    while scheduler.has_work():
        scheduler.step()
    assert scheduler.load().kv_pages_used == 0 and scheduler.load().state_slots_used == 0
    expected, expected_logprobs = logprobs_of(engines[1], greedy(f"c{ranks}-"))
    got, got_logprobs = logprobs_of(engines[ranks], greedy(f"c{ranks}-"))
    assert got == expected
    assert_logprobs_close(got_logprobs, expected_logprobs, BOUND_FACTOR * fp32_error)


def test_prefix_cache_hits_restore_every_ranks_state_snapshot(
    tiny: Path, engines: dict[int, LoadedModel], fp32_error: float
) -> None:
    """With prefix caching, the snapshot of a state slot at a page boundary is a copy on every rank
    (each of its own heads). A resent 70-token prompt hits 64 tokens (the snapshot below its last
    token) and gives the tokens and log-probs of one rank without a cache."""
    prompt = tuple((13 * i + 7) % 1000 + 1 for i in range(70))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    expected, expected_logprobs = logprobs_of(engines[1], [Request("cold", prompt, params)])
    model = load(tiny, 2, enable_prefix_caching=True)
    try:
        scheduler = scheduler_of(model)
        logprobs_of(model, [Request("first", prompt, params)])
        scheduler.submit(Request("again", prompt, params))
        cached, tokens, logprobs = None, [], []
        while scheduler.has_work():
            for update in scheduler.step().updates:
                cached = update.cached_tokens if update.cached_tokens is not None else cached
                tokens.extend(update.new_token_ids)
                logprobs.extend(lp.logprob for lp in update.logprobs or ())
    finally:
        tp_runner(model).close()
    assert cached == 64
    assert tokens == expected["cold"]
    assert_logprobs_close({"cold": logprobs}, expected_logprobs, BOUND_FACTOR * fp32_error)


def test_an_untied_lm_head_is_split_by_vocabulary(
    tiny: Path, tmp_path: Path, engines: dict[int, LoadedModel], fp32_error: float
) -> None:
    """The tiny checkpoint ties its head; a copy that also stores `lm_head.weight` (so the line
    unties it) scores the same at TP = 2 as at TP = 1, and differently from the tied head."""
    untied = tmp_path / "untied"
    untied.mkdir()
    for item in tiny.iterdir():
        (untied / item.name).symlink_to(item)
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(1024, 64, generator=generator) * 0.05
    save_file({"lm_head.weight": head}, str(untied / "lm_head.safetensors"))
    one, two = load(untied, 1), load(untied, 2)
    try:
        reference = score(one, TOKENS, PAGES)
        sharded = score(two, TOKENS, PAGES)
    finally:
        tp_runner(two).close()
    tied = score(engines[1], TOKENS, PAGES)
    assert (reference - tied).abs().max().item() > 0.1
    # The tied head's measured fp32 error stands for this one's (the same layers below the head).
    assert (sharded - reference).abs().max().item() <= BOUND_FACTOR * fp32_error


def test_a_sharded_load_still_checks_the_whole_checkpoint(tiny: Path, tmp_path: Path) -> None:
    """Each rank reads only its slices, yet every tensor is checked whole first, and every faulty
    one is named at once: the error comes from rank 0 and no worker is left behind."""
    from models.checkpoint import WeightsError

    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).symlink_to(item)
    tensors = load_file(str(tiny / "model.safetensors"))
    conv = "model.layers.0.linear_attn.conv1d.weight"
    tensors[conv] = tensors[conv][:, :, :3].contiguous()
    del tensors["model.layers.1.linear_attn.A_log"]
    tensors["model.layers.2.linear_attn.extra"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    children = set(multiprocessing.active_children())
    with pytest.raises(WeightsError) as caught:
        load(broken, 2)
    assert set(multiprocessing.active_children()) == children
    problems = "\n".join(caught.value.problems)
    assert len(caught.value.problems) == 3, problems
    assert f"{conv}: shape [128, 1, 3], expected [128, 1, 4]" in problems
    assert "model.layers.1.linear_attn.A_log: missing" in problems
    assert "model.layers.2.linear_attn.extra: unexpected tensor" in problems


def _config_only(tmp_path: Path, **fields: object) -> Path:
    from models.synth.families import FAMILIES

    family = FAMILIES["qwen35"]
    preset = family.preset("tiny")
    body = {
        **preset.fields,
        "model_type": family.model_type,
        family.dtype_key: "float32",
        "eos_token_id": 1,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(body))
    return tmp_path


@pytest.mark.parametrize(
    ("ranks", "fields", "field", "value"),
    [
        (3, {}, "num_attention_heads", 4),
        (8, {}, "num_attention_heads", 4),
        # The attention splits at 4; 6 value heads do not.
        (4, {"linear_num_value_heads": 6}, "linear_num_value_heads", 6),
        # 6 value heads split 3 + 3 at 2; their 3 key heads neither split over 2 ranks nor replicate.
        (2, {"linear_num_value_heads": 6, "linear_num_key_heads": 3}, "linear_num_key_heads", 3),
    ],
)
def test_splits_that_do_not_divide_are_refused_by_field_before_any_weight_is_read(
    tmp_path: Path, ranks: int, fields: dict[str, object], field: str, value: int
) -> None:
    checkpoint = _config_only(tmp_path, **fields)
    options = ModelOptions(engine=EngineConfig(tensor_parallel_size=ranks), device="cpu")
    with pytest.raises(ShardError) as caught:
        load_model(str(checkpoint), options)
    assert (caught.value.field, caught.value.value) == (field, value)
