"""The Pallas backends, which `kernels_pallas.get_backend` registers on first use.

"pallas" runs the kernels compiled for the GPU (attention, the KV write, and the
products with group-quantized weights); "pallas_interpret" runs the very same
kernel bodies through Pallas' interpreter on any platform. The
interpreter is slow and exists for tests: the CPU serving path is the
reference ("auto" picks it off-GPU).
"""

from __future__ import annotations

import functools

from kernels_pallas.backend import AttentionBackend
from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.kv_cache_write import write_kv
from kernels_pallas.ragged_paged_attention import ragged_paged_attention


def _backend(name: str, interpret: bool) -> AttentionBackend:
    return AttentionBackend(
        name,
        functools.partial(ragged_paged_attention, interpret=interpret),
        functools.partial(write_kv, interpret=interpret),
        quantized_kv=True,
        grouped_matmul=functools.partial(grouped_matmul, interpret=interpret),
    )


PALLAS_BACKENDS = {
    "pallas": lambda: _backend("pallas", interpret=False),
    "pallas_interpret": lambda: _backend("pallas_interpret", interpret=True),
}
