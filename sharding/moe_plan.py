"""The planner's mixture-of-experts arithmetic: which expert weights a step reads.

A token reads `k` of a layer's `E` experts. With routing taken as uniform and independent
per token (the planner's assumption; a trained router is balanced by its auxiliary loss),
an expert is untouched by `B` tokens with probability (1 - k/E)^B, so a layer's expected
distinct experts touched is

    E * (1 - (1 - k/E)^B)

and a step streams that fraction, 1 - (1 - k/E)^B, of every device's expert bytes (under
expert parallelism each device holds E/ep experts and each is touched with the same
probability; under tensor parallelism inside the experts each device holds a slice of all
of them). FLOPs follow the tokens, not the touched experts: k/E of the expert parameters
per token. The bytes therefore grow with the batch until every expert is touched, which
moves the decode roofline's memory term from the active parameters (B = 1) to all of them.
"""

from __future__ import annotations

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def touched_fraction(num_experts: int, k: int, tokens: float) -> float:
    """Expected fraction of a layer's experts that `tokens` tokens route to."""
    if num_experts <= 0:
        return 1.0
    return 1.0 - (1.0 - k / num_experts) ** tokens


def experts_touched(num_experts: int, k: int, tokens: float) -> float:
    """Expected distinct experts of one layer touched by `tokens` tokens."""
    return num_experts * touched_fraction(num_experts, k, tokens)


def decode_bytes_by_batch(dense_bytes: float, expert_bytes: float, kv_bytes_per_token: float, context_len: int,
                          num_experts: int, k: int, batches=DECODE_BATCHES) -> list[dict]:
    """Per device: bytes one decode step of each batch reads (dense weights, the expected
    touched experts, every sequence's KV at `context_len`)."""
    rows = []
    for b in batches:
        frac = touched_fraction(num_experts, k, b)
        experts = expert_bytes * frac
        rows.append({"batch": b, "experts_touched_per_layer": experts_touched(num_experts, k, b),
                     "expert_bytes": experts, "dense_bytes": dense_bytes,
                     "kv_bytes": kv_bytes_per_token * context_len * b,
                     "bytes": dense_bytes + experts + kv_bytes_per_token * context_len * b})
    return rows
