"""Gemma 3 model line (text tower)."""

from models.gemma3.config import MODEL_TYPES, parse_gemma3_config
from models.gemma3.model import Gemma3Model
from models.gemma3.sharding import shard_plan
from models.gemma3.weights import shard_slices, weight_map
from models.paged_line import PagedLine, ShardedRuntime, register_paged_line

GEMMA3 = PagedLine(
    family="gemma3",
    model_types=MODEL_TYPES,
    parse_config=parse_gemma3_config,
    context_field="max_position_embeddings (text config)",
    weight_map=weight_map,
    shard_plan=shard_plan,
    build_model=Gemma3Model,
    sharded=ShardedRuntime(shard_slices, Gemma3Model),
)
register_paged_line(GEMMA3)
