"""Engine configuration shared by every model line."""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract import ContractError
from kernels.gemm.names import POLICY_NAMES


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 256
    # Token budget of one step: decode rows first, then prefill chunks.
    max_num_batched_tokens: int = 2048
    # None: the model's own limit (its config's max_position_embeddings).
    max_model_len: int | None = None
    # Lets max_model_len go above the model's own limit (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN);
    # without it a model line refuses to start there (models/context_limit.py).
    allow_long_max_model_len: bool = False
    # None: sized by the model line (measured memory on GPU, a default on CPU).
    num_kv_pages: int | None = None
    enable_prefix_caching: bool = True
    # Decode steps run eagerly instead of through captured CUDA graphs.
    enforce_eager: bool = False
    # Fraction of device memory the engine may take (weights, activations, graphs and KV).
    gpu_memory_utilization: float = 0.9
    # Bytes of KV cache, overriding the measured budget (num_kv_pages, if set, wins over both).
    kv_cache_memory: int | None = None
    # GEMM numeric policy for every projection and the LM head (kernels.gemm; docs/numerics.md).
    numeric_policy: str = "tuned"
    # Overlapped prefill: newly admitted requests prefill on a second CUDA stream while decode steps
    # go on, and join the decode rows at a later step (engine/scheduler.py; docs/engine.md).
    async_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ContractError(name, value, "must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ContractError("max_model_len", self.max_model_len, "must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ContractError("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ContractError("kv_cache_memory", self.kv_cache_memory, "must be a positive number of bytes")
        if self.numeric_policy not in POLICY_NAMES:
            raise ContractError(
                "numeric_policy", self.numeric_policy, f"must be one of {', '.join(POLICY_NAMES)}"
            )
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ContractError("num_kv_pages", self.num_kv_pages, "must be at least 2 (page 0 is padding)")
