"""`python -m serving.server` as users run it: flags, the startup log, serving, a clean shutdown, and
the refusals at start (one line, exit status 2, whichever phase refuses)."""

import json
import os
import re
import socket
import subprocess
import sys

import httpx

from serving.server import free_port
from conftest import SUBPROCESS_XLA_FLAGS, interrupt_server, wait_until_serving
from reasoning_checkpoints import save_reasoning_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_binary_starts_logs_its_setup_serves_and_stops(tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one CPU device, as a user's machine would have
    cmd = [sys.executable, "-m", "serving.server", f"--port={port}", "--served_model_name=tiny-server",
           "--max_num_seqs=4", "--max_num_batched_tokens=16", "--min_token_bucket=16", "--max_model_len=32",
           "--attention_backend=reference", "--peak_bandwidth_gbps=100", "--peak_tflops=1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        text = wait_until_serving(proc, log_path)
        # The startup log: what was loaded, the KV pool in pages, tokens and bytes, and the warm-up.
        assert re.search(r"model: \S+; 4 layers, hidden 256", text), text
        pool = re.search(r"KV pool: (\d+) pages x 16 tokens = (\d+) tokens, [\d.]+ (KiB|MiB|GiB)", text)
        assert pool and int(pool.group(1)) * 16 == int(pool.group(2)), text
        assert re.search(r"max_model_len 32", text)
        assert re.search(r"warm-up: compiled \d+ executables for \d+ step shapes in [\d.]+ s", text), text
        assert re.search(r"step executable 1/\d+ \(T=\d+, P=\d+\) (compiled|found) in [\d.]+ s", text), text
        assert "serving 'tiny-server'" in text
        assert "orbax" not in text.lower()  # checkpoint chatter stays out of the info log

        url = f"http://127.0.0.1:{port}"
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-server", "prompt": "def f(", "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-server", "prompt": "x" * 40}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(url + "/health", timeout=30).json()["status"] in ("warming", "ready")
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'vllm:generation_tokens_total{engine="0",model_name="tiny-server"} 5.0' in metrics
        assert "ridgeline:model_bandwidth_utilization" in metrics  # peaks came from the flags
    finally:
        interrupt_server(proc)
    assert proc.returncode == 0, log_path.read_text()[-2000:]


def test_a_busy_port_stops_the_binary_before_it_loads_anything():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-m", "serving.server", f"--port={port}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    assert_refused(proc, f"cannot listen on 127.0.0.1:{port}")
    assert "loading" not in proc.stderr + proc.stdout  # it stopped before the checkpoint


def start_refused(*flags: str) -> subprocess.CompletedProcess:
    """Runs the binary with `flags` (on a free port, one CPU device), expecting it to refuse to start."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    return subprocess.run([sys.executable, "-m", "serving.server", f"--port={free_port()}", *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    """A refusal at start: exit status 2, one `error:` line naming the problem, and neither a traceback nor
    an abort (a background compile thread still running at exit aborts the interpreter)."""
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2, out[-3000:]
    for bad in ("Traceback", "fatal", "terminate called", "Aborted"):
        assert bad.lower() not in out.lower(), out[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in errors[0], errors[0]


def test_a_flag_value_absl_refuses_is_one_line_before_anything_loads():
    proc = start_refused("--warmup=sometimes")
    assert_refused(proc, "--warmup", "sometimes")
    assert "loading" not in proc.stderr


def test_options_the_engine_refuses_are_one_line_after_the_checkpoint_loaded():
    proc = start_refused("--max_model_len=128", "--num_pages=2", "--page_size=16")
    assert_refused(proc, "max_model_len=128", "num_pages")
    assert "loading the embedded default model" in proc.stderr  # refused by the engine, after the load


def test_a_logits_processor_that_fails_its_check_is_one_line_naming_it():
    # (tests/logits_processor_examples.py: rows() here returns an array without the samples' axis)
    proc = start_refused("--logits_processors=tests.logits_processor_examples:RowsWithoutTheSampleAxis")
    assert_refused(proc, "logits processor tests.logits_processor_examples:RowsWithoutTheSampleAxis", "leading axis")


def test_a_refusal_in_create_app_during_the_background_warm_up_exits_cleanly(tmp_path):
    # Think tags that are special tokens: --reasoning_parser refuses them once the tokenizer is loaded, in
    # create_app, while the step shapes beyond the smallest and the largest still compile in the background.
    ckpt = save_reasoning_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ckpt"), added_tags=True)
    path = os.path.join(ckpt, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    for t in tok["added_tokens"]:
        t["special"] = t["special"] or t["content"] in ("<think>", "</think>")
    with open(path, "w") as f:
        json.dump(tok, f)
    proc = start_refused(f"--checkpoint={ckpt}", f"--compilation_cache_dir={tmp_path / 'cache'}",
                         "--reasoning_parser=qwen3", "--warmup=background",
                         "--max_num_seqs=4", "--max_num_batched_tokens=64", "--min_token_bucket=8",
                         "--page_size=8", "--max_model_len=256", "--min_context_bucket=16")
    assert_refused(proc, "--reasoning_parser qwen3", "special tokens")
    assert re.search(r"\d+ more step shapes compile in the background", proc.stderr), proc.stderr[-3000:]
    assert "warm-up done" not in proc.stderr  # the refusal came while the background warm-up ran
