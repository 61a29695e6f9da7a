"""Power-of-two sizes, the one definition every padded shape uses.

A jitted function compiles once per input shape, so lengths are padded up to a power of two: the
kernels' tiles and head groups, the engine's step buckets (`serving.core.input_batch`), the KV transfer's
page and token counts (`serving.disaggregation.kv_transfer`), and the metrics' token histograms follow the same
ladder. Plain Python, no jax: the metrics import it too.
"""

from __future__ import annotations


def next_pow2(n: int, floor: int = 1) -> int:
    """The smallest `floor * 2**k` (k >= 0) that is >= n; `floor` for n <= floor."""
    b = floor
    while b < n:
        b *= 2
    return b


def powers_of_two(limit: int, start: int = 1) -> list[int]:
    """`start, 2 * start, 4 * start, ...` below `limit`, then `limit` itself: the sizes a length up to
    `limit` is padded to (`start` < 1 counts as 1)."""
    out, b = [], max(1, start)
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out
