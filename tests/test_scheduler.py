"""Scheduler and block manager driven through the engine with a fake model runner.

The fake runner really uses the paged cache: its "cache" stores token ids in
page slots, and each logit row's next token is a hash of the row's whole
context *as read back through its block table*. A wrong block table, a missed
copy-on-write, a bad prefix-cache hit or a lost page changes the output, and
the same rule applied to a plain token list (`reference_generate`) gives the
answer every request must produce. That makes a hypothesis property test of
random arrivals, lengths, samples, aborts and pool sizes fast enough to run
hundreds of cases.
"""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from conftest import run_to_completion, tiny_config
from serving.core.engine import Engine, EngineConfig
from serving.core.model_runner import PendingStep, StepResult
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig
from serving.core.block_manager import BlockManager

EOS = 2


def next_token(context, vocab: int, seed=None, sample_index=0, token_index=0, eos_every: int = 0) -> int:
    h = 1469598103934665603
    for t in context:
        h = ((h ^ int(t)) * 1099511628211) % 2**64
    if seed is not None:
        h = ((h ^ (seed * 31 + sample_index * 7 + token_index)) * 1099511628211) % 2**64
    if eos_every and h % eos_every == 0:
        return EOS
    return 3 + h % (vocab - 3)


class FakeRunner:
    def __init__(self, vocab: int, eos_every: int = 0):
        self.vocab = vocab
        self.eos_every = eos_every
        self.engine = None  # set by attach()
        self.steps = 0
        self.copies = 0

    def attach(self, engine):
        self.engine = engine
        bm = engine.block_manager
        self.page_size = bm.page_size
        self.cache = np.full(bm.num_pages * bm.page_size, -1, np.int64)
        return self

    def copy_pages(self, copies):
        ps = self.page_size
        for src, dst in copies:
            self.cache[dst * ps:(dst + 1) * ps] = self.cache[src * ps:(src + 1) * ps]
        self.copies += len(copies)

    def step_shape(self, shape):  # every bucket is "compiled": a step runs in its own
        return shape

    def warmup_stats(self):
        return None

    def dispatch(self, batch) -> PendingStep:  # runs at once; the handle only hands the ids over
        return PendingStep(self.execute(batch).ids)

    def execute(self, batch) -> StepResult:
        self.steps += 1
        v = batch.shape.split(batch.ibuf, batch.fbuf)
        n = batch.num_tokens
        slots = v["slots"][:n]
        pad = len(self.cache)
        assert (slots < pad).all(), "a live token has the padding slot"
        bm = self.engine.block_manager
        for s in np.unique(slots // self.page_size):
            assert bm.ref[s] == 1, f"write into page {s} held {bm.ref[s]} times (missed copy-on-write)"
        self.cache[slots] = v["tokens"][:n]
        cu = v["cu_q_lens"]
        ids = np.zeros(batch.shape.S, np.int32)
        for r, (seq, sample_index) in enumerate(batch.sample_rows):
            t = v["logits_indices"][r]
            i = int(np.searchsorted(cu, t, side="right") - 1)
            pos = int(v["positions"][t])
            table = v["block_tables"][i]
            p = np.arange(pos + 1)
            context = self.cache[table[p // self.page_size] * self.page_size + p % self.page_size]
            assert (context >= 0).all(), "context read an unwritten slot"
            random = v["temperature"][r] > 0
            seed = int(np.uint32(v["key_data"][r, 1])) if random else None
            ids[r] = next_token(context.tolist(), self.vocab, seed, int(v["sample_index"][r]),
                                int(v["token_index"][r]), self.eos_every)
        return StepResult(ids)


def reference_generate(prompt, params, seed, vocab, max_model_len, eos_every=0):
    """What each sample of a request must produce: [(token_ids, finish_reason)]."""
    outs = []
    for k in range(params.n):
        toks = list(prompt)
        out, reason = [], None
        while reason is None:
            tok = next_token(toks, vocab, (seed % 2**32) if params.temperature > 0 else None, k, len(out),
                             eos_every)
            toks.append(tok)
            out.append(tok)
            if tok == EOS and not params.ignore_eos:
                reason = "stop"
            elif len(out) >= params.max_tokens or len(toks) >= max_model_len:
                reason = "length"
        outs.append((out, reason))
    return outs


VOCAB = 97


def make_engine(num_pages=64, page_size=4, max_num_seqs=8, budget=16, max_model_len=64, caching=True,
                eos_every=0):
    cfg = tiny_config(vocab_size=VOCAB, max_position_embeddings=max_model_len)
    # One step at a time: the fake runs a step when it is dispatched and has no device-side feed of
    # the previous step's tokens (overlapped scheduling is tested on real runners, test_async_scheduling).
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, page_size=page_size,
                          num_pages=num_pages, max_model_len=max_model_len, enable_prefix_caching=caching,
                          async_scheduling=False)
    fake = FakeRunner(VOCAB, eos_every)
    engine = Engine(cfg, None, None, config, runner=fake)
    fake.attach(engine)
    return engine, fake


def check_against_reference(engine, out, prompt, params, eos_every=0):
    req_seed = params.seed
    want = reference_generate(prompt, params, req_seed, VOCAB, engine.max_model_len, eos_every)
    got = [(c.token_ids, c.finish_reason) for c in out.outputs]
    assert got == want


# --- the scheduler alone ----------------------------------------------------------------------

def make_seq(prompt, rid="r", n=1, max_tokens=8):
    from serving.core.sequence import Request

    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0)
    return Request(rid, None, prompt, params, 0, 0.0).seqs[0]


def scheduler(num_pages=16, page_size=4, max_num_seqs=4, budget=8, max_model_len=64):
    bm = BlockManager(num_pages, page_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), bm)


def test_long_prompt_is_chunked_by_the_budget():
    s = scheduler(budget=8)
    seq = make_seq(list(range(3, 23)))  # 20 tokens
    s.add(seq)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        (item,) = out.scheduled
        chunks.append((item.start, item.num_new_tokens, item.sample_indices))
        s.update(out, [5] * len(item.sample_indices))
    assert chunks == [(0, 8, ()), (8, 8, ()), (16, 4, (0,))]
    assert seq.token_ids[-1] == 5 and seq.num_computed_tokens == 20


def test_a_request_waiting_for_a_lora_slot_is_passed_but_not_starved():
    """One slot (max_loras=1), adapter "a" running: a request of adapter "b" waits for the slot, keeping
    its place, while base-model requests and requests of "a" behind it are admitted; once it has waited
    LORA_PASS_LIMIT steps only base-model requests pass it, "a" drains, and "b" runs next."""
    from serving.features.lora import KEY, LORA_PASS_LIMIT, Adapter, LoraAdmission

    gate = LoraAdmission(max_loras=1)
    s = Scheduler(SchedulerConfig(8, 64, 256), BlockManager(64, 4), gates=[gate])

    def add(rid, lora, max_tokens):
        seq = make_seq([3, 4, 5], rid, max_tokens=max_tokens)
        if lora is not None:  # as the LoRA part admits it
            seq.request.part_state[KEY] = Adapter(lora, b"digest")
        s.add(seq)
        return seq

    def step():
        out = s.schedule()
        s.update(out, [9] * len(out.scheduled))
        for item in out.scheduled:
            if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                s.finish(item.seq, "length")
        return {item.seq.request.request_id for item in out.scheduled}

    add("a0", "a", 1000)
    assert step() == {"a0"}
    add("b0", "b", 2)
    add("base0", None, 1)
    add("a1", "a", 1)
    assert step() == {"a0", "base0", "a1"}  # b0 keeps its place at the head, the others pass it
    assert [q.request.request_id for q in s.waiting] == ["b0"]
    for k in range(LORA_PASS_LIMIT - 1):  # requests of "a" keep coming and pass b0 for LORA_PASS_LIMIT steps
        add(f"a-{k}", "a", 1)
        assert f"a-{k}" in step()
    add("a-late", "a", 1)
    add("base1", None, 1)
    assert step() == {"a0", "base1"}  # only the base request passes now
    s.finish(next(q for q in s.running if q.request.request_id == "a0"), "abort")  # "a" drains
    assert step() == {"b0"}
    assert step() == {"b0"} and [q.request.request_id for q in s.waiting] == ["a-late"]  # "b" holds the slot
    assert step() == {"a-late"}
    assert not gate.waits or set(gate.waits) == {q.seq_id for q in s.waiting}


def test_running_sequences_are_served_before_waiting_ones():
    s = scheduler(budget=8)
    a = make_seq(list(range(3, 7)), "a")
    s.add(a)
    s.update(s.schedule(), [9])  # a: prefill done, one token sampled
    b = make_seq(list(range(3, 23)), "b")
    s.add(b)
    out = s.schedule()
    assert [(i.seq.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.num_batched_tokens == 8


def test_max_num_seqs_caps_admission_counting_samples():
    s = scheduler(max_num_seqs=3, budget=32)
    a = make_seq(list(range(3, 7)), "a", n=2)
    b = make_seq(list(range(3, 7)), "b", n=2)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [i.seq.request.request_id for i in out.scheduled] == ["a"]  # b's 2 seats do not fit in 3 - 2
    s.update(out, [7, 8])
    assert len(s.running) == 2 and [q.token_ids[-1] for q in s.running] == [7, 8]


def test_samples_beyond_max_num_seqs_run_in_groups_as_seats_free():
    """n = 5 with max_num_seqs = 2, one seat held by another request: the prompt is admitted with the one
    free seat; the other samples wait for the prompt's pages to be cached, then take seats as they free,
    reusing the prompt's full pages, and each draws from the prompt's end exactly once, in order."""
    s = scheduler(num_pages=16, page_size=4, max_num_seqs=2, budget=32)
    other = make_seq([50, 51, 52], "other", max_tokens=2)
    s.add(other)
    s.update(s.schedule(), [9])
    seq = make_seq(list(range(3, 13)), "r", n=5, max_tokens=1)  # 10 tokens: 2 full pages and a partial one
    req = seq.request
    s.add(seq)
    draws = []  # (sample index, prompt tokens computed in that step) of every draw at the prompt's end

    def step():
        out = s.schedule()
        assert sum(i.seq.num_seats for i in out.scheduled) <= 2 and s.num_seats_running <= 2
        for item in out.scheduled:
            if item.seq.request is req and item.sample_indices:
                draws.extend((k, item.num_new_tokens) for k in item.sample_indices)
        new = s.update(out, [7] * sum(len(i.sample_indices) for i in out.scheduled))
        for q, _, _ in new:  # everything stops after its first token but `other`'s second
            if q.num_output_tokens >= q.params.max_tokens:
                s.finish(q, "length")
        s.bm.check_invariants([q.seq_id for q in s.running + list(s.waiting)])
        return out

    out = s.schedule()  # one seat free: the prompt goes with sample 0 alone
    (item,) = [i for i in out.scheduled if i.seq.request is req]
    assert (item.num_new_tokens, item.sample_indices, seq.num_seats) == (10, (0,), 1)
    assert [(q.sample_index, q.num_seats) for q in req.held] == [(1, 4)] and not s.waiting
    s.update(out, [7, 7])
    assert not req.held and [(q.sample_index, q.num_seats) for q in s.waiting] == [(1, 4)]  # the prompt is cached
    draws.append((0, 10))
    for q in list(s.running):
        s.finish(q, "length")
    for _ in range(10):
        if req.is_finished:
            break
        step()
    assert req.is_finished and not s.has_unfinished()
    assert [k for k, _ in draws] == [0, 1, 2, 3, 4]
    assert draws[0][1] == 10 and all(n == 2 for _, n in draws[1:])  # the later groups hit the 2 full pages
    assert sorted(q.sample_index for q in req.seqs) == [0, 1, 2, 3, 4]
    assert all(q.finish_reason == "length" and q.num_output_tokens == 1 for q in req.seqs)
    assert s.bm.num_free_blocks == 16
    s.bm.check_invariants([])


def test_preemption_takes_the_most_recently_admitted():
    s = scheduler(num_pages=4, page_size=4, budget=16)
    a = make_seq(list(range(3, 10)), "a")  # 7 tokens: 2 pages
    b = make_seq(list(range(10, 17)), "b")  # 2 pages
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [1, 1])
    assert s.bm.num_free_blocks == 0
    out = s.schedule()  # both now write position 7 (still page 2): fits
    s.update(out, [1, 1])
    out = s.schedule()  # position 8 needs a third page each: b is preempted for a
    assert out.preempted == [b] and s.num_preemptions == 1
    assert [i.seq for i in out.scheduled] == [a]
    assert s.waiting[0] is b and b.num_computed_tokens == 0 and b.num_tokens == 9
    s.bm.check_invariants([a.seq_id])


def test_a_request_that_can_never_fit_errors():
    s = scheduler(num_pages=2, page_size=4, budget=16, max_model_len=64)
    seq = make_seq(list(range(3, 15)))  # 12 tokens, 3 pages > 2
    s.add(seq)
    out = s.schedule()
    assert out.errored == [seq] and not out.scheduled and not s.has_unfinished()


def test_engine_rejects_what_the_pool_could_never_hold():
    from serving.core.engine import ContextLengthError

    engine, _ = make_engine(num_pages=4, page_size=4, max_model_len=16)
    with pytest.raises(ContextLengthError) as e:
        engine.add_request("x", list(range(3, 13)), SamplingParams(max_tokens=8))
    assert e.value.param == "max_tokens" and "16" in str(e.value)
    with pytest.raises(ValueError, match="max_model_len=64 needs 16 pages"):
        make_engine(num_pages=4, page_size=4, max_model_len=64)


# --- the engine with the fake runner ----------------------------------------------------------

def test_fake_engine_matches_reference_with_prefix_sharing_and_samples():
    engine, fake = make_engine(num_pages=40, page_size=4, budget=16)
    shared = list(range(3, 15))
    jobs = {
        "g1": (shared + [20, 21], SamplingParams(temperature=0, max_tokens=9, seed=0)),
        "g2": (shared + [22], SamplingParams(temperature=0, max_tokens=7, seed=0)),
        "n3": (shared + [23, 24, 25], SamplingParams(temperature=1.0, n=3, max_tokens=10, seed=11)),
    }
    for rid, (p, sp) in jobs.items():
        engine.add_request(rid, p, sp)
    outs = run_to_completion(engine)
    for rid, (p, sp) in jobs.items():
        check_against_reference(engine, outs[rid], p, sp)
    assert fake.copies > 0  # the three samples copied their shared partial page
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert engine.block_manager.num_free_blocks == 40
    engine.block_manager.check_invariants([])


@pytest.mark.parametrize("stream", [False, True])
def test_fake_engine_runs_more_samples_than_max_num_seqs(stream):
    """n = 5 greedy and n = 4 seeded, max_num_seqs = 2, next to a plain request: every sample gets its
    reference output (greedy: the single-sample output; seeded: its own per-sample draws), one
    `RequestOutput` with the completions in index order, never more than 2 sequences a step, and the
    later samples reuse the prompt's full pages. Streaming outputs grow monotonically to the same result."""
    engine, fake = make_engine(num_pages=24, page_size=4, max_num_seqs=2, budget=16)
    prompt = list(range(3, 17))  # 14 tokens: 3 full pages
    jobs = {"greedy": (prompt, SamplingParams(temperature=0, n=5, max_tokens=6, ignore_eos=True)),
            "seeded": (prompt + [40], SamplingParams(temperature=1.0, n=4, max_tokens=5, seed=3, ignore_eos=True)),
            "plain": ([60, 61, 62], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))}
    for rid, (p, sp) in jobs.items():
        engine.add_request(rid, p, sp, stream=stream)
    outs, seen = {}, {rid: {} for rid in jobs}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            assert stream or o.finished
            for c in o.outputs:  # a sample's tokens only ever grow
                assert c.token_ids[:len(seen[o.request_id].get(c.index, []))] == seen[o.request_id].get(c.index, [])
                seen[o.request_id][c.index] = list(c.token_ids)
            if o.finished:
                outs[o.request_id] = o
        assert len(engine.scheduler.running) <= 2
    assert set(outs) == set(jobs)
    for rid, (p, sp) in jobs.items():
        assert [c.index for c in outs[rid].outputs] == list(range(sp.n))
        check_against_reference(engine, outs[rid], p, sp)
    single = reference_generate(prompt, jobs["greedy"][1].clone(n=1), 0, VOCAB, engine.max_model_len)
    assert [c.token_ids for c in outs["greedy"].outputs] == [single[0][0]] * 5
    assert len({tuple(c.token_ids) for c in outs["seeded"].outputs}) == 4
    assert max(s.num_seqs for s in engine.stats_log.drain()) <= 2
    assert engine.stats().prefix_cache_hit_tokens >= 3 * 4 * 2  # later groups of both requests hit 3 pages
    assert engine.block_manager.num_free_blocks == 24
    engine.block_manager.check_invariants([])


def test_abort_of_a_request_with_held_samples_frees_every_page():
    """n = 6 over max_num_seqs = 2, aborted at each point of its run (prompt chunked, samples held, waiting,
    running): every page comes back, no sequence of it is left queued, and the output says abort."""
    phases = set()
    for abort_at in range(1, 12):
        engine, _ = make_engine(num_pages=24, page_size=4, max_num_seqs=2, budget=8)
        engine.add_request("r", list(range(3, 23)), SamplingParams(temperature=1.0, n=6, max_tokens=4, seed=1))
        req = engine.requests["r"]
        for _ in range(abort_at):
            engine.step()
        finished = req.is_finished
        phases.add("held" if req.held else "queued" if engine.scheduler.waiting else
                   "finished" if finished else "running")
        engine.abort_request("r")
        assert req.is_finished and not engine.has_unfinished_requests()
        assert not engine.scheduler.waiting and not engine.scheduler.running
        assert all(q.is_finished for q in req.seqs) and (finished or "abort" in {q.finish_reason for q in req.seqs})
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_pages and not bm.tables
        bm.check_invariants([])
        assert engine.step() == []  # nothing of it runs again
    assert {"held", "queued", "running"} <= phases


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    num_requests=st.integers(1, 14),
    page_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 6),
    budget_extra=st.integers(0, 24),
    pool_slack=st.integers(0, 40),
    caching=st.booleans(),
)
def test_property_every_request_finishes_and_no_page_leaks(seed, num_requests, page_size, max_num_seqs,
                                                           budget_extra, pool_slack, caching):
    rng = random.Random(seed)
    max_model_len = 32
    min_pages = -(-max_model_len // page_size)
    num_pages = min_pages + pool_slack // page_size
    engine, fake = make_engine(num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                               budget=max_num_seqs + budget_extra, max_model_len=max_model_len, caching=caching,
                               eos_every=13)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    jobs, arrivals, aborts = {}, {}, {}
    for i in range(num_requests):
        prompt = rng.choice(prefixes)[:rng.randint(1, 12)] + [rng.randrange(3, VOCAB)
                                                               for _ in range(rng.randint(0, 14))]
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        n = rng.randint(1, 3)  # beyond max_num_seqs too: the samples run as seats free
        sp = SamplingParams(n=n, temperature=rng.choice([0.0, 1.0]), max_tokens=max_tokens,
                            ignore_eos=rng.random() < 0.5, seed=rng.randrange(2**31))
        rid = f"r{i}"
        jobs[rid] = (prompt, sp)
        arrivals.setdefault(rng.randint(0, 20), []).append(rid)
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(0, 30), []).append(rid)
    outs, aborted = {}, set()
    step = 0
    while step < 5000 and (engine.has_unfinished_requests() or any(k >= step for k in arrivals)):
        for rid in arrivals.get(step, []):
            engine.add_request(rid, *jobs[rid])
        for rid in aborts.get(step, []):
            if rid in engine.requests:
                engine.abort_request(rid)
                aborted.add(rid)
        for o in engine.step():
            assert o.finished
            outs[o.request_id] = o
        live = [s.seq_id for s in engine.scheduler.running] + [s.seq_id for s in engine.scheduler.waiting]
        engine.block_manager.check_invariants(live)
        for s in engine.scheduler.running:  # every computed token has its page
            assert len(engine.block_manager.table(s)) * page_size >= s.num_computed_tokens
        step += 1
    assert not engine.has_unfinished_requests(), "engine did not drain"
    assert set(outs) | aborted == set(jobs) and not set(outs) & aborted
    for rid, out in outs.items():
        prompt, sp = jobs[rid]
        check_against_reference(engine, out, prompt, sp, eos_every=13)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_pages and not bm.tables
    bm.check_invariants([])
    st_ = engine.stats()
    assert st_.num_running == 0 and st_.num_waiting == 0 and st_.kv_pages_used == 0
    event(f"preempted: {st_.num_preemptions > 0}")
    event(f"copy-on-write: {fake.copies > 0}")
    event(f"prefix hits: {st_.prefix_cache_hit_tokens > 0}")
    event(f"more samples than seats: {any(sp.n > max_num_seqs for _, sp in jobs.values())}")
