"""Loading a Qwen3 checkpoint into a served model: config, checked weights, KV pool, scheduler."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.progress import Progress

from engine.config import EngineConfig
from engine.kv import KVGroupSpec
from engine.model_runner import PagedModelRunner
from engine.scheduler import BatchScheduler
from kernels.kv_layout import KVPoolLayout
from models.checkpoint import check_tensors, iter_tensors, stored_tensors
from models.device_choice import pick_attention, pick_device, pick_dtype
from models.hf_tokenizer import HFTokenizer
from models.qwen3.config import Qwen3Config, parse_qwen3_config
from models.qwen3.model import Qwen3Model
from models.qwen3.weights import expected_tensors, ignored_tensor
from models.registry import LoadedModel, ModelOptions

# KV the CPU path reserves when --num-kv-pages is not given (there is no device memory to measure).
CPU_KV_BYTES = 1 << 30


def load_weights(
    path: Path, config: Qwen3Config, device: torch.device, dtype: torch.dtype, quiet: bool = False
) -> dict[str, torch.Tensor]:
    expected = expected_tensors(config)
    stored = stored_tensors(path)
    check_tensors(path, expected, stored, ignore=ignored_tensor)
    weights: dict[str, torch.Tensor] = {}
    with Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task(f"loading {path.name}", total=len(expected))
        for name, tensor in iter_tensors(stored, list(expected), device, dtype):
            weights[name] = tensor
            progress.advance(task)
    return weights


def kv_pages(config: Qwen3Config, engine: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    if engine.num_kv_pages is not None:
        return engine.num_kv_pages
    per_page = KVPoolLayout(config.num_layers, 2, config.num_kv_heads, config.head_dim).bytes(dtype) // 2
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * 0.8)
    else:
        budget = CPU_KV_BYTES
    return max(2, budget // per_page)


def load_qwen3(spec: str, options: ModelOptions) -> LoadedModel:
    path = Path(spec)
    config = parse_qwen3_config(path)
    device = pick_device(options)
    dtype = pick_dtype(options, device)
    tokenizer = HFTokenizer(path)
    weights = load_weights(path, config, device, dtype)
    engine = options.engine
    max_model_len = min(
        engine.max_model_len or config.max_position_embeddings, config.max_position_embeddings
    )
    layout = KVPoolLayout(
        config.num_layers, kv_pages(config, engine, dtype, device), config.num_kv_heads, config.head_dim
    )
    model = Qwen3Model(config, weights, layout.allocate(dtype, device), layout.page_size, max_model_len)
    runner = PagedModelRunner(model, pick_attention(options, device, dtype))
    scheduler = BatchScheduler(
        runner,
        engine,
        [KVGroupSpec("full_attention", layout.pages, layout.page_size)],
        config.eos_token_ids,
        max_model_len,
        model_id=f"qwen3:{path.resolve()}",
        vocab_size=config.vocab_size,
    )
    return LoadedModel(name=path.name, scheduler=scheduler, tokenizer=tokenizer, max_model_len=max_model_len)
