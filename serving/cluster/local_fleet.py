"""Worker and router processes on 127.0.0.1, for tests and benchmarks.

`LocalFleet` starts `python -m serving.server` replicas (all with the same
flags and compilation cache directory, so every start after the first loads
its executables instead of compiling them) and optionally a
`python -m serving.router` in front; `stop()` (or leaving the `with` block)
ends every process it started, by its own pid, and waits for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

import httpx

from serving.server import free_port

# The repository root (this file is serving/cluster/local_fleet.py): the processes run the code beside it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Process:
    def __init__(self, name: str, cmd: list[str], log_path: str, env: dict, url: str):
        self.name, self.cmd, self.log_path, self.url = name, cmd, log_path, url
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not come up:\n{self.log_tail()}")
            time.sleep(0.25)

    def kill(self) -> None:
        """SIGKILL: the worker dies as a crashed one would."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device per worker
    return env


class LocalFleet:
    def __init__(self, log_dir: str, cache_dir: str, worker_flags: Sequence[str] = ()):
        self.log_dir, self.cache_dir = log_dir, cache_dir
        self.worker_flags = list(worker_flags)
        self.workers: list[Process] = []
        self.router: Optional[Process] = None

    def start_workers(self, n: int, timeout_s: float = 600, parallel: bool = True) -> list[Process]:
        """Starts n replicas; in parallel (one compiles what the others then may load) or one after another."""
        started = []
        deadline = time.monotonic() + timeout_s
        for _ in range(n):
            i = len(self.workers)
            port = free_port()
            cmd = [sys.executable, "-m", "serving.server", f"--port={port}", "--served_model_name=fleet",
                   f"--compilation_cache_dir={self.cache_dir}", "--log_level=warning", *self.worker_flags]
            p = Process(f"worker{i}", cmd, os.path.join(self.log_dir, f"worker{i}.log"), _env(),
                        f"http://127.0.0.1:{port}")
            self.workers.append(p)
            started.append(p)
            if not parallel:
                p.wait_ready(deadline)
        for p in started:
            p.wait_ready(deadline)
        return started

    def start_router(self, flags: Sequence[str] = (), workers: Optional[Sequence[Process]] = None,
                     timeout_s: float = 120) -> Process:
        port = free_port()
        urls = ",".join(w.url for w in (workers if workers is not None else self.workers))
        cmd = [sys.executable, "-m", "serving.router", f"--port={port}", f"--workers={urls}",
               "--log_level=warning", *flags]
        self.router = Process("router", cmd, os.path.join(self.log_dir, "router.log"), _env(),
                              f"http://127.0.0.1:{port}")
        self.router.wait_ready(time.monotonic() + timeout_s)
        return self.router

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def stop(self) -> None:
        self.stop_router()
        for p in self.workers:
            p.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
