"""The host tier of the prefix cache and swap preemption (serving.features.host_kv_tier).

Units: the host page pool's budget and LRU, the block manager's host hooks. Engines: greedy outputs
equal with the tier off and on, under recompute / swap / auto preemption in a pool so small that
requests are preempted again and again; with an int8 KV cache, a cache salt, n = 2 and speculation;
an evicted prefix restored from the host gives the same tokens and logprobs and counts as a hit; a
flood of distinct prompts stays within the host budget; an abort frees the host pages of a
swapped-out request; another salt restores nothing; nothing compiles after warm-up.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import ragged_prompts, run_to_completion, tiny_config
from model.families import kv_bytes_per_token
from model.params import init_params
from serving import LLM, SamplingParams
from serving.features import kv_pages
from serving.core.block_manager import BlockManager, HostHit, salt_digest
from serving.core.engine import Engine, EngineConfig
from serving.features.host_kv_tier import HostKVTier, HostPagePool, offload_bytes

V = 96  # divides over 2 devices (tensor parallelism shards the vocabulary)
CFG = tiny_config(vocab_size=V, max_position_embeddings=256)
# One token bucket and one context bucket: every engine of this module compiles the same step.
SHAPES = dict(page_size=4, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32,
              min_context_bucket=64, async_scheduling=False)
TIGHT = 12  # pages (48 tokens): every request but the first admitted is preempted (the latest admitted goes first)
ROOMY = 256


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(3))


def build(params, num_pages=TIGHT, **options) -> LLM:
    return LLM(config=CFG, params=params, num_pages=num_pages, **{**SHAPES, **options})


def greedy_params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 16), ignore_eos=True, **kw)


def run(llm, prompts, params_=None, salt=None, prefix="r") -> dict:
    """{request index: RequestOutput} of `prompts` run to completion on `llm`'s engine."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params_ or greedy_params(), cache_salt=salt)
    outs = run_to_completion(engine)
    return {int(rid[len(prefix):]): o for rid, o in outs.items()}


def tokens(outs) -> list:
    return [[list(o.token_ids) for o in outs[i].outputs] for i in sorted(outs)]


def check(llm) -> None:
    llm.engine.block_manager.check_invariants(live_seq_ids=())
    if llm.engine.part(HostKVTier) is not None:
        llm.engine.part(HostKVTier).check_invariants()
        assert not llm.engine.part(HostKVTier).pool.pins, "pins outlive the sequences that held them"


PROMPTS = ragged_prompts(V, n=6, seed=1, max_len=30)  # 7 to 31 tokens


@pytest.fixture(scope="module")
def reference(params):
    """The plain engine's greedy tokens in a pool that holds everything (no preemption, no tier)."""
    llm = build(params, ROOMY)
    out = tokens(run(llm, PROMPTS))
    assert llm.engine.scheduler.num_preemptions == 0
    return out


# --- units -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_host_pool_holds_whole_pages_within_its_budget(dtype):
    from model.quant import kv_cache_dtype

    cache_dtype = kv_cache_dtype(CFG, dtype)
    page_bytes = kv_bytes_per_token(CFG, cache_dtype) * 4
    pool = HostPagePool(CFG, cache_dtype, 4, 3 * page_bytes + page_bytes // 2)
    assert pool.num_pages == 3 and pool.nbytes == 3 * page_bytes  # scales of an int8 page included
    assert (pool.scale is not None) == (dtype == "int8")
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    pages = [pool.reserve(x) for x in (a, b, c)]
    assert sorted(pages) == [0, 1, 2] and not pool.holds(a)  # pending until its bytes arrive
    assert pool.reserve(d) is None  # full of pending pages: nothing to evict
    pool.fill([a, b, c], pages, np.ones((2, 2, 3, 4, 2, 16)), np.ones((2, 2, 3, 4, 2)))
    assert pool.holds(a) and pool.holds(b)
    pool.touch(a)  # b is now the least recently used
    pool.pin(b)  # ... but pinned: c goes instead
    assert pool.reserve(d) == pages[2] and not pool.holds(c) and pool.holds(b)
    pool.unpin(b)
    pool.drop(b)
    assert not pool.holds(b) and pool.num_used == 2
    pool.check_invariants()


class _Seq:
    def __init__(self, tokens, salt=None):
        self.seq_id = id(self)
        self.token_ids = list(tokens)
        self.num_computed_tokens = 0
        self.block_hashes = []
        self.hash_root = salt_digest(salt)
        self.keeps_all_pages = False

    @property
    def num_tokens(self):
        return len(self.token_ids)


class _Host:
    """The block manager's view of a host tier: a set of digests, and what it was told."""

    def __init__(self):
        self.digests, self.evicted, self.restored = set(), [], []

    def holds(self, digest):
        return digest in self.digests

    def evicting(self, page, digest):
        self.evicted.append((page, digest))
        self.digests.add(digest)

    def restoring(self, digest, page):
        self.restored.append((digest, page))

    def check_invariants(self):  # called by the block manager's own check
        assert {d for d, _ in self.restored} <= self.digests, "restored a block the host never held"


def test_the_block_manager_reports_evictions_and_restores_host_hits_into_free_pages():
    bm = BlockManager(num_pages=4, page_size=4)
    bm.host = host = _Host()
    a = _Seq(range(1, 14))  # 3 full pages and one token
    assert bm.allocate(a, 13) == []
    a.num_computed_tokens = 13
    bm.register_full_blocks(a)
    bm.free_seq(a)
    b = _Seq(range(50, 66))  # takes every page: a's three cached pages are evicted
    assert bm.allocate(b, 16) == []
    assert {d for _, d in host.evicted} == set(a.block_hashes[:3])
    bm.free_seq(b)
    again = _Seq(range(1, 14))
    hits = bm.lookup_prefix(again)
    assert [type(h) for h in hits] == [HostHit] * 3
    assert bm.allocate(again, 1, hits) == []
    table = bm.table(again)
    assert [d for d, _ in host.restored] == a.block_hashes[:3] and [p for _, p in host.restored] == table[:3]
    assert all(bm.ref[p] == 1 and bm.block_hash[p] == d for d, p in host.restored)  # fresh, registered
    bm.check_invariants([again.seq_id])
    # another salt names other digests: the host tier is asked, and holds nothing of theirs
    assert bm.lookup_prefix(_Seq(range(1, 14), salt="tenant-b")) == []


def test_the_offload_options():
    assert offload_bytes(0, None) == 0 and offload_bytes(1000, None) == 1000
    assert offload_bytes(0, 0.5) == 2**29 and offload_bytes(2**29, 0.5) == 2**29
    with pytest.raises(ValueError, match="disagree"):
        offload_bytes(1000, 1.0)


def test_an_engine_refuses_swap_without_a_tier_and_a_tier_without_prefix_caching_and_takes_gib(params):
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        build(params, preemption_mode="swap")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        build(params, kv_offload_bytes=2**20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV page"):
        build(params, kv_offload_bytes=100)
    gib = build(params, kv_offloading_size=0.001).engine  # vLLM's spelling, in GiB
    pool = gib.part(HostKVTier).pool
    assert pool.nbytes <= 0.001 * 2**30 < pool.nbytes + pool.page_bytes
    assert gib.describe()["kv_offload_bytes"] == pool.nbytes
    # An engine built without its parts (serving.features.build_parts) refuses the tier's options, not ignores them.
    with pytest.raises(ValueError, match="kv_offload_bytes=1048576 needs the host KV tier part"):
        Engine(CFG, params, None, EngineConfig(num_pages=TIGHT, kv_offload_bytes=2**20, **SHAPES))


# --- engines: equivalence ---------------------------------------------------------------------------------

def _preempted_requests(llm) -> set:
    """Request ids the scheduler preempts from now on (a wrapper around its preemption hook)."""
    seen, sched = set(), llm.engine.scheduler
    inner = sched.on_preempt

    def hook(seq):
        seen.add(seq.request.request_id)
        if inner is not None:
            inner(seq)

    sched.on_preempt = hook
    return seen


@pytest.mark.parametrize("mode", ["off", "recompute", "swap", "auto", "swap+overlap"])
def test_greedy_tokens_are_the_same_with_the_tier_off_and_on_under_every_preemption_mode(params, reference, mode):
    """"+overlap": overlapped scheduling, so pages are swapped out while the step that writes them runs."""
    overlap = mode.endswith("+overlap")
    mode = mode.removesuffix("+overlap")
    options = {} if mode == "off" else dict(kv_offload_bytes=2**20, preemption_mode=mode, async_scheduling=overlap)
    llm = build(params, **options)
    preempted = _preempted_requests(llm)
    assert tokens(run(llm, PROMPTS)) == reference
    assert len(preempted) >= len(PROMPTS) - 1, preempted  # all but the first admitted, at least
    assert llm.engine.scheduler.num_preemptions >= len(PROMPTS) - 1
    # the same prompts again: their pages come back from the device cache or the host tier
    assert tokens(run(llm, PROMPTS, prefix="again")) == reference
    check(llm)
    if mode != "off":
        st = llm.engine.stats().host_kv
        assert st.pages_offloaded > 0 and st.pages_restored > 0 and st.bytes_to_host > 0
        assert st.preemptions_swap + st.preemptions_recompute == llm.engine.scheduler.num_preemptions
        if mode == "swap":
            assert st.preemptions_recompute == 0
        if mode == "recompute":
            assert st.preemptions_swap == 0
        if mode == "auto":
            assert st.bandwidth_bytes_per_s > 0 and st.recompute_tokens_per_s > 0


@pytest.fixture(scope="module")
def int8_reference(params):
    llm = build(params, ROOMY, kv_cache_dtype="int8")
    return {key: tokens(run(llm, PROMPTS, params_, salt, prefix=key)) for key, params_, salt in _FEATURE_RUNS}


_FEATURE_RUNS = [("salted", greedy_params(), "tenant-a"),
                 ("n2", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2), None)]


@pytest.mark.parametrize("extra", [{}, dict(speculative_method="ngram", num_speculative_tokens=3)],
                         ids=["int8_kv", "int8_kv+ngram"])
def test_swap_with_int8_pages_a_salt_n2_and_speculation_gives_the_same_tokens(params, int8_reference, extra):
    llm = build(params, kv_cache_dtype="int8", kv_offload_bytes=2**20, preemption_mode="swap", **extra)
    for key, params_, salt in _FEATURE_RUNS:
        assert tokens(run(llm, PROMPTS, params_, salt, prefix=key)) == int8_reference[key], key
    st = llm.engine.stats().host_kv
    assert st.preemptions_swap > 0 and st.pages_restored > 0
    check(llm)


def test_tensor_parallel_swap_gives_the_same_tokens(params, reference):
    llm = build(params, tensor_parallel_size=2, kv_offload_bytes=2**20, preemption_mode="swap")
    assert tokens(run(llm, PROMPTS)) == reference
    assert llm.engine.stats().host_kv.pages_restored > 0
    check(llm)


# --- engines: the prefix tier ----------------------------------------------------------------------------

LONG = [1] + list(range(10, 42))  # 33 tokens: 8 full pages and the last token
SHORT = greedy_params(max_tokens=8)


def _evict_everything(llm, salt=None, seed=7):
    """Distinct prompts through the pool until none of its pages holds what was cached before."""
    flood = ragged_prompts(V, n=6, seed=seed, max_len=30)
    run(llm, [[2] + p for p in flood], greedy_params(max_tokens=4), salt, prefix=f"flood{seed}-")


def test_an_evicted_prefix_comes_back_from_the_host_with_the_same_tokens_and_logprobs(params):
    llm = build(params, 16, kv_offload_bytes=2**20)
    sp = greedy_params(logprobs=3, max_tokens=8)
    first = run(llm, [LONG], sp, prefix="first")[0]
    _evict_everything(llm)
    st0 = llm.engine.stats()
    hits = llm.engine.block_manager.lookup_prefix(llm.engine.make_request("probe", LONG, SHORT).seqs[0])
    assert len(hits) == 8 and all(isinstance(h, HostHit) for h in hits)  # on the host only
    again = run(llm, [LONG], sp, prefix="again")[0]
    st1 = llm.engine.stats()
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    for a, b in zip(again.outputs[0].logprobs, first.outputs[0].logprobs):
        assert sorted(a) == sorted(b)
        for tid in a:
            assert abs(a[tid].logprob - b[tid].logprob) < 1e-5
    restored = st1.host_kv.pages_restored - st0.host_kv.pages_restored
    assert restored == 8 and again.num_cached_tokens == 32  # every full page of the prompt but the last token's
    assert st1.host_kv.restore_hit_tokens - st0.host_kv.restore_hit_tokens == 32
    assert st1.prefix_cache_hit_tokens - st0.prefix_cache_hit_tokens == 32  # a restore counts as a hit
    # prompt logprobs are computed, never read from a cache: the same again after another eviction
    pl = greedy_params(prompt_logprobs=2, max_tokens=2)
    p1 = run(llm, [LONG], pl, prefix="plp1")[0]
    _evict_everything(llm, seed=8)
    p2 = run(llm, [LONG], pl, prefix="plp2")[0]
    for a, b in zip(p1.prompt_logprobs[1:], p2.prompt_logprobs[1:]):
        assert {t: round(x.logprob, 5) for t, x in a.items()} == {t: round(x.logprob, 5) for t, x in b.items()}
    check(llm)


def test_another_salt_restores_nothing_from_the_host(params):
    llm = build(params, 16, kv_offload_bytes=2**20)
    run(llm, [LONG], SHORT, salt="tenant-a", prefix="a")
    _evict_everything(llm, salt="tenant-a")
    before = llm.engine.stats().host_kv.pages_restored
    attack = run(llm, [LONG], SHORT, salt="tenant-b", prefix="b")[0]  # same tokens, another tenant
    assert attack.num_cached_tokens == 0
    assert llm.engine.stats().host_kv.pages_restored == before
    unsalted = run(llm, [LONG], SHORT, prefix="u")[0]
    assert unsalted.num_cached_tokens == 0
    owner = run(llm, [LONG], SHORT, salt="tenant-a", prefix="a2")[0]
    assert owner.num_cached_tokens == 32 and llm.engine.stats().host_kv.pages_restored == before + 8
    check(llm)


def test_a_flood_of_distinct_prompts_stays_within_the_host_budget(params):
    page_bytes = kv_bytes_per_token(CFG, np.float32) * SHAPES["page_size"]
    budget = 10 * page_bytes + 100
    llm = build(params, 16, kv_offload_bytes=budget)
    tier = llm.engine.part(HostKVTier)
    assert tier.pool.nbytes <= budget and tier.pool.num_pages == 10
    for wave in range(3):
        _evict_everything(llm, seed=20 + wave)
        st = llm.engine.stats().host_kv
        assert st.used_pages <= 10 and st.used_bytes <= budget
    assert st.pages_offloaded > 10  # the pool turned over
    check(llm)


def test_an_abort_frees_the_host_pages_of_a_swapped_out_request(params):
    llm = build(params, TIGHT, kv_offload_bytes=2**20, preemption_mode="swap")
    engine, tier = llm.engine, llm.engine.part(HostKVTier)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, greedy_params())
    for _ in range(200):  # until some request waits swapped out
        engine.step()
        if tier._swapped:
            break
    assert tier._swapped, "nothing was swapped out"
    victims = {seq.request.request_id for seq, _, _ in tier._swapped.values()}
    written = {d for _, _, w in tier._swapped.values() for d in w}
    assert written, "the swapped-out request's pages were all on the host already"
    engine.step()  # the copies arrive in the pool
    for rid in victims:
        engine.abort_request(rid)
    engine.step()
    assert not tier._swapped
    assert not (written & set(tier.pool.index)), "an aborted request's swapped pages stayed in the host pool"
    run_to_completion(engine)
    check(llm)


def test_nothing_compiles_after_warm_up(params):
    from serving.core.model_runner import compilation_count

    llm = build(params, TIGHT, kv_offload_bytes=2**20, preemption_mode="auto")
    llm.engine.warm_up()
    before = compilation_count(), kv_pages.compilation_count()
    run(llm, PROMPTS)
    _evict_everything(llm)
    run(llm, PROMPTS, prefix="again")
    assert llm.engine.stats().host_kv.pages_restored > 0
    assert (compilation_count(), kv_pages.compilation_count()) == before



# --- visible: /metrics and the plan's memory table ---------------------------------------------------------

def test_metrics_show_the_host_tier(params):
    from prometheus_client.parser import text_string_to_metric_families

    from serving.api.http_metrics import ServerMetrics

    llm = build(params, 16, kv_offload_bytes=2**20, preemption_mode="swap")
    run(llm, [LONG], SHORT, prefix="a")
    _evict_everything(llm)
    run(llm, [LONG], SHORT, prefix="b")

    class _Engine:  # what ServerMetrics reads of the async engine
        def stats(self):
            return llm.engine.stats()

        def add_stats_listener(self, fn):
            pass

    body, _ = ServerMetrics(_Engine(), "m", max_model_len=512).attach().render()
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
               for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
    st = llm.engine.stats().host_kv
    assert samples[("ridgeline:host_kv_cache_pages_total", ())] == st.capacity_pages == 2**20 // st.page_bytes
    assert samples[("ridgeline:host_kv_cache_pages_used", ())] == st.used_pages > 0
    assert samples[("ridgeline:host_kv_pages_restored_total", ())] == st.pages_restored == 8
    assert samples[("ridgeline:host_kv_restore_hit_tokens_total", ())] == 32
    assert samples[("ridgeline:host_kv_bytes_moved_total", (("direction", "to_device"),))] == 8 * st.page_bytes
    assert samples[("ridgeline:host_kv_bytes_moved_total", (("direction", "to_host"),))] == st.bytes_to_host > 0
    assert samples[("ridgeline:num_preemptions_by_mode_total", (("mode", "swap"),))] == st.preemptions_swap
    assert samples[("ridgeline:host_kv_restore_latency_seconds_count", ())] >= 1
    assert samples[("ridgeline:host_kv_restore_latency_seconds_bucket", (("le", "+Inf"),))] == \
        samples[("ridgeline:host_kv_restore_latency_seconds_count", ())]


def test_the_plan_memory_table_shows_the_host_tier(capsys):
    from model.families import config_by_name
    from sharding.estimate import PlanInputs, plan
    from sharding.hardware import get_gpu
    from sharding.plan import main

    gpu = get_gpu("h100-sxm")
    mem = plan(PlanInputs(config_by_name("llama3-8b"), gpu, context_len=8192, kv_offload_bytes=100e9))["memory"]
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, dim 128, bf16
    assert mem["host_tier_tokens"] == int(100e9 // per_token)
    assert mem["host_tier_sequences"] == int(100e9 // (per_token * 8192))
    assert mem["host_tier_restore_s_per_sequence"] == pytest.approx(per_token * 8192 / gpu.pcie_bandwidth)
    assert "host_tier_bytes" not in plan(PlanInputs(config_by_name("llama3-8b"), gpu))["memory"]
    assert main(["--model", "llama3-8b", "--kv_offload_gb", "100"]) == 0
    assert "host KV tier (per host)    100.00 GB: 762,939 tokens, 93 sequences" in capsys.readouterr().out
