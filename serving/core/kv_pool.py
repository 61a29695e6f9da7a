"""How many KV pages an engine gets when it is not told: sized from device (or host) memory.

On a device that reports its memory the pool takes `kv_cache_memory_fraction`
of it, less what is already in use, counting only the share of a page that
device holds; on the host (XLA:CPU reports nothing) it takes a fixed
`host_kv_cache_bytes` for the whole pool. Never more than `max_num_seqs`
full-length sequences could use.
"""

from __future__ import annotations

from typing import Optional

import jax

from model.families import kv_bytes_per_token


def device_memory_stats(device) -> Optional[dict]:
    """The device's `memory_stats()`, or None where the backend reports none (CPU)."""
    try:
        return device.memory_stats()
    except Exception:  # some backends do not implement it
        return None


def default_num_pages(cfg, config, max_model_len: int, cache_dtype=None,
                      layout=None) -> int:
    """Pages that fit the memory budget of `config` (an `EngineConfig`), and no more than
    `max_num_seqs` full-length sequences need.

    On devices that report their memory the budget is per device, and so is a page's cost:
    with a `layout` each device holds only its share of a page (its KV heads under tensor
    parallelism, its stage's layers under pipeline parallelism)."""
    page_bytes = kv_bytes_per_token(cfg, cache_dtype) * config.page_size  # scales of a quantized cache included
    device = jax.devices()[0] if layout is None else next(  # one of this process's devices
        d for d in layout.mesh.devices.flat if d.process_index == jax.process_index())
    stats = device_memory_stats(device)
    if stats and stats.get("bytes_limit"):
        budget = stats["bytes_limit"] * config.kv_cache_memory_fraction - stats.get("bytes_in_use", 0)
        if layout is not None:
            probe = 64  # pages; a multiple of any split of the page axis
            page_bytes = layout.cache_bytes_per_device(cfg, probe, config.page_size, cache_dtype) / probe
    else:  # host memory: one budget for the whole pool, wherever its shards live
        budget = config.host_kv_cache_bytes
    wanted = config.max_num_seqs * -(-max_model_len // config.page_size)
    return max(1, min(wanted, int(budget // page_bytes)))
