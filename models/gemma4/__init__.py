"""Gemma 4 model line (text tower)."""

from models.gemma4.config import MODEL_TYPES, parse_gemma4_config
from models.gemma4.model import Gemma4Model
from models.gemma4.sharding import shard_plan
from models.gemma4.weights import shard_slices, weight_map
from models.paged_line import PagedLine, ShardedRuntime, register_paged_line

GEMMA4 = PagedLine(
    family="gemma4",
    model_types=MODEL_TYPES,
    parse_config=parse_gemma4_config,
    context_field="max_position_embeddings (text config)",
    weight_map=weight_map,
    shard_plan=shard_plan,
    build_model=Gemma4Model,
    sharded=ShardedRuntime(shard_slices, Gemma4Model),
)
register_paged_line(GEMMA4)
