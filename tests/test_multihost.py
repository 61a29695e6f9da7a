"""Multi-host serving on jax.distributed, run as real processes on 127.0.0.1.

* Two processes x 2 CPU devices give the same greedy tokens as one process,
  with tensor parallelism over all four devices and with two pipeline stages
  (one per process, 2-way tensor parallel inside, 2 microbatches), through
  `LLM.generate` (a mixed batch: chunked prefills, ragged lengths, a forked
  request whose pages are copied), and the pipelined layout through the HTTP
  server that process 0 runs (both started with `serving.launch`); process 1
  really replayed the steps and page copies, and got process 0's outputs back
  from its own `generate`. The same launch serves LoRA adapters at PP=2 x TP=2
  (a batch mixing the base model and two adapters): process 1 replayed the
  slot writes, and the tokens are one process's.
* Two processes (TP=4 over both, and PP=2 x TP=2) run a draft model's
  speculative decoding, sampling controls and a regex-constrained request in
  one batch with the greedy tokens of one process; a prompt's KV exported by
  process 0 resumes the same tokens imported into the two-process engine and
  into a single-process one; process 1 replayed the drafting calls, control
  rows, gather and scatter, and holds the same draft cache and control slots.
* A process killed mid-run makes the survivor exit non-zero with a message
  within a bounded time; a process that never joins makes the other give up.
* `serving.launch`: environment, `[pN]` prefixes, first non-zero exit code,
  the others stopped.

Every child process runs under a timeout and is killed in `finally`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

import multihost_worker as worker
from serving import LLM, SamplingParams
from serving.cluster.distributed import Channel, DistributedConfig
from serving.launch import process_env, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
PY = sys.executable
RUN_TIMEOUT = 240  # seconds for one multi-process run (a shared 2-core machine is slow)
DEATH_BOUND = 30  # a survivor must be gone this long after its peer died (heartbeat timeout 5 s + slack)
FAST_FAILURE_ENV = {"RIDGELINE_DIST_HEARTBEAT_TIMEOUT_S": "5", "RIDGELINE_DIST_INIT_TIMEOUT_S": "60"}


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def launch(args: list[str], timeout: float = RUN_TIMEOUT, env_extra=None) -> tuple[int, str]:
    env = dict(os.environ, **(env_extra or {}))
    p = subprocess.Popen([PY, "-m", "serving.launch", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    finally:
        _kill(p)


def readable(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if "[Gloo]" not in line)[-4000:]


# --- LLM.generate over two processes -------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_tokens():
    llm = LLM(config=worker.CFG, params=worker.params(), **worker.ENGINE)
    return worker.token_ids(llm.generate(worker.prompts(), worker.sampling()))


def test_two_processes_generate_matches_one_process(tmp_path, reference_tokens):
    """TP=4 over both processes, then PP=2 (one stage per process) x TP=2 inside each, with overlapped
    scheduling; then a sliding-window mixture of experts with int8 weights, an fp8 KV cache and
    prompt-lookup speculation at TP=4 (`worker.variant_engine`); then LoRA adapters mixed with the base
    model at PP=2 x TP=2 (`worker.lora_engine`); all in one launch."""
    rc, out = launch(["--num_processes=2", "--devices_per_process=2", "--", PY, WORKER, "--out", str(tmp_path),
                      "--layouts", "tp4", "pp2tp2", "--variant", "--lora"], timeout=RUN_TIMEOUT + 120,
                     env_extra=FAST_FAILURE_ENV)  # four engines compile in this launch
    assert rc == 0, readable(out)
    for i in range(2):
        assert f"[p{i}] process {i} of 2: pp2tp2 over 2 local devices, 4 in all" in out
    leader = json.loads((tmp_path / "p0.json").read_text())
    follower = json.loads((tmp_path / "p1.json").read_text())
    for layout in ("tp4", "pp2tp2"):
        assert leader[layout]["tokens"] == reference_tokens, layout
        assert follower[layout]["tokens"] == reference_tokens, layout  # generate returns process 0's outputs
        assert leader[layout]["replayed"] is None
        # Process 1 ran every step and the copy-on-write page copies of the forked request itself.
        replayed = follower[layout]["replayed"]
        assert replayed["step"] >= max(len(t[0]) for t in reference_tokens), layout
        assert replayed["copy"] >= 1, layout
    single = worker.variant_engine()
    want = worker.token_ids(single.generate(worker.prompts(), worker.sampling()))
    assert leader["variant"]["tokens"] == want and follower["variant"]["tokens"] == want
    assert leader["variant"]["drafted"] > 0 and follower["variant"]["replayed"]["step"] >= 1
    single = worker.lora_engine(str(tmp_path / "adapters-reference"))
    want = worker.token_ids(single.generate(worker.prompts(), worker.sampling(), lora_request=worker.LORA_OF))
    assert leader["lora"]["tokens"] == want and follower["lora"]["tokens"] == want
    assert want != reference_tokens  # the adapters changed some requests' tokens
    # process 1 wrote each adapter's slot as process 0 did (the part's state writes; the requests use no controls)
    assert follower["lora"]["replayed"]["part-state"] >= 2


def test_two_processes_run_controls_grammars_draft_model_and_kv_transfer_as_one_process(tmp_path):
    """Every optional feature of the step at once, at TP=4 over both processes and at PP=2 (a stage per
    process) x TP=2: a draft model (speculative decoding), sampling controls, a regex, a custom logits
    processor, n = 2, logprobs,
    then a prefix-cache hit and a salted request kept apart from it; then a KV export from process 0,
    imported back into the two-process engine and into a single-process one."""
    layouts = ["tp4", "pp2tp2"]
    rc, out = launch(["--num_processes=2", "--devices_per_process=2", "--", PY, WORKER, "--out", str(tmp_path),
                      "--features", "--layouts", *layouts], env_extra=FAST_FAILURE_ENV)
    assert rc == 0, readable(out)
    leaders = json.loads((tmp_path / "p0.json").read_text())["features"]
    followers = json.loads((tmp_path / "p1.json").read_text())["features"]

    single = worker.features_engine()
    jobs = worker.features_jobs()
    outputs = single.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    want, want_logprobs = worker.token_ids(outputs), worker.chosen_logprobs(outputs[-1])
    want_again = worker.token_ids(single.generate(*worker.features_second_wave()))
    prompt, sp = worker.export_job()
    want_export = list(single.generate([prompt], sp)[0].outputs[0].token_ids)
    for layout in layouts:
        leader, follower = leaders[layout], followers[layout]
        assert leader["tokens"] == want, layout
        assert follower["tokens"] == want, layout
        assert re.fullmatch(r"(def|class) [a-z_]{2,8}\(self\)", leader["texts"][4])  # the grammar held
        assert len(leader["tokens"][6]) == 2  # n = 2
        assert [leader["tokens"][5][0][i] for i in worker.FORCED["at"]] == [worker.FORCED["force"]] * 3
        assert len(leader["logprobs"]) == 8
        assert max(abs(a - b) for a, b in zip(leader["logprobs"], want_logprobs)) < 1e-4, layout
        assert leader["again"] == want_again and follower["again"] == want_again, layout
        assert leader["cached"][0] > 0 and leader["cached"][1] == 0, layout  # a prefix hit; the salt kept apart
        shipped = leader["shipped"]
        assert shipped["spec"]["drafted"] > 0 and shipped["spec"]["accepted"] > 0  # drafts verified, some kept

        assert shipped["first_token"] == want_export[0], layout
        assert shipped["imported"] == want_export, layout  # imported into the two-process engine
        single.engine.reset_prefix_cache()  # the import below writes every token
        payload = (tmp_path / f"export-{layout}.bin").read_bytes()
        assert worker.import_payload(single.engine, payload) == want_export, layout

        # Process 1 replayed the drafting calls, the control rows and the gather and scatter itself, and
        # holds the same draft KV cache and control slots as process 0.
        assert follower["state"] == leader["state"], layout
        replayed = follower["replayed"]
        assert replayed["draft"] >= 1 and replayed["step"] >= max(len(t[0]) for t in want) // 4
        assert replayed["part-state"] >= 3  # a controls row per request using a control
        assert replayed["cache"] >= 2  # the export's gather, the import's scatter


# --- the HTTP server run by process 0 ---------------------------------------------------------------
SERVER_ARGS = ["--max_model_len", "64", "--max_num_batched_tokens", "32", "--min_token_bucket", "32",
               "--max_num_seqs", "4", "--page_size", "16", "--num_pages", "32"]
HTTP_PROMPTS = ["Hello there", "The quick brown fox jumps over", "1, 2, 3,"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_http_server_on_process_0_matches_one_process():
    want = LLM(max_model_len=64, max_num_batched_tokens=32, min_token_bucket=32, max_num_seqs=4, page_size=16,
               num_pages=32).generate(HTTP_PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    port = free_port()
    env = dict(os.environ, **FAST_FAILURE_ENV)
    p = subprocess.Popen([PY, "-m", "serving.launch", "--num_processes=2", "--devices_per_process=2", "--", PY, "-m",
                          "serving.server", "--pipeline_parallel_size=2", "--tensor_parallel_size=2", "--num_microbatches=2",
                          f"--port={port}", *SERVER_ARGS],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while True:
            assert p.poll() is None, readable(p.communicate()[0])
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        got = _post(f"http://127.0.0.1:{port}/v1/completions",
                    {"model": "default", "prompt": HTTP_PROMPTS, "max_tokens": 8, "temperature": 0})
        assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == \
            [o.outputs[0].text for o in want]
        p.send_signal(signal.SIGINT)  # Ctrl-C: process 0 shuts down, telling process 1
        out, _ = p.communicate(timeout=60)
    finally:
        _kill(p)
    assert p.returncode == 130, readable(out)
    assert "[p1]" in out and "process 0 ended the run" in out, readable(out)
    assert not re.search(r"\[p1\].*(Traceback|Fatal)", out), readable(out)


# --- failures ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dies", [1, 0])
def test_a_killed_peer_makes_the_survivor_exit_nonzero(tmp_path, dies):
    """Process `dies` kills itself (SIGKILL) at its third step of a long generate; the other must exit
    non-zero, saying why, within DEATH_BOUND seconds."""
    addr = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    try:
        for i in range(2):
            env = process_env(i, 2, addr, 2)
            env.update(FAST_FAILURE_ENV)
            logs.append(open(tmp_path / f"p{i}.log", "w+"))
            procs.append(subprocess.Popen(
                [PY, WORKER, "--out", str(tmp_path), "--max_tokens", "40", "--die_process", str(dies),
                 "--die_after_steps", "3"], cwd=ROOT, env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                start_new_session=True))
        victim, survivor = procs[dies], procs[1 - dies]
        victim.wait(timeout=RUN_TIMEOUT)
        died_at = time.monotonic()
        assert victim.returncode == -signal.SIGKILL
        survivor.wait(timeout=DEATH_BOUND)
        took = time.monotonic() - died_at
    finally:
        for p in procs:
            _kill(p)
    logs[1 - dies].seek(0)
    out = logs[1 - dies].read()
    assert survivor.returncode != 0
    assert took < DEATH_BOUND
    assert re.search(r"(another process|process 0) is gone|another task died", out), readable(out)
    assert not (tmp_path / f"p{1 - dies}.json").exists()  # it never claimed to have finished


def test_a_process_that_never_joins_makes_the_other_give_up():
    env = process_env(0, 2, f"127.0.0.1:{free_port()}", 1)
    env["RIDGELINE_DIST_INIT_TIMEOUT_S"] = "3"
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from serving.cluster import distributed; distributed.initialize(); print('joined')")
    p = subprocess.Popen([PY, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        _kill(p)
    assert p.returncode != 0
    assert "joined" not in out.split("\n")
    assert "must join within 3 s" in out  # what it was waiting for is logged before it waits
    assert re.search(r"DEADLINE_EXCEEDED|did not join", out), out  # and why it gave up


# --- serving.launch --------------------------------------------------------------------------------
CHILD = ("import os, sys, time\n"
         "i = int(os.environ['RIDGELINE_PROCESS_ID'])\n"
         "print('child', i, 'of', os.environ['RIDGELINE_NUM_PROCESSES'], os.environ['RIDGELINE_COORDINATOR_ADDRESS'],"
         " os.environ['XLA_FLAGS'], flush=True)\n"
         "print('to stderr', i, file=sys.stderr, flush=True)\n"
         "if i == int(sys.argv[1]): time.sleep(0.3); sys.exit(int(sys.argv[2]))\n"
         "time.sleep(float(sys.argv[3]))\n")


def test_launch_prefixes_logs_and_fills_in_the_settings():
    rc, out = launch(["--num_processes=3", "--devices_per_process=2", "--", PY, "-c", CHILD, "-1", "0", "0"],
                     timeout=60, env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert rc == 0, out
    addresses = set()
    for i in range(3):
        m = re.search(rf"^\[p{i}\] child {i} of 3 (127\.0\.0\.1:\d+) --xla_force_host_platform_device_count=2$",
                      out, re.M)
        assert m, out
        addresses.add(m.group(1))
        assert f"[p{i}] to stderr {i}" in out
    assert len(addresses) == 1  # one coordinator for all


def test_launch_returns_the_first_failure_and_stops_the_others():
    t0 = time.monotonic()
    rc, out = launch(["--num_processes=3", "--grace_s=2", "--", PY, "-c", CHILD, "1", "7", "120"], timeout=60)
    assert rc == 7, out
    assert time.monotonic() - t0 < 60  # the two sleepers (120 s) were stopped, not waited for


# --- pieces --------------------------------------------------------------------------------------
def test_config_precedence_and_when_a_run_is_multi_process():
    env = {"RIDGELINE_COORDINATOR_ADDRESS": "10.0.0.1:1234", "RIDGELINE_NUM_PROCESSES": "4",
           "RIDGELINE_PROCESS_ID": "2", "RIDGELINE_DIST_CALL_TIMEOUT_S": "9"}
    c = DistributedConfig.from_env(env, process_id=3, num_processes=None)
    assert (c.coordinator_address, c.num_processes, c.process_id, c.call_timeout_s) == ("10.0.0.1:1234", 4, 3, 9.0)
    assert c.requested
    assert not DistributedConfig.from_env({}).requested  # nothing set: one process, no runtime
    assert not DistributedConfig.from_env({"RIDGELINE_NUM_PROCESSES": "1"}).requested
    auto = DistributedConfig.from_env({"RIDGELINE_DISTRIBUTED": "1"})
    assert auto.requested and auto.coordinator_address is None  # left to jax's cluster detection
    with pytest.raises(ValueError, match="RIDGELINE_NUM_PROCESSES"):
        DistributedConfig.from_env({"RIDGELINE_NUM_PROCESSES": "two"})


class FakeStore:
    """The coordination client's key-value calls, in memory."""

    def __init__(self):
        self.data = {}

    def key_value_set_bytes(self, key, value):
        assert key not in self.data
        self.data[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.data:
            raise RuntimeError("DEADLINE_EXCEEDED: no such key")
        return self.data[key]

    def key_value_delete(self, key):
        del self.data[key]


def test_channel_delivers_in_order_to_every_process_and_leaves_nothing_behind():
    import numpy as np

    store = FakeStore()
    leader = Channel(store, 0, 3)
    leader.PART_BYTES = 1000  # a big message goes in parts
    followers = [Channel(store, p, 3) for p in (1, 2)]
    big = np.arange(5000, dtype=np.int32)
    leader.send(("call", "step", (big,), {}))
    leader.send(("noop",))
    for f in followers:
        kind, call, (arr,), _ = f.receive(1)
        assert (kind, call) == ("call", "step") and np.array_equal(arr, big)
        assert f.receive(1) == ("noop",)
        with pytest.raises(TimeoutError):
            f.receive(0.01)
    assert store.data == {}


class FakeWatchdog:
    """Collects the checks a real `Watchdog` would run every half second (and die on)."""

    def __init__(self):
        self.checks = []

    def add(self, check):
        self.checks.append(check)

    def problems(self):
        return [m for m in (c() for c in self.checks) if m]


class FakeEngine:
    def __init__(self):
        def set_dispatch_hook(runner, hook):
            runner.dispatch_hook = hook

        self.runner = type("Runner", (), {"dispatch_hook": None, "set_dispatch_hook": set_dispatch_hook})()
        self.unfinished = False

    def has_unfinished_requests(self):
        return self.unfinished


def test_a_stuck_step_or_wait_is_reported_once_it_outlasts_the_call_timeout():
    from serving.cluster.distributed import Deadline
    from serving.cluster.multihost import Leader

    store, dog, engine = FakeStore(), FakeWatchdog(), FakeEngine()
    config = DistributedConfig(call_timeout_s=0.2)
    leader = Leader(engine, Channel(store, 0, 2), config, dog)
    engine.runner.dispatch_hook("step", b"ibuf")  # the runner's seam now reaches the other process
    assert Channel(store, 1, 2).receive(1) == ("call", "step", (b"ibuf",), {})
    time.sleep(0.3)
    assert dog.problems() == []  # idle: nothing is owed, however long it lasts
    engine.unfinished = True
    assert "another process is gone or hung" in dog.problems()[0]  # work pending, no call for 0.3 s
    engine.runner.dispatch_hook("step", b"next")
    assert dog.problems() == []
    leader.shutdown()
    deadline = Deadline(dog, 0.2, "a peer stopped")
    with deadline.guard("device call 7"):
        assert not dog.problems()[1:]
        time.sleep(0.3)
        assert any("device call 7 has not finished after 0 s: a peer stopped" in p for p in dog.problems())
    assert dog.problems() == []
