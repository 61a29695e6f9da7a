"""The engine on a real (tiny, random-weight) model: equivalence is the test.

Greedy output of every request must be identical whether it runs alone or
batched with others arriving at random steps, under chunked prefill at
several budgets, with preemption, and from a warm prefix cache. All engines
here share one model, page size, pool and bucket set, so the jitted step
compiles once per bucket for the whole module.
"""

import random
import re

import jax
import numpy as np
import pytest

from conftest import run_with_random_arrivals, tiny_config
from model.cache import pack_batch
from model.forward import forward_jit
from model.params import init_params
from serving import LLM, SamplingParams
from serving.core.sampling_params import InvalidParameterError
from serving.core.input_batch import StepShape
from serving.core.model_runner import _step_jit, compilation_count

CFG = tiny_config()  # vocab 97, 2 layers, hidden 64, EOS 2
PAGE = 8
MAX_LEN = 64
NUM_PAGES = 64
COMMON = dict(page_size=PAGE, max_model_len=MAX_LEN, num_pages=NUM_PAGES, min_token_bucket=8, min_context_bucket=16,
              attention_backend="reference")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(42))


def make_llm(params, budget=32, max_num_seqs=16, caching=True, **kw):
    return LLM(config=CFG, params=params, max_num_seqs=min(max_num_seqs, budget), max_num_batched_tokens=budget,
               enable_prefix_caching=caching, **{**COMMON, **kw})


def workload(n, seed, min_prompt=1, max_prompt=40, max_out=24):
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        plen = rng.randint(min_prompt, max_prompt)
        prompt = [1] + [rng.randrange(3, CFG.vocab_size) for _ in range(plen - 1)]
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, min(max_out, MAX_LEN - plen)),
                            ignore_eos=rng.random() < 0.5)
        jobs.append((f"q{i}", prompt, sp))
    return jobs


def run_with_arrivals(llm, jobs, seed, spread=30):
    """Adds each job at a random step; returns {request_id: [token ids of each sample]}."""
    outs = run_with_random_arrivals(llm.engine, jobs, seed, spread, max_steps=20_000)
    assert llm.engine.stats().kv_pages_used == 0
    return {rid: [c.token_ids for c in out.outputs] for rid, out in outs.items()}


@pytest.fixture(scope="module")
def alone(params):
    """Every job of the module's workloads, each run by itself (no batching, no prefix cache)."""
    llm = make_llm(params, caching=False)
    cache = {}

    def get(job):
        rid, prompt, sp = job
        key = (tuple(prompt), sp.max_tokens, sp.ignore_eos, sp.temperature, sp.seed, sp.n)
        if key not in cache:
            out = llm.generate([prompt], sp)[0]
            cache[key] = [c.token_ids for c in out.outputs]
        return cache[key]

    return get


def test_greedy_batched_with_random_arrivals_equals_alone(params, alone):
    jobs = workload(50, seed=0)
    llm = make_llm(params)
    got = run_with_arrivals(llm, jobs, seed=1)
    assert sum(len(t[0]) for t in got.values()) > 200  # a real amount of decoding happened
    mismatched = [rid for rid, prompt, sp in jobs if got[rid] != alone((rid, prompt, sp))]
    assert not mismatched
    # The batch really was a batch: many sequences shared steps.
    steps = llm.engine.stats_log.drain()
    assert max(s.num_seqs for s in steps) >= 8


@pytest.mark.parametrize("budget", [8, 16])
def test_chunked_prefill_at_small_budgets_equals_alone(params, alone, budget):
    jobs = workload(16, seed=2, min_prompt=20, max_prompt=44, max_out=12)
    llm = make_llm(params, budget=budget)
    got = run_with_arrivals(llm, jobs, seed=3, spread=10)
    steps = llm.engine.stats_log.drain()
    assert max(s.num_tokens for s in steps) <= budget
    assert all(got[rid] == alone((rid, p, sp)) for rid, p, sp in jobs)


def test_preemption_under_a_small_pool_equals_alone(params, alone):
    # 16 sequences of ~60 tokens want ~120 pages of 8; the pool has 64.
    jobs = [(rid, p, sp.clone(ignore_eos=True, max_tokens=MAX_LEN - len(p)))
            for rid, p, sp in workload(24, seed=4, min_prompt=24, max_prompt=36)]
    llm = make_llm(params)
    got = run_with_arrivals(llm, jobs, seed=5, spread=4)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert all(got[rid] == alone((rid, p, sp)) for rid, p, sp in jobs)
    assert stats.kv_pages_used == 0


def test_prefix_cache_warm_equals_cold(params, alone):
    rng = random.Random(6)
    system = [1] + [rng.randrange(3, 97) for _ in range(27)]  # 3.5 pages shared by every prompt
    jobs = [(f"p{i}", system + [rng.randrange(3, 97) for _ in range(rng.randint(1, 10))],
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for i in range(12)]
    llm = make_llm(params)
    cold = {rid: [c.token_ids for c in o.outputs]
            for (rid, _, _), o in zip(jobs, llm.generate([p for _, p, _ in jobs[:1]], jobs[0][2]))}
    before = llm.engine.stats()
    warm = run_with_arrivals(llm, jobs, seed=7, spread=5)
    after = llm.engine.stats()
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    assert hits >= 11 * 3 * PAGE  # every later prompt reused the system prompt's 3 full pages
    assert after.prefix_cache_queried_tokens > before.prefix_cache_queried_tokens
    assert cold["p0"] == warm["p0"]
    assert all(warm[rid] == alone((rid, p, sp)) for rid, p, sp in jobs)


def test_cache_salted_prompts_share_pages_only_with_their_salt(params, alone):
    rng = random.Random(8)
    prompt = [1] + [rng.randrange(3, 97) for _ in range(30)]  # 3 full pages + 7 tokens
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(params)
    hits = []
    for salt in ("a", "b", "a", None, None):
        before = llm.engine.stats().prefix_cache_hit_tokens
        dict_prompt = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        out = llm.generate(dict_prompt, sp)[0]
        hits.append(llm.engine.stats().prefix_cache_hit_tokens - before)
        assert [c.token_ids for c in out.outputs] == alone(("s", prompt, sp))
    assert hits == [0, 0, 3 * PAGE, 0, 3 * PAGE]
    for bad, param in (({"prompt_token_ids": prompt, "cache_salt": ""}, "cache_salt"),
                       ({"prompt_token_ids": prompt, "cache_salt": 5}, "cache_salt"),
                       ({"prompt_token_ids": prompt, "salt": "a"}, "prompt")):
        with pytest.raises(InvalidParameterError) as e:
            llm.generate(bad, sp)
        assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_seeded_sampling_same_alone_and_batched(params, alone):
    rng = random.Random(8)
    sampled = [(f"s{i}", [1] + [rng.randrange(3, 97) for _ in range(rng.randint(2, 30))],
                SamplingParams(temperature=0.9, top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.8]),
                               min_p=rng.choice([0.0, 0.05]), seed=1000 + i, max_tokens=16, ignore_eos=True))
               for i in range(10)]
    jobs = sampled + workload(20, seed=9)
    llm = make_llm(params)
    got = run_with_arrivals(llm, jobs, seed=10, spread=12)
    assert all(got[rid] == alone((rid, p, sp)) for rid, p, sp in jobs)
    # Different seeds really draw differently.
    assert len({tuple(got[rid][0]) for rid, _, _ in sampled}) == len(sampled)


def test_n_samples_share_the_prompt_pages_copy_on_write(params, alone):
    llm = make_llm(params)
    copies = []
    runner = llm.engine.runner
    original = runner.copy_pages
    runner.copy_pages = lambda c: (copies.extend(c), original(c))
    prompt = [1] + list(range(10, 30))  # 21 tokens: the last page is shared and partly full
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, n=3, max_tokens=20, ignore_eos=True))[0]
    single = alone(("x", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))[0]
    assert [c.token_ids for c in greedy.outputs] == [single] * 3
    assert copies  # the samples wrote into copies of the shared page
    sp = SamplingParams(temperature=1.0, n=3, seed=77, max_tokens=20, ignore_eos=True)
    multi = llm.generate([prompt], sp)[0]
    one = llm.generate([prompt], sp.clone(n=1))[0]
    assert multi.outputs[0].token_ids == one.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in multi.outputs}) == 3
    assert llm.engine.stats().kv_pages_used == 0


def reference_logprobs(params, tokens):
    """log_softmax of the logits at every position of `tokens`, from one plain forward pass."""
    from model.cache import init_cache

    n = len(tokens)
    pages = -(-n // PAGE)
    toks, md = pack_batch([(tokens, 0, list(range(pages)))], page_size=PAGE, num_pages=pages, num_tokens=n,
                          max_seqs=1, pages_per_seq=pages, all_logits=True)
    logits, _ = forward_jit(params, init_cache(CFG, pages, PAGE), toks, md, cfg=CFG, backend="reference")
    return np.asarray(jax.nn.log_softmax(logits, -1))


def test_logprobs_and_prompt_logprobs_match_a_plain_forward(params):
    llm = make_llm(params, budget=16)  # the 30-token prompt is prefilled in two chunks
    prompt = [1] + list(range(40, 69))
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    c = out.outputs[0]
    ref = reference_logprobs(params, prompt + c.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        tok = prompt[p]
        assert entry[tok].logprob == pytest.approx(ref[p - 1, tok], abs=1e-4)
        assert entry[tok].rank == 1 + int(np.sum(ref[p - 1] > ref[p - 1, tok]))
        assert len(entry) <= 3
    assert len(c.logprobs) == len(c.token_ids) == 6
    for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert entry[tok].rank == 1 and entry[tok].logprob == pytest.approx(row.max(), abs=1e-4)
        top = sorted(entry.values(), key=lambda l: l.rank)
        np.testing.assert_allclose([l.logprob for l in top], np.sort(row)[::-1][:3], atol=1e-4)
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_stop_token_ids_and_abort_free_everything(params):
    llm = make_llm(params)
    prompt = [1, 5, 6, 7]
    free_run = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    stop_tok = free_run.outputs[0].token_ids[4]
    first = free_run.outputs[0].token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == free_run.outputs[0].token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"a{i}", [1] + list(range(3, 30)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv_pages_used > 0
    engine.abort_request([f"a{i}" for i in range(6)])
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.kv_pages_used) == (0, 0, 0)
    assert s.finished_by_reason["abort"] == 6 and not engine.has_unfinished_requests()


def test_no_recompilation_after_warm_up(params):
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if "backend_compile" in name else None)
    llm = make_llm(params, warmup=True)
    assert llm.warmup_info["shapes"] > 0
    compiled, seen = compilation_count(), len(events)
    rng = random.Random(11)
    mix = []
    for i in range(40):  # greedy, sampled, filtered, logprobs, n > 1, long chunked prompts, stops
        plen = rng.randint(1, 50)
        prompt = [1] + [rng.randrange(3, 97) for _ in range(plen - 1)]
        mix.append((f"m{i}", prompt, SamplingParams(
            temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]),
            n=rng.choice([1, 1, 2]), seed=i, logprobs=rng.choice([None, 2]),
            prompt_logprobs=rng.choice([None, None, 1]), stop_token_ids=[rng.randrange(3, 97)],
            max_tokens=rng.randint(1, MAX_LEN - plen))))
    run_with_arrivals(llm, mix, seed=12, spread=20)
    # The smallest shapes too (warm-up compiles them first, before the cache was ever a step output).
    llm.generate([[1, 5, 6]], SamplingParams(temperature=0.0, max_tokens=2))
    assert compilation_count() == compiled
    assert len(events) == seen, "a backend compile happened after warm-up"


@pytest.mark.parametrize("backend", ["reference", "xla"])
@pytest.mark.parametrize("tokens,seqs", [(1, 1), (8, 8), (32, 8)])
def test_the_step_updates_the_donated_cache_in_place(params, backend, tokens, seqs):
    """No copy of the KV pool inside the step: a copy per layer per step made a 1024-page
    pool of the 125M shape cost ~1 s per decode step on CPU. One-token steps matter on their
    own: there the K/V write becomes a dynamic-update-slice, which a loop with a dynamic trip
    count reading the pool made XLA CPU copy."""
    runner = make_llm(params).engine.runner
    shape = StepShape(tokens, seqs, 2)
    ibuf, fbuf, _ = shape.empty(NUM_PAGES * PAGE)
    hlo = _step_jit.lower(runner.params, runner.cache, ibuf, fbuf, cfg=CFG, backend=backend,
                          shape=shape).compile().as_text()
    rows = jax.tree.leaves(runner.cache)[0].shape[0]  # NUM_PAGES, or every layer's (the scanned step's pool)
    pool = re.escape(f"f32[{rows},{PAGE},{CFG.num_kv_heads},{CFG.head_dim}]")
    assert re.search(pool, hlo)
    assert not re.search(pool + r"\{[0-9,]*\} copy\(", hlo)
    assert "input_output_alias" in hlo.split("\n", 1)[0]  # the cache is donated


def test_more_samples_than_max_num_seqs_equal_the_forked_samples(params, alone):
    """max_num_seqs = 1: n = 3 runs its samples one after another, the later ones from the prompt's cached
    pages. Greedy: each equals the request alone; seeded: each equals the same sample drawn by a fork on an
    engine with seats for all three (per-sample draws do not depend on how samples are scheduled)."""
    prompt = [1] + list(range(10, 30))  # 21 tokens: 2 full pages and a partial one
    narrow = make_llm(params, max_num_seqs=1)
    greedy = SamplingParams(temperature=0.0, n=3, max_tokens=12, ignore_eos=True)
    out = narrow.generate([prompt], greedy)[0]
    single = alone(("x", prompt, greedy.clone(n=1)))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and [c.token_ids for c in out.outputs] == [single] * 3
    assert narrow.engine.stats().prefix_cache_hit_tokens >= 2 * 2 * PAGE  # samples 1 and 2 reused 2 pages
    seeded = SamplingParams(temperature=1.0, n=3, seed=77, max_tokens=12, ignore_eos=True)
    got = [c.token_ids for c in narrow.generate([prompt], seeded)[0].outputs]
    forked = [c.token_ids for c in make_llm(params).generate([prompt], seeded)[0].outputs]
    assert got == forked and len({tuple(t) for t in got}) == 3
    assert max(s.num_seqs for s in narrow.engine.stats_log.drain()) == 1
    assert narrow.engine.stats().kv_pages_used == 0


def test_completions_route_serves_n_above_max_num_seqs():
    """The HTTP path: n = 3 on a server started with max_num_seqs = 1, streamed and not: three choices,
    indices 0..2; greedy ones equal the n = 1 answer, a seeded stream reassembles to the seeded answer."""
    import openai

    from model.tokenizer import ByteTokenizer
    from serving.server import ServerThread

    cfg = tiny_config(vocab_size=300, max_position_embeddings=256)
    llm = LLM(config=cfg, params=init_params(cfg, jax.random.key(5)), tokenizer=ByteTokenizer(300), max_num_seqs=1,
              max_num_batched_tokens=16, max_model_len=64, num_pages=16, page_size=8, min_token_bucket=16,
              min_context_bucket=64, attention_backend="reference")
    thread = ServerThread(llm, model_name="tiny-n").start()
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="tiny-n", prompt="Count the samples", max_tokens=6, extra_body={"ignore_eos": True})
        one = client.completions.create(temperature=0.0, **kw).choices[0].text
        three = client.completions.create(temperature=0.0, n=3, **kw).choices
        assert [c.index for c in three] == [0, 1, 2] and [c.text for c in three] == [one] * 3
        seeded = client.completions.create(temperature=1.0, seed=5, n=3, **kw).choices
        texts = {}
        for chunk in client.completions.create(temperature=1.0, seed=5, n=3, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        assert texts == {c.index: c.text for c in seeded}
        with pytest.raises(openai.BadRequestError) as e:  # still bounded (the matchers, masks kept per sample)
            client.completions.create(temperature=0.0, n=129, **kw)
        assert e.value.body["param"] == "n" and "128" in e.value.body["message"]
    finally:
        thread.stop()
    assert llm.engine.stats().kv_pages_used == 0
