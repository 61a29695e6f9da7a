"""`python -m serving.server` as users run it: flags, the startup log, serving, and a clean shutdown."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

from serving.server import free_port
from conftest import SUBPROCESS_XLA_FLAGS

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
        deadline = time.monotonic() + 300
        text = ""
        while "Uvicorn running" not in text:
            assert proc.poll() is None, f"server exited early:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server did not come up:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
            text = log_path.read_text()
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
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, log_path.read_text()[-2000:]


def test_a_busy_port_stops_the_binary_before_it_loads_anything():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-m", "serving.server", f"--port={port}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr + proc.stdout
    assert "loading" not in proc.stderr + proc.stdout  # it stopped before the checkpoint
