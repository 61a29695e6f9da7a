"""`LLM`'s default warm-up: a call compiles the few buckets its batch needs and pads the rest into them.

The engines here have KV pool sizes no other test uses, so their step executables are their own (the
executable table is shared by engines over the same model and pool) and compile counts are exact.
"""

import gc
import os
import random
import sys
import threading
import time
import weakref

import jax
import pytest

from serving import LLM, SamplingParams
from serving.compilation import executable_store, step_programs, table
from serving.core.bucket_plan import expected_shapes, holds_cheaply
from serving.core.input_batch import Buckets, StepShape
from serving.llm import resolve_warmup
from tests.conftest import assert_same_logprobs, tiny_config

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128,
              attention_backend="reference", compilation_cache_dir="")


def test_the_workload_of_the_first_generate_expects_its_prefill_and_its_decode():
    """The 125M benchmark's engine (512-token steps, 32 rows, 16-token pages, 512-token contexts) on
    prompts and outputs of 16-256 tokens: the full prefill chunk at the pages of the longest context,
    and the decode of all 32 rows in the one page bucket decode-sized steps share."""
    buckets = Buckets(512, 32, 32)
    rng = random.Random(0)
    requests = [(rng.randint(16, 256), rng.randint(16, 256), 1) for _ in range(32)]
    longest = max(p + n for p, n, _ in requests)
    assert longest > 256  # so the context's page bucket is the prompt's doubled
    assert expected_shapes(buckets, 16, requests) == [StepShape(512, 32, 32), StepShape(32, 32, 32)]
    # One short prompt: a prefill of its own size (16 tokens or more: the one page bucket), then a one-row
    # decode at its context's pages.
    assert expected_shapes(buckets, 16, [(20, 40, 1)]) == [StepShape(32, 32, 32), StepShape(1, 1, 4)]
    # n > 1 decodes every sample; one new token decodes nothing; no requests, no buckets.
    assert expected_shapes(buckets, 16, [(20, 40, 3)])[1] == StepShape(4, 4, 4)
    # Speculative decoding with 2 drafts: each decoding sequence verifies 3 rows a step.
    assert expected_shapes(buckets, 16, [(20, 40, 3)], rows_per_seq=3)[1] == StepShape(16, 16, 32)
    assert expected_shapes(buckets, 16, [(20, 1, 1)]) == [StepShape(32, 32, 32)]
    assert expected_shapes(buckets, 16, []) == []


def test_every_bucket_the_benchmark_workload_reached_pads_into_one_it_expects():
    """The 8 buckets the steps of `benchmarks/first_generate.py`'s workload reached under `LLM`'s default
    limits (512-token steps, 64 rows, 128 pages of 16 tokens) with powers of two alone, recorded from a
    run, and the 24-row decode bucket the default `decode_bucket_step` adds among them: the 2 expected
    buckets hold every one of them cheaply."""
    from benchmarks.offline_throughput import workload
    from serving.core.engine_args import BY_NAME

    buckets = Buckets(512, 64, 128, decode_step=BY_NAME["decode_bucket_step"].default)
    expected = expected_shapes(buckets, 16, [(len(p), n, 1) for p, n in workload(32, 1234, 32000)])
    assert expected == [StepShape(512, 64, 128), StepShape(32, 32, 128)]
    reached = [(512, 64, 16), (512, 64, 32), (32, 32, 128), (24, 24, 128), (16, 16, 128), (8, 8, 32), (4, 4, 32),
               (2, 2, 32), (1, 1, 32)]
    for T, S, P in reached:
        assert any(holds_cheaply(h, StepShape(T, S, P), buckets) for h in expected), (T, S, P)


def test_padding_is_allowed_only_where_it_costs_at_most_about_twice():
    buckets = Buckets(512, 32, 32)
    decode32 = StepShape(32, 32, 32)
    assert holds_cheaply(decode32, StepShape(1, 1, 2), buckets)  # decode-sized, one page bucket for all rows
    assert holds_cheaply(StepShape(8, 8, 16), StepShape(8, 8, 8), buckets)  # pages doubled
    assert not holds_cheaply(StepShape(8, 8, 32), StepShape(8, 8, 8), buckets)  # pages x4
    assert holds_cheaply(StepShape(512, 32, 32), StepShape(512, 32, 8), buckets)  # 16 tokens or more: one page bucket
    assert not holds_cheaply(StepShape(512, 32, 32), StepShape(128, 32, 32), buckets)  # tokens x4
    assert holds_cheaply(StepShape(512, 32, 32), StepShape(256, 32, 32), buckets)
    assert not holds_cheaply(StepShape(8, 8, 4), StepShape(8, 8, 8), buckets)  # smaller: never
    assert not holds_cheaply(StepShape(4, 4, 32), StepShape(2, 2, 4), Buckets(64, 4, 32))  # x8 pages, not shared


def test_the_warmup_default_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("RIDGELINE_WARMUP", raising=False)
    assert resolve_warmup(None) == "as_needed"
    for name, value in (("off", False), ("full", True), ("background", "background"), ("as_needed", "as_needed")):
        monkeypatch.setenv("RIDGELINE_WARMUP", name)
        assert resolve_warmup(None) == value
    assert resolve_warmup(True) is True
    monkeypatch.setenv("RIDGELINE_WARMUP", "eager")
    with pytest.raises(ValueError, match="RIDGELINE_WARMUP"):
        resolve_warmup(None)
    with pytest.raises(ValueError, match="warmup"):
        resolve_warmup("sometimes")


@pytest.fixture(scope="module")
def model():
    from model.params import init_params

    cfg = tiny_config()
    return cfg, init_params(cfg, jax.random.key(3))


def _workload(vocab):
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 30), ignore_eos=True, logprobs=1)
              for _ in prompts]
    return prompts, params


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def test_a_first_generate_compiles_what_it_expects_pads_the_rest_and_matches_compiling_every_bucket(model,
                                                                                                 monkeypatch):
    monkeypatch.setattr(step_programs, "FILL_AFTER_IDLE_SECONDS", 1e9)  # no idle compiles between these calls
    cfg, weights = model
    prompts, params = _workload(cfg.vocab_size)

    every = LLM(config=cfg, params=weights, num_pages=71, warmup=False, **ENGINE)
    before = table.compiled_total("step")
    exact_tokens, exact_logprobs = _run(every, prompts, params)
    buckets_reached = table.compiled_total("step") - before

    llm = LLM(config=cfg, params=weights, num_pages=73, **ENGINE, warmup="as_needed")
    try:
        runner = llm.engine.runner
        assert table.compiled_total("step") == before + buckets_reached  # nothing compiles at construction
        expected = expected_shapes(runner.buckets, runner.page_size,
                                   [(len(p), sp.max_tokens, 1) for p, sp in zip(prompts, params)])
        before = table.compiled_total("step")
        tokens, logprobs = _run(llm, prompts, params)
        compiled = table.compiled_total("step") - before
        stats = runner.warmup_stats()
        assert all(runner.programs.is_compiled(s) for s in expected)
        assert len(expected) <= compiled < buckets_reached and stats.steps_in_larger_bucket > 0
        assert stats.total == stats.compiled == len(expected) and stats.compiles_after_ready == 0
        assert tokens == exact_tokens  # padding rows and tokens are inert
        assert_same_logprobs(logprobs, exact_logprobs, 1e-4)

        # The same calls again compile nothing.
        before = table.compiled_total("step")
        assert _run(llm, prompts, params)[0] == exact_tokens
        assert table.compiled_total("step") == before
    finally:
        llm.shutdown()


def test_an_llm_let_go_of_ends_its_warm_up_thread_and_frees_its_kv_pool(model):
    """The thread waits holding its programs only weakly: a script that drops an `LLM` gets its memory back."""
    cfg, weights = model
    llm = LLM(config=cfg, params=weights, num_pages=75, **ENGINE, warmup="as_needed")
    thread, runner = llm.engine.runner.programs._thread, weakref.ref(llm.engine.runner)
    assert thread.is_alive()
    del llm
    gc.collect()
    thread.join(timeout=60)
    assert not thread.is_alive() and runner() is None


def test_once_idle_the_buckets_steps_were_padded_out_of_compile_and_later_calls_run_in_them(model, monkeypatch):
    """After a call, nothing compiles until the engine has idled `FILL_AFTER_IDLE_SECONDS`; then the buckets its
    steps were padded out of compile (the thread's own priority lowered), and the same call again runs every
    step in its own bucket, compiles nothing and gives the same tokens and logprobs."""
    monkeypatch.setattr(step_programs, "FILL_AFTER_IDLE_SECONDS", 0.5)
    cfg, weights = model
    prompts, params = _workload(cfg.vocab_size)
    llm = LLM(config=cfg, params=weights, num_pages=77, **ENGINE, warmup="as_needed")
    try:
        programs = llm.engine.runner.programs
        tokens, logprobs = _run(llm, prompts, params)
        padded = dict(programs._padded_out)
        assert padded and programs.stats().steps_in_larger_bucket == sum(padded.values())
        assert not any(programs.is_compiled(s) for s in padded)

        # A call that starts before the idle time is up holds the fills back while it runs.
        programs.begin_call()
        time.sleep(1.0)
        assert programs._fill_thread.is_alive() and programs.filled == 0
        assert not any(programs.is_compiled(s) for s in padded)
        programs.end_call()

        assert programs.wait_filled(timeout=300)
        assert all(programs.is_compiled(s) for s in padded) and programs.stats().filled == len(padded)
        if sys.platform == "linux":
            assert os.getpriority(os.PRIO_PROCESS, programs._fill_thread.native_id) == 19

        steps_before, compiled_before = programs.steps_in_larger_bucket, table.compiled_total("step")
        again_tokens, again_logprobs = _run(llm, prompts, params)
        assert programs.steps_in_larger_bucket == steps_before  # every step in its own bucket now
        assert table.compiled_total("step") == compiled_before
        assert again_tokens == tokens
        assert_same_logprobs(again_logprobs, logprobs, 1e-4)
    finally:
        llm.shutdown()
    assert not programs._fill_thread.is_alive()  # `shutdown` ends it


def test_a_warm_start_loads_its_stored_buckets_in_the_background_before_steps_need_them(model, monkeypatch):
    """The buckets an earlier `LLM` saved whole (`executable_store`, here the suite's cache directory) load
    in the warm-up thread as soon as an `LLM` over the same model and pool is built, so no step waits for a
    load; the call then compiles nothing and gives the same tokens."""
    cfg, weights = model
    prompts, params = _workload(cfg.vocab_size)
    engine = dict(ENGINE, compilation_cache_dir=None, num_pages=81)  # the suite's cache; a pool of its own
    first = LLM(config=cfg, params=weights, **engine, warmup="as_needed")
    tokens, _ = _run(first, prompts, params)
    store, key = executable_store.current(), first.engine.runner.programs._key
    stored = [s for s in first.engine.runner.warm_up_order() if os.path.exists(store.path(key(s)))]
    assert stored
    first.shutdown()
    del first, key
    gc.collect()  # its executables leave the process-wide table with it

    loads = []  # the thread each load from the store ran on
    load = executable_store.ExecutableStore.load

    def recorded_load(store, *args):
        if store.suffix == executable_store.SUFFIX:  # a step bucket's
            loads.append(threading.current_thread().name)
        return load(store, *args)

    monkeypatch.setattr(executable_store.ExecutableStore, "load", recorded_load)
    second = LLM(config=cfg, params=weights, **engine, warmup="as_needed")
    try:
        programs = second.engine.runner.programs
        deadline = time.monotonic() + 120
        while not all(programs.is_compiled(s) for s in stored) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(programs.is_compiled(s) for s in stored)  # loaded before any call
        before = table.compiled_total("step")
        assert _run(second, prompts, params)[0] == tokens
        assert table.compiled_total("step") == before
        assert len(loads) == len(stored) and set(loads) == {"ridgeline-warmup"}
    finally:
        second.shutdown()
