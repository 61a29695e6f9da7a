"""Priority scheduling (`scheduling_policy="priority"`, vLLM's convention: a lower priority runs first).

The scheduler alone (queue order, preemption for a higher priority, FCFS when
all priorities are equal), the engine over the page-checking fake runner of
test_scheduler (every request still produces exactly its reference output
under random priorities, samples, prefix sharing and a pool small enough to
preempt), and the real engine: greedy output is the same whatever the
priorities, with n = 2, preemption, prefix hits and speculative decoding.
"""

import random

import pytest

from conftest import tiny_config
from serving.core.block_manager import BlockManager
from serving.core.engine import Engine, EngineConfig
from serving.core.sampling_params import InvalidParameterError, SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig
from serving.core.sequence import Request
from test_scheduler import VOCAB, FakeRunner, check_against_reference


def make_seq(prompt, rid, priority=0, arrival=0.0, n=1, max_tokens=8):
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0)
    return Request(rid, None, prompt, params, 0, arrival, priority=priority).seqs[0]


def scheduler(policy="priority", num_pages=16, page_size=4, max_num_seqs=4, budget=8, max_model_len=64):
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, policy=policy),
                     BlockManager(num_pages, page_size))


def ids(items):
    return [i.seq.request.request_id for i in items]


# --- the scheduler alone ----------------------------------------------------------------------


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = scheduler(max_num_seqs=1, budget=64)
    for rid, prio, t in [("late-low", 5, 0.0), ("b", 0, 2.0), ("a", 0, 1.0), ("urgent", -3, 3.0)]:
        s.add(make_seq([3, 4, 5], rid, prio, t, max_tokens=1))
    order = []
    while s.has_unfinished():
        out = s.schedule()
        order += ids(out.scheduled)
        s.update(out, [9] * len(out.scheduled))
        for item in out.scheduled:
            s.finish(item.seq, "length")
    assert order == ["urgent", "a", "b", "late-low"]


def test_fcfs_refuses_nothing_but_ignores_no_order():
    s = scheduler("fcfs", max_num_seqs=1, budget=64)
    for rid in ("x", "y", "z"):
        s.add(make_seq([3, 4], rid, 0, 0.0, max_tokens=1))
    assert ids(s.schedule().scheduled) == ["x"]
    with pytest.raises(ValueError, match="scheduling policy"):
        SchedulerConfig(4, 8, 64, policy="lifo")


def test_a_full_pool_preempts_the_lowest_priority_for_a_higher_one():
    s = scheduler(num_pages=4, page_size=4, budget=32)
    low = make_seq(list(range(3, 10)), "low", priority=5)  # 7 tokens: 2 pages
    mid = make_seq(list(range(10, 17)), "mid", priority=1)  # 2 pages
    s.add(low)
    s.add(mid)
    s.update(s.schedule(), [1, 1])
    assert s.bm.num_free_blocks == 0
    high = make_seq(list(range(20, 27)), "high", priority=0, arrival=9.0)
    s.add(high)
    out = s.schedule()
    # `high` would find no pages: `low` (the lowest priority) makes room before the step is planned.
    assert ids(out.scheduled) == ["mid", "high"]
    assert [q.request.request_id for q in out.preempted] == ["low"]
    assert low in s.waiting and high in s.running and mid in s.running


def test_no_preemption_for_an_equal_or_lower_priority():
    s = scheduler(num_pages=4, page_size=4, budget=32)
    a = make_seq(list(range(3, 10)), "a", priority=1)
    b = make_seq(list(range(10, 17)), "b", priority=1)
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [1, 1])
    c = make_seq(list(range(20, 27)), "c", priority=1, arrival=9.0)
    s.add(c)
    out = s.schedule()
    assert not out.preempted and "c" not in ids(out.scheduled)


def test_seats_are_taken_back_for_a_higher_priority_with_samples():
    s = scheduler(num_pages=64, max_num_seqs=3, budget=64)
    low = make_seq([3, 4, 5], "low", priority=2, n=2)
    s.add(low)
    s.update(s.schedule(), [7, 8])  # forked: two running samples, two seats
    assert len(s.running) == 2
    high = make_seq([5, 6], "high", priority=0, n=2, arrival=1.0)
    s.add(high)
    out = s.schedule()
    # Only 1 of 3 seats is free: one sample of `low` goes back to the queue for `high`'s two.
    assert ids(out.scheduled)[-1] == "high" and len(out.preempted) == 1
    assert out.preempted[0].request is low.request


def test_samples_beyond_the_seats_keep_their_request_priority():
    """max_num_seqs = 2: `high` (n = 3) takes both seats from `low`'s samples; its third sample, split off,
    queues at `high`'s place, ahead of `low`'s preempted samples, and runs before them."""
    s = scheduler(num_pages=64, max_num_seqs=2, budget=64)
    low = make_seq([3, 4, 5], "low", priority=2, n=2)
    s.add(low)
    s.update(s.schedule(), [7, 8])
    high = make_seq([5, 6, 7, 8, 9], "high", priority=0, n=3, arrival=1.0, max_tokens=2)
    s.add(high)
    out = s.schedule()
    assert ids(out.scheduled) == ["high"] and out.scheduled[0].sample_indices == (0, 1)
    assert len(out.preempted) == 2 and {q.request.request_id for q in out.preempted} == {"low"}
    s.update(out, [1, 1])
    assert [(q.request.request_id, q.sample_index) for q in s.waiting] == [("high", 2), ("low", 0), ("low", 1)]
    order = []
    while s.has_unfinished():
        out = s.schedule()
        assert s.num_seats_running <= 2
        order += [(i.seq.request.request_id, k) for i in out.scheduled for k in i.sample_indices]
        for q, _, _ in s.update(out, [1] * sum(len(i.sample_indices) for i in out.scheduled)):
            if q.num_output_tokens >= q.params.max_tokens:
                s.finish(q, "length")
    firsts = [o for o in order if o not in order[:order.index(o)]]
    assert firsts.index(("high", 2)) < firsts.index(("low", 0))
    assert sorted(q.sample_index for q in high.request.seqs) == [0, 1, 2] and high.request.is_finished
    assert s.bm.num_free_blocks == 64


# --- the engine over the page-checking fake runner ---------------------------------------------


def fake_engine(policy, num_pages, max_num_seqs=4, budget=16, page_size=4, max_model_len=32):
    cfg = tiny_config(vocab_size=VOCAB, max_position_embeddings=max_model_len)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, page_size=page_size,
                          num_pages=num_pages, max_model_len=max_model_len, async_scheduling=False,
                          scheduling_policy=policy)
    fake = FakeRunner(VOCAB)
    engine = Engine(cfg, None, None, config, runner=fake)
    fake.attach(engine)
    return engine


def _jobs(seed, count=10, ns=(1, 2)):
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(8)]
    jobs = []
    for i in range(count):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(n=rng.choice(ns), max_tokens=rng.randint(1, 12), ignore_eos=True,
                                temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
        jobs.append((f"r{i}", prompt, params, rng.randint(-2, 2), rng.randint(0, 6)))
    return jobs


def _run(engine, jobs):
    done, step = {}, 0
    while len(done) < len(jobs):
        for rid, prompt, params, prio, at in jobs:
            if at == step:
                engine.add_request(rid, prompt, params, priority=prio)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out, step)
        step += 1
        assert step < 2000
    return done


@pytest.mark.parametrize("seed", range(6))
def test_every_request_gets_its_reference_output_under_priorities_and_preemption(seed):
    jobs = _jobs(seed)
    engine = fake_engine("priority", num_pages=12)
    done = _run(engine, jobs)
    for rid, prompt, params, _, _ in jobs:
        check_against_reference(engine, done[rid][0], prompt, params)
    assert engine.block_manager.num_free_blocks == engine.num_pages  # nothing leaked
    assert engine.scheduler.num_preemptions > 0  # the small pool preempts


@pytest.mark.parametrize("seed", range(4))
def test_more_samples_than_seats_get_their_reference_output_under_priorities(seed):
    """As above with n up to 6 over max_num_seqs = 4: the samples that find no seat run later, at their
    request's priority, and still draw exactly their own tokens; nothing leaks."""
    jobs = _jobs(100 + seed, ns=(1, 2, 6))
    assert any(params.n > 4 for _, _, params, _, _ in jobs)
    engine = fake_engine("priority", num_pages=12)
    done = _run(engine, jobs)
    for rid, prompt, params, _, _ in jobs:
        check_against_reference(engine, done[rid][0], prompt, params)
    assert engine.block_manager.num_free_blocks == engine.num_pages and not engine.block_manager.tables
    engine.block_manager.check_invariants([])
    assert max(it.num_seqs for it in engine.stats_log.drain()) <= 4


def test_equal_priorities_schedule_exactly_as_fcfs():
    jobs = [(rid, prompt, params, 0, at) for rid, prompt, params, _, at in _jobs(11, count=12)]
    runs = []
    for policy in ("fcfs", "priority"):
        engine = fake_engine(policy, num_pages=10)
        done = _run(engine, jobs)
        runs.append(({rid: (step, [c.token_ids for c in out.outputs]) for rid, (out, step) in done.items()},
                     engine.scheduler.num_preemptions, engine.runner.steps))
    assert runs[0] == runs[1]


def test_fcfs_refuses_a_priority_and_priority_bounds_it():
    fcfs = fake_engine("fcfs", num_pages=8)
    fcfs.make_request("a", [3, 4], priority=0)
    with pytest.raises(InvalidParameterError, match="scheduling_policy=priority") as e:
        fcfs.make_request("b", [3, 4], priority=1)
    assert e.value.param == "priority"
    prio = fake_engine("priority", num_pages=8)
    for bad in (2**40, 1.5, True, "1"):
        with pytest.raises(InvalidParameterError, match="priority"):
            prio.make_request("c", [3, 4], priority=bad)


# --- the real engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    import jax

    from model.params import init_params

    return init_params(tiny_config(), jax.random.key(3))


def _llm(params, **kw):
    from serving import LLM

    base = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, page_size=4, max_model_len=40,
                attention_backend="reference")
    return LLM(config=tiny_config(), params=params, **{**base, **kw})


@pytest.mark.parametrize("spec", [{}, {"speculative_method": "ngram", "num_speculative_tokens": 2}],
                         ids=["plain", "ngram"])
def test_real_engine_greedy_output_is_the_same_whatever_the_priorities(params, spec, monkeypatch):
    """A pool of 12 pages and mixed priorities preempt (n = 2 forks, shared prefixes hit the cache), yet every
    greedy sample equals its output alone in a big FCFS pool."""
    rng = random.Random(5)
    shared = [1] + [rng.randrange(3, 97) for _ in range(8)]
    prompts = [shared + [rng.randrange(3, 97) for _ in range(rng.randint(1, 6))] + [5, 6, 7] * 2 for _ in range(6)]
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = _llm(params, num_pages=256, **spec).generate(prompts, sp)
    displaced = []
    make_room = Scheduler._make_room_for_priority

    def spy(self):
        out = make_room(self)
        displaced.extend(out)
        return out

    monkeypatch.setattr(Scheduler, "_make_room_for_priority", spy)
    llm = _llm(params, num_pages=12, scheduling_policy="priority", **spec)
    # Low priorities first; the higher ones arrive while those run, and take their pages.
    engine, done = llm.engine, {}
    for i, prio in [(0, 3), (3, 2), (5, 1)]:
        engine.add_request(f"r{i}", prompts[i], sp, priority=prio)
    for _ in range(3):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    for i, prio in [(1, -1), (2, 0), (4, -1)]:
        engine.add_request(f"r{i}", prompts[i], sp, priority=prio)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    got = [done[f"r{i}"] for i in range(len(prompts))]
    assert [[list(c.token_ids) for c in o.outputs] for o in got] == \
        [[list(c.token_ids) for c in o.outputs] for o in reference]
    again = llm.generate(prompts, sp, priority=[3, -1, 0, 2, -1, 1])  # LLM.generate takes them too
    assert [[list(c.token_ids) for c in o.outputs] for o in again] == \
        [[list(c.token_ids) for c in o.outputs] for o in reference]
    with pytest.raises(ValueError, match="2 priorities for 6 prompts"):
        llm.generate(prompts, sp, priority=[0, 1])
    s = llm.engine.stats()
    assert displaced and s.prefix_cache_hit_tokens > 0  # preempted for a higher priority; prefix hits
    assert s.kv_pages_used == 0
    if spec:
        assert s.spec_decode.num_drafts > 0
