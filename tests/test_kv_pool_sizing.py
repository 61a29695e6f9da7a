"""The default KV pool is sized per device: each device pays only for its share of a page.

Under tensor parallelism a device holds its KV heads of every page, under
pipeline parallelism its stage's layers. `cache_bytes_per_device` is checked
against the bytes the placed cache really has on one device, and the engine's
default pool against a device memory budget.
"""

import jax
import pytest

from conftest import tiny_config
from model.cache import init_cache
from serving.core import kv_pool
from serving.core.engine import EngineConfig, default_num_pages
from serving.llm import parallel_layout

CFG = tiny_config(num_heads=8, num_kv_heads=4, num_layers=4)  # 4 KV heads: split 4 ways at most
PAGE = 8


def placed_bytes_on_first_device(layout, num_pages, dtype=None):
    if hasattr(layout, "init_cache"):  # pipeline stages
        cache = layout.init_cache(CFG, num_pages, PAGE, dtype)
    else:
        cache = init_cache(CFG, num_pages, PAGE, dtype, shardings=layout.cache_shardings(CFG, num_pages, PAGE, dtype))
    device = layout.mesh.devices.flat[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(cache) for s in x.addressable_shards if s.device == device)


# (tensor, pipeline) -> how many ways a page is split on each device (8-way TP over 4 KV
# heads keeps every head on every device: the megatron rules replicate them)
SPLITS = {(1, 1): 1, (2, 1): 2, (4, 1): 4, (8, 1): 1, (1, 2): 2, (2, 2): 4, (1, 4): 4, (2, 4): 8}


@pytest.mark.parametrize("tp,pp", sorted(k for k in SPLITS if k != (1, 1)))  # (1, 1) has no layout
@pytest.mark.parametrize("dtype", [None, "int8"])
def test_cache_bytes_per_device_is_what_a_device_holds(tp, pp, dtype):
    layout = parallel_layout(tp, pp)
    split = SPLITS[(tp, pp)]
    total = sum(x.nbytes for x in jax.tree.leaves(init_cache(CFG, 16, PAGE, dtype)))
    got = layout.cache_bytes_per_device(CFG, 16, PAGE, dtype)
    assert got == placed_bytes_on_first_device(layout, 16, dtype)
    assert got * split == total


def test_default_pool_fills_each_devices_budget(monkeypatch):
    budget = 64 * 2**20
    monkeypatch.setattr(kv_pool, "device_memory_stats",
                        lambda device: {"bytes_limit": budget, "bytes_in_use": 0})
    config = EngineConfig(page_size=PAGE, max_num_seqs=10**6, kv_cache_memory_fraction=1.0)
    one = default_num_pages(CFG, config, 1024)
    page_bytes = sum(x.nbytes for x in jax.tree.leaves(init_cache(CFG, 1, PAGE)))
    assert one == budget // page_bytes
    for (tp, pp), split in SPLITS.items():
        layout = parallel_layout(tp, pp)
        pages = default_num_pages(CFG, config, 1024, layout=layout)
        assert pages == (one if layout is None else budget * split // page_bytes), (tp, pp)


def test_host_memory_budget_is_for_the_whole_pool(monkeypatch):
    monkeypatch.setattr(kv_pool, "device_memory_stats", lambda device: None)
    config = EngineConfig(page_size=PAGE, max_num_seqs=10**6, host_kv_cache_bytes=2**20)
    page_bytes = sum(x.nbytes for x in jax.tree.leaves(init_cache(CFG, 1, PAGE)))
    want = 2**20 // page_bytes
    assert default_num_pages(CFG, config, 1024) == want
    assert default_num_pages(CFG, config, 1024, layout=parallel_layout(4, 2)) == want
    assert want > 0
