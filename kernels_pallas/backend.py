"""What an attention backend is, apart from the registry that names them (`kernels_pallas`).

The backends' own modules (`kernels_pallas.kernels`, `ragged_paged_attention`) import this module
rather than the package, whose `get_backend` imports them: a leaf, free of jax.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    attention: Callable
    write_kv: Callable
    # Whether attention / write_kv accept the optional k_scale / v_scale of an int8 / fp8
    # cache (see `reference`). A backend without it is refused for a quantized cache.
    quantized_kv: bool = False
    # The product `x [M, K] @ (data * scale)^T` of a group-quantized weight (`kernels_pallas.grouped_matmul`'s
    # contract), run by the backend's kernel; None: XLA's (the weight widened as the product's operand).
    grouped_matmul: Callable | None = None


def pallas_supports_head_dim(head_dim: int) -> bool:
    """The Pallas kernels' head sizes: powers of two from 16 (Phi-3's 96 is not one)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)
