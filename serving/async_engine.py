"""`AsyncEngine`: the engine loop on a background thread, for asyncio callers (the HTTP server).

    engine = AsyncEngine(LLM(...).engine)
    async for out in engine.generate(prompt, SamplingParams(...), request_id):
        ...   # cumulative RequestOutputs; the last one has out.finished

Callers never touch engine state directly: requests and aborts go through a
locked inbox that the loop drains between steps, and outputs come back through
each request's asyncio queue (`loop.call_soon_threadsafe`), so the HTTP side
never blocks the loop and the loop never blocks the event loop.

Validation runs in the caller (`generate` raises `InvalidParameterError` at
once, before anything is queued). A prompt carrying images is made in a
bounded pool of worker threads instead: its preprocessing and encoding
(`serving.features.multimodal`) would otherwise hold the event loop. A generator that is closed or cancelled
before its request finished (a client disconnect) aborts the request, which
frees its KV pages at the next loop iteration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from typing import AsyncIterator, Optional

from serving.core.engine import Engine, PromptType
from serving.core.outputs import RequestOutput
from serving.core.sampling_params import SamplingParams
from serving.core.stats import EngineStats

log = logging.getLogger(__name__)


MEDIA_WORKERS = 2  # threads making image requests: the encoder runs on the device, so a few suffice


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can make progress."""


class AsyncEngine:
    def __init__(self, engine: Engine, start: bool = True):
        self.engine = engine
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, object]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._error: Optional[BaseException] = None
        # Requests with images are made here (preprocessing, encoding), off the event loop.
        self._media_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._thread = threading.Thread(target=self._loop, name="ridgeline-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_llm(cls, llm) -> "AsyncEngine":
        return cls(llm.engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._media_pool is not None:
            self._media_pool.shutdown(wait=False, cancel_futures=True)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the caller side -------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                       request_id: str = "", *, cache_salt: Optional[str] = None, priority: int = 0,
                       part_args: Optional[dict] = None) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs of one request until it finishes.

        `cache_salt` isolates the request's prefix-cache pages and `priority` orders it under the priority
        scheduling policy, and `part_args` are the request arguments the engine's parts read
        (`Engine.make_request`): the LoRA adapter it runs with ("lora_name"), a shipped prefill it resumes
        from ("kv_import", a `kv_transfer.KVImport`), the exporter its prompt's K/V goes to once its first
        token is drawn ("kv_export", a `kv_transfer.Exporter`; see `serving.disaggregation.kv_transfer`);
        their parts refuse what they cannot do before anything is queued.

        Raises `InvalidParameterError` (bad prompt or parameter, nothing queued),
        `ValueError` (request id in use) or `EngineDeadError`.
        """
        if self._error is not None:
            raise EngineDeadError("the engine loop has stopped") from self._error
        make = functools.partial(self.engine.make_request, request_id, prompt, params, cache_salt=cache_salt,
                                 priority=priority, part_args=part_args)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            if self._media_pool is None:
                self._media_pool = concurrent.futures.ThreadPoolExecutor(max_workers=MEDIA_WORKERS,
                                                                         thread_name_prefix="image-encode")
            req = await asyncio.get_running_loop().run_in_executor(self._media_pool, make)
        else:
            req = make()
        req.stream = True
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, queue)
            self._inbox.append(("add", req))
        self._wake.set()
        if self._error is not None:  # the loop died between the check above and now
            with self._lock:
                self._streams.pop(request_id, None)
            raise EngineDeadError("the engine loop has stopped") from self._error
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def fail_all(self, error: BaseException) -> int:
        """Ends every request in flight: its `generate` raises `error`, and the engine aborts it (freeing
        its pages). Returns how many there were. (A graceful drain's last word, `serving.api.drain`.)"""
        with self._lock:
            streams = list(self._streams.items())
        for request_id, (loop, queue) in streams:
            loop.call_soon_threadsafe(queue.put_nowait, error)
            self.abort(request_id)
        return len(streams)

    async def call(self, fn):
        """Runs `fn(engine)` on the engine thread between two steps (nothing else touches the engine while it
        runs) and returns its result, or raises what it raised: for operations on the engine as a whole
        (sleep, weight updates) that must not race a step."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._inbox.append(("call", (fn, future)))
        self._wake.set()
        if self._error is not None:
            raise EngineDeadError("the engine loop has stopped") from self._error
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Aborts a request (no-op if unknown or done); its pages are freed before the next step."""
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """Engine counters; requests still in the inbox count as waiting."""
        s = self.engine.stats()
        with self._lock:
            s.num_waiting += sum(1 for kind, _ in self._inbox if kind == "add")
        return s

    def add_stats_listener(self, fn) -> None:
        """`fn(IterationStats)` is called on the engine thread after every step."""
        self.engine.stats_log.add_listener(fn)

    # --- the engine thread -----------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, queue = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed
            pass

    def _drain_inbox(self) -> None:
        with self._lock:
            items, self._inbox = self._inbox, []
        for kind, x in items:
            if kind == "add":
                try:
                    self.engine.enqueue(x)
                except ValueError as e:
                    self._deliver(x.request_id, e)
            elif kind == "call":
                fn, future = x
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - the caller's to handle
                    future.set_exception(e)
            else:
                self.engine.abort_request(x)

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                engine = self.engine
                # Idle, or paused (a part holds the steps) with nothing in flight to finish: wait for the inbox.
                if not engine.has_output_ready() and (not engine.has_unfinished_requests() or engine.steps_held()):
                    self._wake.wait()
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # a bug or a device failure: fail every stream loudly
            log.exception("engine loop failed")
            self._error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                err = EngineDeadError(f"engine loop failed: {e!r}")
                err.__cause__ = e
                self._deliver(rid, err)
