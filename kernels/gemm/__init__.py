"""GEMM numeric policies: `tuned`, `pin`, `per-token` and `invariant` (docs/numerics.md).

The package root re-exports only the names (no torch, no Triton), so configuration code can check a
policy name cheaply; `kernels.gemm.dispatch.policy_linear` builds a policy's linear.
"""

from kernels.gemm.names import (
    END_TO_END_INVARIANT,
    POLICY_NAMES,
    NumericPolicy,
    UnknownPolicyError,
    is_end_to_end_invariant,
    parse_policies,
    parse_policy,
)

__all__ = [
    "END_TO_END_INVARIANT",
    "POLICY_NAMES",
    "NumericPolicy",
    "UnknownPolicyError",
    "is_end_to_end_invariant",
    "parse_policies",
    "parse_policy",
]
