"""The context ceiling a model line serves: the config's default, lowered freely, raised only on request.

vLLM's rule, so a vLLM command line behaves the same here: a model's default `max_model_len` is its
config's `max_position_embeddings`; `--max-model-len` may go below it, and above it only with the
explicit opt-in (`--allow-long-max-model-len` / `INFER_ALLOW_LONG_MAX_MODEL_LEN=1`, vLLM's
`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`). Past the default the checkpoint was not trained, so outputs may
degrade; the opt-in says the user knows that. Every real model line resolves its ceiling here, before
any weight or KV page is allocated, so a refusal leaves nothing behind.
"""

from __future__ import annotations

import logging

from models.registry import ModelLoadError

log = logging.getLogger("infer.context")

OPT_IN_FLAG = "--allow-long-max-model-len"
OPT_IN_ENV = "INFER_ALLOW_LONG_MAX_MODEL_LEN"


def resolve_max_model_len(requested: int | None, default: int, field: str, allow_long: bool) -> int:
    """The `max_model_len` to serve. `requested`: the engine's `max_model_len` (None: the default).
    `default`: the config's `max_position_embeddings`, named by `field` in any refusal.

    Raises ModelLoadError (which `infer serve` prints as a clean start-up error) when `requested`
    exceeds `default` without `allow_long`: silently clamping would serve a shorter context than the
    user asked for, and silently raising would serve positions the model was never trained on."""
    if default < 1:
        raise ModelLoadError(f"{field} = {default}: a model's context ceiling must be at least 1")
    if requested is None:
        return default
    if requested < 1:
        raise ModelLoadError(f"max_model_len = {requested}: must be at least 1")
    if requested <= default:
        return requested
    if not allow_long:
        raise ModelLoadError(
            f"max_model_len = {requested} is above the model's default ceiling, {field} = {default}; "
            f"lower --max-model-len to at most {default}, or pass {OPT_IN_FLAG} (or set {OPT_IN_ENV}=1, "
            "as VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in vLLM) to serve past it, where outputs may degrade"
        )
    log.warning(
        "max_model_len = %d is above %s = %d (allowed by %s): positions past %d were not trained and "
        "may give degraded output",
        requested,
        field,
        default,
        OPT_IN_FLAG,
        default,
    )
    return requested
