"""Pausing generation (`serving.features.pause`): what each mode does to running and new requests, that a
paused-and-resumed request draws what it would have unpaused (greedy, with and without recomputing its K/V),
that an abort returns the tokens so far, and the HTTP routes."""

import os
import threading
import time

import pytest

from serving import LLM, SamplingParams
from serving.core.engine import EngineUnavailableError
from serving.features import pause
from serving.llm import default_checkpoint_dir

from conftest import run_to_completion

pytestmark = pytest.mark.skipif(not os.path.isdir(default_checkpoint_dir()), reason="needs the embedded model")

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32, page_size=16, max_model_len=128,
              num_pages=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = {"a": [1, 70, 71, 72], "b": [1, 100, 101]}


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def unpaused(llm):
    engine = llm.engine
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, GREEDY)
    return {rid: out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}


def steps(engine, n):
    outs = []
    for _ in range(n):
        outs += engine.step()
    return outs


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_keep_freezes_requests_and_they_continue_as_if_unpaused(llm, unpaused, recompute_kv):
    engine = llm.engine
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, GREEDY)
    steps(engine, 5)
    assert pause.pause(engine, "keep") == "paused" and llm.is_paused
    engine.add_request("late", PROMPTS["a"], GREEDY)  # taken, and waits
    engine.step()  # (held: finishes the step in flight under overlapped scheduling)
    frozen = {rid: list(r.seqs[0].token_ids) for rid, r in engine.requests.items()}
    steps(engine, 3)
    assert {rid: list(r.seqs[0].token_ids) for rid, r in engine.requests.items()} == frozen
    with pytest.raises(EngineUnavailableError, match="paused"):
        llm.generate([PROMPTS["a"]], GREEDY)
    drawn = {rid: engine.requests[rid].seqs[0].num_output_tokens for rid in PROMPTS}
    version = llm.weight_version
    llm.update_weights(llm.get_weights())  # the same weights put back: the tokens must not change
    recomputed = pause.resume(engine, recompute_kv=recompute_kv)
    assert recomputed == (2 if recompute_kv else 0)
    outs = run_to_completion(engine)
    assert {rid: outs[rid].outputs[0].token_ids for rid in PROMPTS} == unpaused
    assert outs["late"].outputs[0].token_ids == unpaused["a"]
    for rid in PROMPTS:  # each token says the weights it was drawn under
        n = drawn[rid]
        assert outs[rid].outputs[0].weight_versions == [version] * n + [version + 1] * (GREEDY.max_tokens - n)
    assert engine.block_manager.num_used_blocks == 0 or engine.config.enable_prefix_caching


def test_abort_returns_the_tokens_so_far_and_new_requests_wait(llm, unpaused):
    engine = llm.engine
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, GREEDY)
    steps(engine, 4)
    pause.pause(engine, "abort")
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == set(PROMPTS) and not engine.has_unfinished_requests()
    for rid, out in outs.items():
        got = out.outputs[0].token_ids
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert 0 < len(got) < GREEDY.max_tokens and got == unpaused[rid][:len(got)]
    engine.add_request("after", PROMPTS["b"], GREEDY)
    assert steps(engine, 3) == [] and engine.requests["after"].seqs[0].num_output_tokens == 0
    pause.resume(engine)
    assert run_to_completion(engine)["after"].outputs[0].token_ids == unpaused["b"]


def test_wait_lets_started_requests_finish_and_holds_new_ones(llm, unpaused):
    engine = llm.engine
    engine.add_request("a", PROMPTS["a"], GREEDY)
    steps(engine, 3)
    assert pause.pause(engine, "wait") == "draining"
    engine.add_request("b", PROMPTS["b"], GREEDY)
    finished = {}
    for _ in range(200):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if pause.state(engine) == "paused":
            break
    assert pause.state(engine) == "paused" and finished["a"].outputs[0].token_ids == unpaused["a"]
    assert engine.requests["b"].metrics.first_scheduled_time is None  # never admitted while draining
    pause.resume(engine)
    assert run_to_completion(engine)["b"].outputs[0].token_ids == unpaused["b"]


def test_bad_modes_are_refused(llm):
    with pytest.raises(pause.PauseError, match="mode: must be one of"):
        llm.pause_generation("nap")
    with pytest.raises(pause.PauseError, match="not paused"):
        llm.resume_generation(recompute_kv=True)


def test_pause_routes_over_http(llm):
    import httpx

    from serving.api.rl_routes import RLRouteOptions
    from serving.server import ServerThread

    long = {"model": "m", "prompt": "def f(", "max_tokens": 100, "temperature": 0.0, "ignore_eos": True}
    with ServerThread(llm, model_name="m", rl_routes=RLRouteOptions()) as srv:
        url = srv.url
        answers = {}

        def complete(key, body):
            answers[key] = httpx.post(url + "/v1/completions", json=body, timeout=120).json()

        def taken_and_waiting(thread):  # the request reached the held engine (bounded: never a timing assertion)
            for _ in range(600):
                if srv.async_engine.stats().num_waiting >= 1 or not thread.is_alive():
                    return
                time.sleep(0.05)

        assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=60).json()["is_paused"] is True
        first = threading.Thread(target=complete, args=("aborted", long))
        first.start()
        taken_and_waiting(first)
        assert first.is_alive()  # held: it cannot run while paused
        assert httpx.post(url + "/pause", params={"mode": "abort"}, timeout=60).json()["is_paused"] is True
        first.join(60)
        choice = answers["aborted"]["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["text"] == ""  # ended before drawing a token
        assert httpx.get(url + "/is_paused", timeout=60).json() == {"is_paused": True, "state": "paused"}
        second = threading.Thread(target=complete, args=("after", dict(long, max_tokens=5)))
        second.start()
        taken_and_waiting(second)
        assert second.is_alive()  # taken, waiting for the resume
        assert httpx.post(url + "/resume", timeout=60).json()["is_paused"] is False
        second.join(60)
        assert answers["after"]["choices"][0]["finish_reason"] == "length"
        assert httpx.post(url + "/pause", params={"mode": "nap"}, timeout=60).status_code == 400
