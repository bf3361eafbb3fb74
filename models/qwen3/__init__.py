"""Qwen3 dense model line."""

from models.qwen3.config import MODEL_TYPES
from models.qwen3.line import load_qwen3
from models.registry import register_model_types

register_model_types(MODEL_TYPES, load_qwen3)
