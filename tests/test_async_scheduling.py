"""Overlapped scheduling: step t+1 is dispatched before step t's results are read.

The test is equivalence with one-step-at-a-time scheduling: identical tokens,
logprobs and finish reasons on a workload that chunks, preempts, shares
prefixes, forks `n` samples, samples with seeds and stops on tokens, with
requests arriving and aborting between steps. Other tests check that the
overlap really happens (the order of device calls and reads, placeholder
tokens fed on the device) and that it wastes no step on a request that its
length limit ends.
"""

import random

import jax
import numpy as np
import pytest

from conftest import tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
from serving.core.model_runner import PendingStep, feed_tokens

CFG = tiny_config()
PAGE = 8
MAX_LEN = 64
COMMON = dict(page_size=PAGE, max_model_len=MAX_LEN, min_token_bucket=8, min_context_bucket=16,
              attention_backend="reference")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(42))


def make_llm(params, overlap, budget=32, max_num_seqs=16, num_pages=64, **kw):
    return LLM(config=CFG, params=params, max_num_seqs=min(max_num_seqs, budget), max_num_batched_tokens=budget,
               num_pages=num_pages, async_scheduling=overlap, **{**COMMON, **kw})


def mixed_jobs(seed, stop_tokens=()):
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, 97) for _ in range(19)]  # shared by a third of the prompts
    jobs = []
    for i in range(18):
        body = [rng.randrange(3, 97) for _ in range(rng.randint(2, 30))]
        prompt = system + body if i % 3 == 0 else [1] + body
        kind = i % 6
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(4, min(24, MAX_LEN - len(prompt))),
                            ignore_eos=rng.random() < 0.5)
        if kind == 1:
            sp = sp.clone(temperature=0.9, top_k=20, seed=100 + i, logprobs=2)
        elif kind == 2:
            sp = sp.clone(n=2, temperature=1.0, seed=200 + i)
        elif kind == 3:
            sp = sp.clone(stop_token_ids=list(stop_tokens), ignore_eos=True)
        elif kind == 4:
            sp = sp.clone(prompt_logprobs=1, logprobs=1)
        jobs.append((f"j{i}", prompt, sp))
    return jobs


def run(llm, jobs, seed, abort=()):
    """Adds jobs at random steps, aborts `abort` ids a few steps after they arrive; returns
    {request id: [(token ids, logprobs, finish reason) per sample], prompt logprobs}."""
    rng = random.Random(seed)
    arrivals, aborts = {}, {}
    for job in jobs:
        step = rng.randint(0, 12)
        arrivals.setdefault(step, []).append(job)
        if job[0] in abort:
            aborts.setdefault(step + 3, []).append(job[0])
    engine = llm.engine
    done, step = {}, 0
    while len(done) < len(jobs):
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(rid, prompt, sp)
        engine.abort_request(aborts.get(step, []))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = ([(c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs],
                                        out.prompt_logprobs)
        for rid in aborts.get(step, []):
            done.setdefault(rid, "aborted")
        step += 1
        assert step < 5_000
    engine.step()  # processes a step still in flight, if any
    assert engine.stats().kv_pages_used == 0 and not engine.scheduler.has_unfinished()
    return done


def tokens_of(results):
    return {rid: v if v == "aborted" else [(toks, reason) for toks, _, reason in v[0]] for rid, v in results.items()}


def assert_logprobs_close(got, want):
    def flat(results):
        out = []
        for rid in sorted(results):
            v = results[rid]
            if v == "aborted":
                continue
            entries = [e for _, lps, _ in v[0] for e in (lps or ())] + [e for e in (v[1] or ()) if e]
            out += [(rid, tok, lp.rank, lp.logprob) for e in entries for tok, lp in sorted(e.items())]
        return out

    g, w = flat(got), flat(want)
    assert len(w) > 100 and [x[:3] for x in g] == [x[:3] for x in w]
    np.testing.assert_allclose([x[3] for x in g], [x[3] for x in w], rtol=0, atol=1e-5)


def test_feed_tokens_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 32).astype(np.int32)
    feed = rng.integers(0, 1000, 16).astype(np.int32)
    rows = np.where(rng.random(32) < 0.4, rng.integers(0, 16, 32), -1).astype(np.int32)
    want = [feed[r] if r >= 0 else t for t, r in zip(tokens, rows)]
    np.testing.assert_array_equal(np.asarray(feed_tokens(tokens, rows, feed)), want)


@pytest.mark.parametrize("num_pages", [64, 24])  # 24 pages: sequences are preempted
def test_overlapped_equals_one_step_at_a_time(params, num_pages):
    free = make_llm(params, overlap=False).generate([[1, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=12,
                                                                                    ignore_eos=True))
    stop_tokens = free[0].outputs[0].token_ids[3:5]  # tokens this model really emits
    jobs = mixed_jobs(seed=num_pages, stop_tokens=stop_tokens)
    aborted = {jobs[5][0], jobs[10][0]}
    results, stats = {}, {}
    for overlap in (False, True):
        llm = make_llm(params, overlap, num_pages=num_pages)
        results[overlap] = run(llm, jobs, seed=1, abort=aborted)
        stats[overlap] = llm.engine.stats()
    assert tokens_of(results[True]) == tokens_of(results[False])
    # Logprobs too, to fp32 tolerance: the two modes batch sequences differently.
    assert_logprobs_close(results[True], results[False])
    reasons = [r for v in results[False].values() if v != "aborted" for (_, _, r) in v[0]]
    assert {"stop", "length"} <= set(reasons)
    if num_pages == 24:
        assert stats[True].num_preemptions > 0 and stats[False].num_preemptions > 0
    assert stats[True].prefix_cache_hit_tokens > 0


def test_the_next_step_is_dispatched_before_the_last_is_read(params, monkeypatch):
    events, index = [], {}
    llm = make_llm(params, overlap=True)
    runner = llm.engine.runner
    dispatch = runner.dispatch
    result = PendingStep.result

    def logged_dispatch(batch):
        n = sum(e[0] == "dispatch" for e in events)
        fed = int((batch.shape.split(batch.ibuf, batch.fbuf)["feed_rows"] >= 0).sum())
        events.append(("dispatch", n, fed))
        pending = dispatch(batch)
        index[id(pending)] = n
        return pending

    def logged_result(self):
        events.append(("result", index[id(self)]))
        return result(self)

    monkeypatch.setattr(runner, "dispatch", logged_dispatch)
    monkeypatch.setattr(PendingStep, "result", logged_result)
    prompts = [[1] + list(range(3 + i, 10 + i)) for i in range(4)]  # one 32-token prefill step
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 4
    order = [e[:2] for e in events]
    # Every step after the first is dispatched before the one before it is read.
    assert order[:3] == [("dispatch", 0), ("dispatch", 1), ("result", 0)]
    for k in range(1, 9):
        assert order.index(("dispatch", k + 1)) < order.index(("result", k))
    # Decodes take their last token from the previous step's samples, on the device.
    fed = [e[2] for e in events if e[0] == "dispatch"]
    assert fed[0] == 0 and all(f == 4 for f in fed[1:10])


def test_length_limits_waste_no_step(params):
    """A request whose last token by length is in flight is not scheduled again: both
    modes compute exactly the same tokens when nothing stops early."""
    rng = random.Random(3)
    jobs = [(f"l{i}", [1] + [rng.randrange(3, 97) for _ in range(rng.randint(3, 25))],
             SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True)) for i in range(10)]
    computed = {}
    for overlap in (False, True):
        llm = make_llm(params, overlap)
        out = run(llm, jobs, seed=4)
        computed[overlap] = sum(s.num_tokens for s in llm.engine.stats_log.drain())
        assert all(len(v[0][0][0]) == sp.max_tokens for (rid, _, sp) in jobs for v in [out[rid]])
    assert computed[True] == computed[False]


def test_a_stop_in_flight_costs_one_discarded_token(params):
    llm = make_llm(params, overlap=True)
    prompt = [1, 5, 6, 7]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    stop = free[4]
    llm.engine.stats_log.drain()
    out = llm.generate([prompt], greedy.clone(stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == free[:free.index(stop) + 1]
    llm.engine.step()  # the step dispatched after the stop, now processed and dropped
    steps = llm.engine.stats_log.drain()
    assert sum(s.num_generation_tokens for s in steps) == free.index(stop) + 1
    assert sum(s.num_tokens for s in steps) == len(prompt) + free.index(stop) + 1
    assert llm.engine.stats().kv_pages_used == 0
