"""Loading a Qwen3 checkpoint into a served model: config, checked weights, KV pool, scheduler."""

from __future__ import annotations

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
from models.hf_tokenizer import HFTokenizer
from models.qwen3.config import Qwen3Config, parse_qwen3_config
from models.qwen3.model import Qwen3Model
from models.qwen3.weights import expected_tensors, ignored_tensor
from models.registry import LoadedModel, ModelOptions


def load_weights(
    path: Path, config: Qwen3Config, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    return load_checked(
        path, expected_tensors(config), stored_tensors(path), device, dtype, ignore=ignored_tensor
    )


def load_qwen3(spec: str, options: ModelOptions) -> LoadedModel:
    path = Path(spec)
    config = parse_qwen3_config(path)
    device = pick_device(options)
    dtype = pick_dtype(options, device)
    tokenizer = HFTokenizer(path)
    engine = options.engine
    max_model_len = resolve_max_model_len(
        engine.max_model_len,
        config.max_position_embeddings,
        "max_position_embeddings",
        engine.allow_long_max_model_len,
    )
    # No reference to the loaded dict outlives the model: the unfused projections it held are freed
    # before the memory budget measures the weights.
    model = Qwen3Model(
        config,
        load_weights(path, config, device, dtype),
        device,
        max_model_len,
        linear=policy_linear(engine.numeric_policy),
        norms=policy_norms(engine.numeric_policy),
    )
    max_pages_per_seq = -(-max_model_len // model.page_size)
    attention = pick_attention(options, device, dtype, max_pages_per_seq)
    runner, report = start_paged_model(model, attention, engine, max_model_len)
    scheduler = BatchScheduler(
        runner,
        engine,
        [KVGroupSpec("full_attention", report.kv_pages[0], model.page_size)],
        config.eos_token_ids,
        max_model_len,
        model_id=f"qwen3:{path.resolve()}",
        vocab_size=config.vocab_size,
    )
    return LoadedModel(name=path.name, scheduler=scheduler, tokenizer=tokenizer, max_model_len=max_model_len)
