"""The GEMM numeric policies by name: what `--numeric-policy` and `EngineConfig.numeric_policy` accept.

Kept free of torch and Triton so configuration code can validate a name without loading kernels.
"""

from __future__ import annotations

from enum import StrEnum


class UnknownPolicyError(ValueError):
    """A numeric-policy name that is not one of `NumericPolicy`; the message names it."""


class NumericPolicy(StrEnum):
    # cuBLAS through torch: fastest, free to pick a different algorithm per batch size.
    TUNED = "tuned"
    # One fixed kernel configuration per weight shape, chosen once, reused for every batch size.
    PIN = "pin"
    # One GEMM per row: a slow diagnostic oracle, batch-invariant by construction.
    PER_TOKEN = "per-token"
    # The batch-invariant Triton GEMM: fixed tiles and a K split fixed per weight shape.
    INVARIANT = "invariant"


POLICY_NAMES: tuple[str, ...] = tuple(p.value for p in NumericPolicy)


def parse_policy(name: str) -> NumericPolicy:
    try:
        return NumericPolicy(name.strip())
    except ValueError:
        raise UnknownPolicyError(
            f"numeric policy {name!r} is unknown; choose one of {', '.join(POLICY_NAMES)}"
        ) from None


def parse_policies(text: str) -> tuple[NumericPolicy, ...]:
    """A comma-separated list (`tuned,invariant`), in order, each name once."""
    names = [n for n in (part.strip() for part in text.split(",")) if n]
    if not names:
        raise UnknownPolicyError(
            f"numeric policy list {text!r} is empty; choose from {', '.join(POLICY_NAMES)}"
        )
    policies = tuple(parse_policy(n) for n in names)
    if len(set(policies)) != len(policies):
        raise UnknownPolicyError(f"numeric policy list {text!r} names a policy twice")
    return policies


# The policies whose whole forward is batch-invariant, not only their GEMMs: the models' RMSNorms go
# through the batch-invariant norm and attention plans a KV split that ignores the batch. `pin`'s
# GEMM is row-count independent too, but it keeps `tuned`'s norm and attention (docs/numerics.md).
END_TO_END_INVARIANT: frozenset[NumericPolicy] = frozenset({NumericPolicy.PER_TOKEN, NumericPolicy.INVARIANT})


def is_end_to_end_invariant(policy: NumericPolicy | str) -> bool:
    """Whether `policy` asks for batch invariance of norms and attention as well as of the GEMMs."""
    chosen = parse_policy(policy) if isinstance(policy, str) else policy
    return chosen in END_TO_END_INVARIANT
