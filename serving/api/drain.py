"""Graceful drain: on SIGTERM stop admitting, let in-flight requests finish, then stop.

A server told to stop (`Drain.begin`, which `DrainingServer` calls on the
first SIGTERM) at once answers every new request, and `/health`, with a 503
in OpenAI's error envelope (`code: "server_shutting_down"`), so a router or
Kubernetes takes it out of rotation; `/metrics` stays open. Requests already
in flight run on for up to `--shutdown_timeout_s`; those still running then
end with an in-band error (a stream's last event before `[DONE]`; a 503 for a
response not yet started, which a router retries elsewhere) and their KV pages
are freed. Then uvicorn shuts down and the process exits 0. A second SIGTERM
(or SIGINT) is uvicorn's usual immediate stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Optional

import uvicorn

from serving.api import http_protocol as P
from serving.api.request_limits import send_error

log = logging.getLogger("ridgeline.server")

OPEN_PATHS = ("/metrics",)  # answered while draining (Prometheus keeps scraping)


def shutting_down_error() -> P.APIError:
    return P.APIError("The server is shutting down; retry on another replica.", status=503, type="server_error",
                      code="server_shutting_down")


class Drain:
    """The drain state of one server: whether it admits requests, and how many are in flight."""

    def __init__(self, engine, timeout_s: float = 30.0, grace_s: float = 10.0):
        """`engine`: the `AsyncEngine` whose requests are failed at the timeout; `grace_s`: how long their
        responses then get to carry the error out before the server stops anyway."""
        self.engine, self.timeout_s, self.grace_s = engine, timeout_s, grace_s
        self.draining = False
        self.in_flight = 0
        self.server: Optional[uvicorn.Server] = None  # stopped when the drain is done
        self.task: Optional[asyncio.Task] = None

    def begin(self) -> None:
        """Starts draining (on the event loop's thread); a second call does nothing."""
        if self.draining:
            return
        self.draining = True
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        log.info("draining: %d request(s) in flight, new ones refused; waiting up to %.0f s",
                 self.in_flight, self.timeout_s)
        await self._wait(self.timeout_s)
        if self.in_flight:
            failed = self.engine.fail_all(shutting_down_error())
            log.warning("drain timeout: ended %d engine request(s) with an error", failed)
            await self._wait(self.grace_s)
        log.info("drained (%d request(s) still open); shutting down", self.in_flight)
        if self.server is not None:
            self.server.should_exit = True

    async def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class DrainGate:
    """ASGI middleware: counts requests in flight; while draining, refuses new ones (and /health) with 503."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.drain.draining:
            return await send_error(send, 503, shutting_down_error().body(), {"connection": "close"})
        if scope["path"] == "/health":
            return await self.app(scope, receive, send)  # a probe is not work to wait for
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM drains (`Drain`) instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        drain.server = self
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.drain.draining and self._loop is not None:
            # Not recorded as a captured signal: uvicorn would re-raise it after shutting down, and the
            # default SIGTERM handler would end the process with a signal instead of exit code 0.
            self._loop.call_soon_threadsafe(self.drain.begin)
            return
        super().handle_exit(sig, frame)
