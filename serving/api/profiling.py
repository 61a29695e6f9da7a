"""`/start_profile` and `/stop_profile`: one `jax.profiler` trace at a time, written under a directory.

A trace covers everything the process does while it runs: the engine thread's
host work (scheduling, packing, output processing) and every device op of the
jitted steps. Read it with TensorBoard's profile plugin (XProf) or Perfetto;
docs/serving.md says how.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from serving.api import http_protocol as P

log = logging.getLogger("ridgeline.http")


class TraceControl:
    """Starts and stops one `jax.profiler` trace at a time into `profile_dir` (None: profiling is off).

    A trace captures the engine thread's host work and every device op while
    it runs; `stop` writes `plugins/profile/<timestamp>/<host>.xplane.pb`
    (TensorBoard's profile plugin, XProf) and `<host>.trace.json.gz` plus
    `perfetto_trace.json.gz` (Perfetto, chrome://tracing) under `profile_dir`.
    """

    def __init__(self, profile_dir: str | None):
        self.profile_dir = os.path.abspath(profile_dir) if profile_dir else None
        self._lock = threading.Lock()
        self._running = False
        self._started_at = 0.0

    def _check_enabled(self) -> None:
        if self.profile_dir is None:
            raise P.APIError("profiling is off: start the server with --profile_dir to enable "
                             "/start_profile and /stop_profile", code="profiling_disabled")

    def start(self) -> dict:
        import jax

        self._check_enabled()
        with self._lock:
            if self._running:
                raise P.APIError("a profile is already running; POST /stop_profile first",
                                 code="profile_already_started")
            try:
                jax.profiler.start_trace(self.profile_dir, create_perfetto_trace=True)
            except RuntimeError as e:  # someone else in this process holds the profiler
                raise P.APIError(f"cannot start a profile: {e}", code="profile_already_started") from e
            self._running = True
            self._started_at = time.time()
        log.info("profiling into %s", self.profile_dir)
        return {"status": "started", "profile_dir": self.profile_dir}

    def stop(self) -> dict:
        import jax

        self._check_enabled()
        with self._lock:
            if not self._running:
                raise P.APIError("no profile is running; POST /start_profile first", code="profile_not_started")
            try:
                jax.profiler.stop_trace()
            finally:
                self._running = False
            # Written by this trace (a trace started within the same second as the last reuses its folder).
            files = sorted(f for f in self._files() if os.path.getmtime(f) >= self._started_at)
        log.info("profile written: %s", ", ".join(files) or "(no files)")
        return {"status": "stopped", "profile_dir": self.profile_dir, "files": files}

    def stop_if_running(self) -> None:
        """At shutdown: a running trace is written rather than lost."""
        if self._running:
            try:
                self.stop()
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("could not write the running profile")

    def _files(self) -> list[str]:
        out = []
        for root, _dirs, names in os.walk(self.profile_dir or ""):
            out += [os.path.join(root, n) for n in names]
        return out
