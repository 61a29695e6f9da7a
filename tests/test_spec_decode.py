"""Speculative decoding through the engine: greedy output is unchanged, pages are accounted for,
nothing compiles after warm-up, and options are checked.

Greedy equivalence is the test: for every request of a mixed batch (random
arrivals, chunked prefill, preemption), output with speculation, with either
proposer and several k, must be token-for-token the output without it. The
distribution tests for sampled output live in test_spec_decode_sampling.py.
"""

import random

import jax
import numpy as np
import pytest

from conftest import run_with_random_arrivals, tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
from serving.spec_decode import SpecDecoder
from serving.spec_decode import compilation_count
from serving.spec_decode.ngram import NgramProposer

CFG = tiny_config()  # vocab 97, 2 layers, hidden 64, EOS 2
PAGE = 8
MAX_LEN = 64
# One pool and bucket set for every engine here (4 step shapes), so compilations are shared. The pool
# of 28 pages is smaller than 16 running sequences of up to 64 tokens want: preemption happens.
COMMON = dict(page_size=PAGE, max_model_len=MAX_LEN, num_pages=28, max_num_seqs=16, min_token_bucket=16,
              min_context_bucket=32, attention_backend="reference")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(42))


@pytest.fixture(scope="module")
def draft(params):
    """A draft that agrees with the target often but not always: the target's weights, perturbed."""
    noisy = jax.tree.map(lambda w: w + 0.3 * w.std() * jax.random.normal(jax.random.key(3), w.shape, w.dtype),
                         params)
    return CFG, noisy


def make_llm(params, **kw):
    return LLM(config=CFG, params=params, max_num_batched_tokens=32, **{**COMMON, **kw})


def workload(n, seed, min_prompt=2, max_prompt=40, max_out=30):
    """Greedy jobs; half of the prompts repeat a short pattern (prompt lookup finds drafts there)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        plen = rng.randint(min_prompt, max_prompt)
        if i % 2:
            pattern = [rng.randrange(3, CFG.vocab_size) for _ in range(rng.randint(2, 6))]
            body = (pattern * plen)[:plen - 1]
        else:
            body = [rng.randrange(3, CFG.vocab_size) for _ in range(plen - 1)]
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, min(max_out, MAX_LEN - plen)),
                            ignore_eos=rng.random() < 0.7, logprobs=2 if i % 5 == 0 else None)
        jobs.append((f"q{i}", [1] + body, sp))
    return jobs


def run_with_arrivals(llm, jobs, seed, spread=20):
    """Adds each job at a random step; returns {request_id: CompletionOutput of sample 0}."""
    outs = run_with_random_arrivals(llm.engine, jobs, seed, spread, max_steps=10_000)
    return {rid: out.outputs[0] for rid, out in outs.items()}


def assert_idle_and_clean(llm):
    eng = llm.engine
    assert eng.stats().kv_pages_used == 0
    eng.block_manager.check_invariants(live_seq_ids=())
    draft_bm = getattr(eng.part(SpecDecoder).proposer, "bm", None)
    if draft_bm is not None:
        assert draft_bm.num_used_blocks == 0
        draft_bm.check_invariants(live_seq_ids=())


def assert_same(got, want, jobs):
    bad = [rid for rid, _, _ in jobs if got[rid].token_ids != want[rid].token_ids]
    assert not bad, f"{len(bad)} requests differ, e.g. {bad[0]}: {got[bad[0]].token_ids} vs {want[bad[0]].token_ids}"
    for rid, _, sp in jobs:
        if sp.logprobs is not None:
            a = [lp[t].logprob for lp, t in zip(got[rid].logprobs, got[rid].token_ids)]
            b = [lp[t].logprob for lp, t in zip(want[rid].logprobs, want[rid].token_ids)]
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


JOBS = workload(30, seed=0)


@pytest.fixture(scope="module")
def baseline(params):
    """The workload's outputs without speculation."""
    return run_with_arrivals(make_llm(params), JOBS, 100)


# (draft, k=2) runs in the no-recompilation and seeded-sampling tests below; k=4 here truncates drafts more.
@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 4), ("draft", 4)])
def test_greedy_output_unchanged_for_every_request_of_a_mixed_batch(params, draft, baseline, method, k):
    """Random arrivals, prompts chunked by the 32-token budget (which also truncates drafts),
    preemption under the small pool: every request's tokens (and logprobs) as without speculation."""
    llm = make_llm(params, speculative_method=method, num_speculative_tokens=k, speculative_draft=draft)
    got = run_with_arrivals(llm, JOBS, 100)
    assert_same(got, baseline, JOBS)
    stats = llm.engine.stats()
    st = stats.spec_decode
    # Speculation really happened, and drafts were both accepted and rejected.
    assert st.num_drafts > 20 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts
    assert stats.num_preemptions > 0
    steps = llm.engine.stats_log.drain()
    assert max(s.num_seqs for s in steps) >= 6 and max(s.num_tokens for s in steps) <= 32
    assert any(s.num_prompt_tokens and s.num_tokens > s.num_prompt_tokens for s in steps)  # prefill beside decodes
    assert_idle_and_clean(llm)


def test_rejected_tokens_pages_are_released(params):
    """A verify step allocates pages for k + 1 tokens; after rejection the sequence keeps only
    the pages of its accepted tokens."""
    llm = make_llm(params, speculative_method="ngram", num_speculative_tokens=8)
    eng = llm.engine
    prompt = [1] + [5, 6, 7, 8, 9, 10, 11, 12] * 3  # lookup drafts the pattern; a random model rarely follows it
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    seen_rollback = False
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            table = eng.block_manager.tables[seq.seq_id]
            assert len(table) == -(-seq.num_computed_tokens // PAGE)
        st = eng.part(SpecDecoder).stats
        seen_rollback |= st.num_accepted_tokens < st.num_draft_tokens
        eng.block_manager.check_invariants()
    assert seen_rollback
    assert_idle_and_clean(llm)


def test_stop_inside_accepted_drafts_drops_the_rest(params):
    """A stop token or max_tokens reached in the middle of accepted drafts ends the output there."""
    plain = make_llm(params)
    spec = make_llm(params, speculative_method="draft", num_speculative_tokens=4, speculative_draft=(CFG, params))
    prompt = [1, 40, 41, 42]
    full = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    toks = full.outputs[0].token_ids
    stop_tok = toks[6]
    for sp in (SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok])):
        a = plain.generate([prompt], sp)[0].outputs[0]
        b = spec.generate([prompt], sp)[0].outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    # The draft is the target itself: every draft is accepted, so those stops fell inside a verified run.
    st = spec.engine.stats().spec_decode
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert_idle_and_clean(spec)


@pytest.mark.parametrize("method,k", [("ngram", 3), ("draft", 2)])
def test_no_recompilation_after_warm_up(params, draft, method, k):
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if "backend_compile" in name else None)
    llm = make_llm(params, speculative_method=method, num_speculative_tokens=k, speculative_draft=draft,
                   warmup=True)
    assert llm.warmup_info["shapes"] > 0
    compiled, seen = compilation_count(), len(events)
    rng = random.Random(11)
    mix = []
    for i, (rid, prompt, sp) in enumerate(workload(20, seed=2)):  # greedy, sampled, filtered, logprobs, n > 1
        mix.append((rid, prompt, sp.clone(
            temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]),
            n=rng.choice([1, 1, 2]), seed=i, prompt_logprobs=rng.choice([None, None, 1]))))
    got = run_with_arrivals(llm, mix, seed=12)
    llm.generate([[1, 5, 6]], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(got) == len(mix) and llm.engine.stats().spec_decode.num_drafts > 0
    assert compilation_count() == compiled
    assert len(events) == seen, "a backend compile happened after warm-up"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_same_alone_and_batched(params, draft, method):
    """Per-request keys: a seeded request's sampled tokens do not depend on what runs beside it."""
    kw = dict(speculative_method=method, num_speculative_tokens=2, speculative_draft=draft)
    prompt = [1] + [7, 8, 9] * 5
    sp = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True)
    alone = make_llm(params, **kw).generate([prompt], sp)[0].outputs[0].token_ids
    llm = make_llm(params, **kw)
    others = [[1] + [random.Random(i).randrange(3, 97) for _ in range(10 + i)] for i in range(6)]
    outs = llm.generate(others[:3] + [prompt] + others[3:],
                        [SamplingParams(temperature=0.9, seed=i, max_tokens=20) for i in range(3)] + [sp]
                        + [SamplingParams(temperature=0.0, max_tokens=15) for _ in range(3)])
    assert outs[3].outputs[0].token_ids == alone
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_ngram_lookup():
    prop = NgramProposer(3, max_n=3, min_n=2)
    assert prop.lookup([1, 2, 3, 4, 5, 9, 9, 2, 3], 3) == [4, 5, 9]  # "2 3" seen before, followed by 4 5 9
    assert prop.lookup([1, 2, 3, 7, 2, 3, 8, 9, 2, 3], 2) == [8, 9]  # the most recent occurrence
    assert prop.lookup([4, 1, 2, 3, 5, 1, 2, 3], 2) == [5, 1]  # the longest suffix wins
    assert prop.lookup([1, 2, 3, 4], 3) == []
    assert prop.lookup([5, 5, 5], 4) == [5]  # only what follows (never the suffix itself)


def test_options_are_checked(params, draft):
    with pytest.raises(ValueError, match="speculative_method"):
        make_llm(params, speculative_method="medusa", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(params, speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(params, speculative_method="draft", num_speculative_tokens=2,
                 speculative_draft=(tiny_config(vocab_size=50), init_params(tiny_config(vocab_size=50),
                                                                          jax.random.key(0))))
    with pytest.raises(FileNotFoundError, match="draft model"):
        make_llm(params, speculative_method="draft", num_speculative_tokens=2, speculative_model="/nonexistent")
    off = make_llm(params)
    assert off.engine.part(SpecDecoder) is None and off.engine.stats().spec_decode is None


def test_spec_metrics_in_stats_and_prometheus(params):
    from test_server_units import _FakeEngine, _samples
    from serving.api.http_metrics import ServerMetrics

    llm = make_llm(params, speculative_method="ngram", num_speculative_tokens=3)
    llm.generate([[1] + [5, 6, 7] * 6], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    st = llm.engine.stats().spec_decode
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts
    assert st.acceptance_rate == st.num_accepted_tokens / st.num_draft_tokens
    assert st.mean_tokens_per_pass == st.num_emitted_tokens / st.num_drafts
    assert sum(st.accepted_per_position) == st.num_accepted_tokens
    fake = _FakeEngine()
    fake.snapshot.spec_decode = st
    s = _samples(ServerMetrics(fake, "m"))
    assert s[("vllm:spec_decode_num_drafts_total", ())] == st.num_drafts
    assert s[("vllm:spec_decode_num_draft_tokens_total", ())] == st.num_draft_tokens
    assert s[("vllm:spec_decode_num_accepted_tokens_total", ())] == st.num_accepted_tokens
    assert s[("ridgeline:spec_decode_draft_acceptance_rate", ())] == pytest.approx(st.acceptance_rate)
    assert s[("ridgeline:spec_decode_mean_tokens_per_pass", ())] == pytest.approx(st.mean_tokens_per_pass)
    assert s[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == \
        st.accepted_per_position[0]
    fake.snapshot.spec_decode = None  # speculation off: no spec series
    assert not [k for k in _samples(ServerMetrics(fake, "m")) if "spec_decode" in k[0]]
