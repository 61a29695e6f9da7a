"""Attention backends: the paged-attention and KV-write functions the model calls.

A backend is a pair (attention, write_kv) with the signatures of
`kernels_pallas.reference`. The model picks one by name, statically:
"reference" is plain jnp (the oracle); "xla" is plain jnp organised for the
CPU (`kernels_pallas.xla_attention`); "auto" picks the Pallas kernels on GPU
and "xla" elsewhere.

A backend's modules (and jax) are imported when it is first asked for, so
the package's small jax-free helpers (`kernels_pallas.pow2`) import alone.
"""

from __future__ import annotations

from typing import Callable

from kernels_pallas.backend import AttentionBackend, pallas_supports_head_dim

__all__ = ["AttentionBackend", "backend_names", "get_backend", "pallas_supports_head_dim", "register_backend"]


def _reference() -> AttentionBackend:
    from kernels_pallas.reference import ragged_paged_attention_reference, write_kv_reference

    return AttentionBackend("reference", ragged_paged_attention_reference, write_kv_reference, quantized_kv=True)


def _xla() -> AttentionBackend:
    from kernels_pallas.reference import write_kv_reference
    from kernels_pallas.xla_attention import ragged_paged_attention_xla

    return AttentionBackend("xla", ragged_paged_attention_xla, write_kv_reference, quantized_kv=True)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"reference": _reference, "xla": _xla}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def backend_names() -> list[str]:
    _load_kernels()
    return sorted(_BACKENDS) + ["auto"]


def _load_kernels() -> None:
    # The Pallas kernels are optional, so the reference path works even where Pallas cannot
    # be imported; their module lists its backends, registered here on first use.
    try:
        from kernels_pallas.kernels import PALLAS_BACKENDS
    except ImportError:
        return
    for name, factory in PALLAS_BACKENDS.items():
        _BACKENDS.setdefault(name, factory)


def get_backend(name: str = "auto", head_dim: int | None = None) -> AttentionBackend:
    """The backend `name`; "auto" is the Pallas kernels on GPU for the head sizes they take
    (`head_dim`, when given), the xla backend otherwise."""
    import jax

    _load_kernels()
    if name == "auto":
        pallas = jax.default_backend() == "gpu" and "pallas" in _BACKENDS
        name = "pallas" if pallas and (head_dim is None or pallas_supports_head_dim(head_dim)) else "xla"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {backend_names()}")
    return _BACKENDS[name]()
