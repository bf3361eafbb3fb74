"""Qwen3 dense model line."""

from models.paged_line import PagedLine, ShardedRuntime, register_paged_line
from models.qwen3.config import MODEL_TYPES, parse_qwen3_config
from models.qwen3.model import Qwen3Model
from models.qwen3.sharding import shard_plan
from models.qwen3.weights import shard_slices, weight_map

QWEN3 = PagedLine(
    family="qwen3",
    model_types=MODEL_TYPES,
    parse_config=parse_qwen3_config,
    context_field="max_position_embeddings",
    weight_map=weight_map,
    build_model=Qwen3Model,
    shard_plan=shard_plan,
    sharded=ShardedRuntime(shard_slices, Qwen3Model),
)
register_paged_line(QWEN3)
