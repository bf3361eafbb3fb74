"""Engine configuration shared by every model line."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.contract import ContractError
from kernels.gemm.names import POLICY_NAMES

SAMPLING_BACKENDS = ("torch", "triton")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # A field's metadata "help" makes it an engine knob: an option of `infer serve` (and of the bench
    # commands that take it) with this default and help (infer_cli/engine_options.py).
    max_num_seqs: int = field(default=256, metadata={"help": "Most requests running at once."})
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={"help": "Token budget of one engine step: decode rows first, then prefill chunks."},
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "Context length (default: the model's max_position_embeddings)."}
    )
    # Checked where a model line resolves its context ceiling (models/context_limit.py).
    allow_long_max_model_len: bool = field(
        default=False,
        metadata={
            "help": "Allow --max-model-len above the model's max_position_embeddings (vLLM's "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN); without it the model refuses to start. Outputs past it "
            "may degrade."
        },
    )
    num_kv_pages: int | None = field(
        default=None,
        metadata={
            "help": "KV pages (16 tokens) per full-attention group; sliding groups get what they need "
            "(default: measured on GPU, a fixed count on CPU)."
        },
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "Reuse KV of shared prompt prefixes."}
    )
    enforce_eager: bool = field(default=False, metadata={"help": "Decode without CUDA graphs."})
    # engine/prefill_graphs.py; docs/engine.md, "Prefill graphs".
    prefill_graphs: bool = field(
        default=False,
        metadata={
            "help": "Prefill and mixed steps as CUDA graphs cut at attention and other host-planned ops "
            "(buckets of tokens up to --max-num-batched-tokens; none under --enforce-eager); opt-in "
            "until measured on a GPU."
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "Fraction of GPU memory for weights, activations, graphs and KV."}
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata={
            "help": "KV-cache size in bytes, overriding the measured budget (--num-kv-pages, if set, "
            "wins over both)."
        },
    )
    # kernels.gemm; docs/numerics.md.
    numeric_policy: str = field(
        default="tuned",
        metadata={
            "help": "GEMM numerics of every projection and the LM head: tuned (cuBLAS), pin, per-token "
            "(diagnostic oracle) or invariant (batch-invariant)."
        },
    )
    # Overlapped prefill (engine/scheduler.py; docs/engine.md).
    async_prefill: bool = field(
        default=False,
        metadata={
            "help": "Prefill new requests on a second CUDA stream while decode steps continue; they "
            "join the decode rows at a later step. Replaces async scheduling (one overlap at a time)."
        },
    )

    # Async scheduling (engine/scheduler.py; docs/engine.md). None: on, unless async_prefill overlaps
    # instead (`async_scheduling_enabled`); True with async_prefill is refused.
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            "help": "Schedule and launch the next step while the device runs this one; sampled ids "
            "stay on the device and feed the next step's inputs. Default: on, unless --async-prefill.",
            "negatable": True,
        },
    )

    # The token draw of sampled rows (engine/sampling.py; docs/engine.md, "Sampling").
    sampling_backend: str = field(
        default="torch",
        metadata={
            "help": "torch (the spec's ops) or triton (the token draw in one Triton launch, CUDA; opt-in)."
        },
    )

    # Tensor parallelism (engine/parallel; docs/tensor-parallel.md).
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks the model is split over (CPU: worker processes over gloo; CUDA: one GPU "
            "per rank over NCCL); lines not yet sharded refuse more than 1."
        },
    )
    collective_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "Seconds a tensor-parallel rank waits for the others in any collective before the "
            "step fails.",
            "flag": "--collective-timeout",
        },
    )

    @property
    def async_scheduling_enabled(self) -> bool:
        """Whether steps run under async scheduling: as asked, and by default unless async_prefill
        (the other overlap; one of the two at a time) is on."""
        return not self.async_prefill if self.async_scheduling is None else self.async_scheduling

    @property
    def triton_draw(self) -> bool:
        """Whether sampled rows draw their token through the Triton kernel (`--sampling-backend`)."""
        return self.sampling_backend == "triton"

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
        if self.tensor_parallel_size < 1:
            raise ContractError("tensor_parallel_size", self.tensor_parallel_size, "must be at least 1")
        if self.collective_timeout_s <= 0:
            raise ContractError("collective_timeout_s", self.collective_timeout_s, "must be positive")
        if self.numeric_policy not in POLICY_NAMES:
            raise ContractError(
                "numeric_policy", self.numeric_policy, f"must be one of {', '.join(POLICY_NAMES)}"
            )
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ContractError("num_kv_pages", self.num_kv_pages, "must be at least 2 (page 0 is padding)")
        if self.sampling_backend not in SAMPLING_BACKENDS:
            raise ContractError(
                "sampling_backend", self.sampling_backend, f"must be one of {', '.join(SAMPLING_BACKENDS)}"
            )
        if self.async_scheduling and self.async_prefill:
            raise ContractError(
                "async_scheduling", True, "cannot be combined with async_prefill (one of the two at a time)"
            )
