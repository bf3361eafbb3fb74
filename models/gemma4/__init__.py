"""Gemma 4 model line (text tower)."""

from models.gemma4.config import MODEL_TYPES
from models.gemma4.line import load_gemma4
from models.registry import register_model_types

register_model_types(MODEL_TYPES, load_gemma4)
