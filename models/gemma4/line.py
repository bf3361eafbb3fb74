"""Loading a Gemma 4 checkpoint into a served model: config, checked weights, two KV groups, scheduler.

The sliding group releases pages as a request's frontier moves past them; the global group keeps
every page. Each group gets its own page count from start-up (engine/paged_startup.py): the sliding
group what `max_num_seqs` requests can hold inside their windows, the global group the rest.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.kv import KVGroupSpec
from engine.paged_startup import start_paged_model
from engine.scheduler import BatchScheduler
from kernels.gemm.dispatch import policy_linear
from kernels.norm_dispatch import policy_norms
from models.checkpoint import load_checked, stored_tensors
from models.context_limit import resolve_max_model_len
from models.device_choice import pick_attention, pick_device, pick_dtype
from models.gemma4.config import SLIDING, Gemma4Config, parse_gemma4_config
from models.gemma4.model import GROUP_KINDS, Gemma4Model
from models.gemma4.weights import expected_tensors, skipped_tensor, text_prefix
from models.hf_tokenizer import HFTokenizer
from models.registry import LoadedModel, ModelOptions

log = logging.getLogger("infer.gemma4")


def load_weights(
    path: Path, config: Gemma4Config, device: torch.device, dtype: torch.dtype, quiet: bool = False
) -> tuple[dict[str, torch.Tensor], str]:
    """The text tower's tensors (checked all at once) and the name prefix they carry."""
    stored = stored_tensors(path)
    prefix = text_prefix(stored)
    expected = expected_tensors(config, prefix)
    weights = load_checked(path, expected, stored, device, dtype, ignore=skipped_tensor, quiet=quiet)
    skipped = sum(1 for name in stored if name not in expected)
    resident = sum(t.numel() * t.element_size() for t in weights.values())
    log.info(
        "%s: %d text-tower tensors resident (%.1f MiB, %s on %s), %d other tensors skipped",
        path.name,
        len(weights),
        resident / 2**20,
        dtype,
        device,
        skipped,
    )
    return weights, prefix


def load_gemma4(spec: str, options: ModelOptions) -> LoadedModel:
    path = Path(spec)
    config = parse_gemma4_config(path)
    device = pick_device(options)
    dtype = pick_dtype(options, device)
    tokenizer = HFTokenizer(path)
    engine = options.engine
    max_model_len = resolve_max_model_len(
        engine.max_model_len,
        config.max_position_embeddings,
        "max_position_embeddings (text config)",
        engine.allow_long_max_model_len,
    )
    weights, prefix = load_weights(path, config, device, dtype)
    model = Gemma4Model(
        config,
        weights,
        prefix,
        device,
        max_model_len,
        linear=policy_linear(engine.numeric_policy),
        norms=policy_norms(engine.numeric_policy),
    )
    del weights
    max_pages_per_seq = -(-max_model_len // model.page_size)
    attention = pick_attention(options, device, dtype, max_pages_per_seq)
    runner, report = start_paged_model(model, attention, engine, max_model_len)
    # report.kv_pages follows model.attention_specs, which follows GROUP_KINDS.
    groups = [
        KVGroupSpec(
            kind,
            pages,
            model.page_size,
            sliding_window=config.sliding_window if kind == SLIDING else None,
        )
        for kind, pages in zip(GROUP_KINDS, report.kv_pages, strict=True)
    ]
    scheduler = BatchScheduler(
        runner,
        engine,
        groups,
        config.eos_token_ids,
        max_model_len,
        model_id=f"gemma4:{path.resolve()}",
        vocab_size=config.vocab_size,
    )
    return LoadedModel(name=path.name, scheduler=scheduler, tokenizer=tokenizer, max_model_len=max_model_len)
