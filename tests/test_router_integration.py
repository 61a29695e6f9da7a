"""`python -m serving.router` in front of two real `python -m serving.server` workers (the embedded model).

Proves, with the workers' own prefix-cache counters, that kv_aware routing
sends every turn of a conversation to the worker holding its prefix; that
round-robin spreads turns (and so misses); that a client hanging up on a
stream makes the worker abort it; that a killed worker is routed around while
requests keep succeeding.
"""

import os
import re
import time

import httpx
import pytest

from conftest import metric_value
from serving.cluster.local_fleet import LocalFleet

# Tiny buckets: one token bucket x four page buckets, so a cold start compiles a handful of shapes.
WORKER_FLAGS = ["--max_num_seqs=4", "--max_num_batched_tokens=16", "--min_token_bucket=16", "--max_model_len=256",
                "--page_size=16", "--attention_backend=reference"]


def _hits(worker) -> float:
    return metric_value(httpx.get(worker.url + "/metrics", timeout=30).text, "vllm:prefix_cache_hits_total")


def _routed(router) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'ridgeline:router_requests_routed_total\{policy="\w+",worker="([^"]+)"\} (\S+)', text)}


def _conversation(router, opener: str, turns: int) -> list[int]:
    """Runs a chat whose every turn resends the whole conversation; returns each turn's prompt tokens."""
    messages, prompt_tokens = [], []
    for t in range(turns):
        messages.append({"role": "user", "content": opener if t == 0 else f"and {t}?"})
        r = httpx.post(router.url + "/v1/chat/completions", timeout=120,
                       json={"model": "fleet", "messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        prompt_tokens.append(body["usage"]["prompt_tokens"])
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return prompt_tokens


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    cache = os.environ.get("RIDGELINE_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jaxcache"))
    with LocalFleet(str(tmp_path_factory.mktemp("fleet")), cache, WORKER_FLAGS) as f:
        f.start_workers(2, timeout_s=400)
        yield f


@pytest.mark.timeout(600)
def test_turns_follow_their_prefix_and_round_robin_spreads_them(fleet):
    router = fleet.start_router(["--policy=kv_aware", "--page_size=16", "--check_interval_s=0.5"])
    try:
        before = [_hits(w) for w in fleet.workers]
        prompts = _conversation(router, "Tell me about the ridgeline trail", 3)
        routed = _routed(router)
        owner = max(routed, key=routed.get)
        assert sorted(routed.values()) == [0.0, 3.0], routed  # every turn went to one worker
        gained = {w.url: _hits(w) - b for w, b in zip(fleet.workers, before)}
        # Turns 2 and 3 found at least every full block of the turn before them in that worker's cache.
        assert gained[owner] >= (prompts[0] // 16 + prompts[1] // 16) * 16 > 0, (gained, prompts)
        assert all(g == 0 for url, g in gained.items() if url != owner), gained
    finally:
        fleet.stop_router()

    router = fleet.start_router(["--policy=round_robin", "--page_size=16", "--check_interval_s=0.5"])
    try:
        _conversation(router, "Now something about mountain passes", 4)
        assert sorted(_routed(router).values()) == [2.0, 2.0]
    finally:
        fleet.stop_router()


@pytest.mark.timeout(300)
def test_a_client_disconnect_aborts_the_request_on_the_worker(fleet):
    router = fleet.start_router(["--policy=round_robin", "--page_size=16", "--check_interval_s=0.5"])

    def aborted():
        return sum(metric_value(httpx.get(w.url + "/metrics", timeout=30).text, "vllm:request_success_total",
                            finished_reason="abort") for w in fleet.workers)

    try:
        before = aborted()
        body = {"model": "fleet", "prompt": "a long story", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", router.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                assert next(r.iter_lines()).startswith("data: ")  # the first token arrived; then we hang up
        deadline = time.monotonic() + 60
        while aborted() == before:
            assert time.monotonic() < deadline, "the worker never aborted the abandoned request"
            time.sleep(0.2)
    finally:
        fleet.stop_router()


@pytest.mark.timeout(300)
def test_responses_and_messages_are_relayed_and_continued_turns_stick(fleet):
    """The official clients through the router; round robin would send every second turn of a stored
    conversation to the worker that does not hold it (a 404 there), so each continued turn succeeding
    shows the router sent it back to the response's worker, streamed first turn or not."""
    import anthropic
    import openai

    router = fleet.start_router(["--policy=round_robin", "--page_size=16", "--check_interval_s=0.5"])
    try:
        oa = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        for stream in (True, False):
            first = oa.responses.create(model="fleet", input="Tell me about the trail", max_output_tokens=4,
                                        temperature=0, stream=stream)
            previous = [e for e in first][-1].response if stream else first
            assert previous.status in ("completed", "incomplete")
            for turn in range(3):
                r = oa.responses.create(model="fleet", input=f"and {turn}?", max_output_tokens=4, temperature=0,
                                        previous_response_id=previous.id)
                assert r.previous_response_id == previous.id
                previous = r
        assert oa.responses.retrieve(previous.id).id == previous.id

        an = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
        chat = {"model": "fleet", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi"}]}
        greedy = {"temperature": 0.0, "ignore_eos": True}  # this client has no temperature argument: an extra
        whole = an.messages.create(**chat, extra_body=greedy)
        assert whole.type == "message" and whole.usage.output_tokens == 4
        with an.messages.stream(**chat, extra_body=greedy) as st:
            streamed = st.get_final_message()
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    finally:
        fleet.stop_router()


@pytest.mark.timeout(300)
def test_a_killed_worker_is_routed_around(fleet):
    router = fleet.start_router(["--policy=round_robin", "--page_size=16", "--check_interval_s=0.5"])
    try:
        victim, survivor = fleet.workers
        victim.kill()
        for i in range(4):  # the first may hit the dead worker and be retried; none fails
            r = httpx.post(router.url + "/v1/completions", timeout=120,
                           json={"model": "fleet", "prompt": f"after the crash {i}", "max_tokens": 3,
                                 "temperature": 0, "stream": i % 2 == 1})
            assert r.status_code == 200, r.text
        text = httpx.get(router.url + "/metrics", timeout=30).text
        assert metric_value(text, "ridgeline:router_worker_healthy", worker=victim.url) == 0.0
        assert metric_value(text, "ridgeline:router_worker_healthy", worker=survivor.url) == 1.0
        assert metric_value(text, "ridgeline:router_requests_failed_total") == 0.0
        assert httpx.get(router.url + "/health", timeout=30).status_code == 200
    finally:
        fleet.stop_router()
