"""Multi-host serving: process 0 schedules, every process runs the same device calls in the same order.

Process 0 (the leader) owns the request queue, the scheduler and the block
manager, exactly as in a single-process run. Its `ModelRunner` announces every
device call through `dispatch_hook` before dispatching it (a step's packed
`ibuf`/`fbuf`, token bitmask and `StepShape`; a page copy; a sampling-control
row; a program over the KV cache such as a KV export's gather or an import's
scatter; and calls other packages announce through `ModelRunner.announce`,
such as a draft model's drafting; warm-up is a run of those), and `Leader`
sends each announcement to the other processes over the key-value
`Channel`. The other processes (followers) run `Follower.follow`, which
replays each call on their own `ModelRunner`: the same jitted program with the
same global inputs, so the collectives inside line up. Only process 0 reads the
sampled ids (from its addressable shard) and turns them into outputs.

Besides device calls, the leader sends `end` (the operation the followers are
following is over: a warm-up, or one `LLM.generate`, whose outputs it carries),
`noop` (a keep-alive while it is idle, so a follower can tell an idle leader
from a stuck one) and `shutdown` (stop following; with an error message, exit
non-zero).
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from typing import Optional

import jax

from serving.cluster import distributed

log = logging.getLogger(__name__)


class LeaderFailed(RuntimeError):
    """Process 0's operation failed; the followers of that operation raise this with its message."""


class Shutdown(Exception):
    """Process 0 ended the run (`error` is None for a clean end)."""

    def __init__(self, error: Optional[str]):
        super().__init__(error or "process 0 shut the run down")
        self.error = error


class Leader:
    """Process 0's side: announces the runner's device calls and brackets operations for the followers."""

    is_leader = True

    def __init__(self, engine, channel: distributed.Channel, config: distributed.DistributedConfig,
                 watchdog: distributed.Watchdog):
        self.engine = engine
        self.channel = channel
        self.config = config
        self.keepalive_s = max(0.5, min(5.0, config.call_timeout_s / 4))
        self._last_send = time.monotonic()
        self._last_call = time.monotonic()
        self._calls = 0
        self._in_operation = 0  # > 0 while a warm-up or generate is under way
        self._closed = False
        self._lock = threading.Lock()
        engine.runner.set_dispatch_hook(self._announce)
        self._watchdog = watchdog
        watchdog.add(self._stalled)
        atexit.register(self._close)  # before the runtime's own exit barrier (atexit runs newest first)
        threading.Thread(target=self._keepalive, name="ridgeline-keepalive", daemon=True).start()

    # --- what the followers see ----------------------------------------------------------------
    def _send(self, message) -> None:
        with self._lock:
            if self._closed:
                return
            self.channel.send(message)
            self._last_send = time.monotonic()

    def _announce(self, kind: str, *arrays, **static) -> None:
        self._send(("call", kind, arrays, static))
        self._calls += 1
        self._last_call = time.monotonic()

    def _keepalive(self) -> None:
        while not self._closed:
            time.sleep(self.keepalive_s / 2)
            if time.monotonic() - self._last_send >= self.keepalive_s:
                self._send(("noop",))

    def _stalled(self) -> Optional[str]:
        """The engine has work, yet no device call went out for `call_timeout_s`: a step is stuck
        (a peer stopped taking part in its collectives) or this process is."""
        busy = self._in_operation > 0 or self.engine.has_unfinished_requests()
        quiet = time.monotonic() - self._last_call
        if busy and not self._closed and quiet > self.config.call_timeout_s:
            return (f"process 0: no device call could be issued for {quiet:.0f} s (call {self._calls} is stuck); "
                    f"another process is gone or hung")
        return None

    def _close(self) -> None:
        with self._lock:
            self._closed = True

    def end(self, result=None, error: Optional[str] = None) -> None:
        """Ends the operation the followers are following; they return `result` or raise `error`."""
        self._send(("end", result, error))

    def shutdown(self, error: Optional[str] = None) -> None:
        """Tells every follower to stop (non-zero exit when `error` is given); no message after it."""
        self._send(("shutdown", error))
        with self._lock:
            self._closed = True

    def watch(self, async_engine, watchdog: Optional[distributed.Watchdog] = None) -> None:
        """Server: when the engine loop dies, tell the followers (they exit non-zero) and end this process
        too, instead of serving 503s while the others wait forever."""
        def check() -> Optional[str]:
            error = getattr(async_engine, "_error", None)
            if error is None or self._closed:
                return None
            message = f"the engine loop on process 0 failed: {error!r}"
            self.shutdown(error=message)
            return message

        (watchdog or self._watchdog).add(check)

    # --- operations ----------------------------------------------------------------------------
    def operation(self):
        """Context for a warm-up or a generate: the stall check counts it as work in progress."""
        return _Operation(self)

    def failed(self, what: str, error: BaseException) -> None:
        """An operation raised on process 0: the followers' copy of it raises too. A failed device call
        (a peer gone in the middle of a collective) ends this process at once with the cause."""
        self.end(error=f"{what} failed on process 0: {error!r}")
        if isinstance(error, jax.errors.JaxRuntimeError):
            distributed.fatal(f"process 0: a device call failed during {what}, so another process is gone or "
                              f"broken: {error}")

    def warm_up(self) -> dict:
        with self.operation():
            try:
                info = self.engine.warm_up()
            except BaseException as e:
                self.failed("warm-up", e)
                raise
            self.end()
            return info


class _Operation:
    def __init__(self, leader: Leader):
        self.leader = leader

    def __enter__(self):
        self.leader._in_operation += 1
        self.leader._last_call = time.monotonic()

    def __exit__(self, *exc):
        self.leader._in_operation -= 1


class Follower:
    """Every other process: replays process 0's device calls on its own runner."""

    is_leader = False

    def __init__(self, engine, channel: distributed.Channel, config: distributed.DistributedConfig,
                 watchdog: distributed.Watchdog):
        self.engine = engine
        self.runner = engine.runner
        self.channel = channel
        self.config = config
        self.calls = 0
        self.calls_by_kind: dict[str, int] = {}
        self._deadline = distributed.Deadline(watchdog, config.call_timeout_s,
                                              "a process stopped taking part in the collectives")

    def _receive(self):
        try:
            return self.channel.receive(self.config.call_timeout_s)
        except TimeoutError:
            distributed.fatal(f"process {self.channel.process_id}: nothing from process 0 for "
                              f"{self.config.call_timeout_s:.0f} s (it sends a keep-alive every few seconds "
                              f"while idle): process 0 is gone or hung")
        except RuntimeError as e:
            distributed.fatal(f"process {self.channel.process_id}: process 0 is gone: {e}")

    def follow(self):
        """Replays calls until process 0 ends the current operation; returns what it sent with the end.

        Raises `LeaderFailed` when process 0's operation failed and `Shutdown` when it ended the run.
        """
        while True:
            message = self._receive()
            kind = message[0]
            if kind == "call":
                _, call, arrays, static = message
                what = f"process {self.channel.process_id}: device call {self.calls} ({call})"
                with self._deadline.guard(what):
                    try:
                        jax.block_until_ready(self.runner.replay(call, *arrays, **static))
                    except jax.errors.JaxRuntimeError as e:
                        distributed.fatal(f"{what} failed, so another process is gone or broken: {e}")
                self.calls += 1
                self.calls_by_kind[call] = self.calls_by_kind.get(call, 0) + 1
            elif kind == "end":
                _, result, error = message
                if error is not None:
                    raise LeaderFailed(error)
                return result
            elif kind == "shutdown":
                raise Shutdown(message[1])
            elif kind != "noop":
                raise RuntimeError(f"unknown message {kind!r} from process 0")

    def serve(self) -> int:
        """Follows until process 0 shuts the run down (the server's other processes); the exit code."""
        log.info("process %d: following process 0's device calls", self.channel.process_id)
        if threading.current_thread() is threading.main_thread():
            # Ctrl-C reaches every process of a local run; only process 0 decides when the run ends.
            signal.signal(signal.SIGINT, lambda *_: log.info("interrupted: waiting for process 0 to end the run"))
        while True:
            try:
                self.follow()
            except LeaderFailed as e:
                log.warning("process 0 reported: %s", e)
            except Shutdown as s:
                if s.error:
                    log.error("process 0 stopped the run: %s", s.error)
                    return distributed.PEER_FAILURE_EXIT_CODE
                log.info("process 0 ended the run after %d device calls", self.calls)
                return 0

    def warm_up(self) -> dict:
        from serving.core.model_runner import compilation_count

        count = getattr(self.runner, "compilation_count", compilation_count)
        t0 = time.perf_counter()
        before = count()
        self.follow()
        return {"seconds": time.perf_counter() - t0, "compiled": count() - before,
                "shapes": len(self.runner.buckets.all_shapes()) + 1}  # and the page copy


_attached = 0


def restore_shardings(layout, cfg):
    """The shardings to restore a checkpoint into (`model.checkpoint.load_checkpoint`) on this process.

    The layout's own, unless some weight would have no shard on this process (a layer of a
    pipeline stage on other processes' devices), which orbax cannot restore. Then every layer is
    restored tensor-split over the whole mesh (`layout.tensor_layout`) and `narrow_to_layout`
    keeps each on its stage's devices from the very same local buffers, so nothing crosses
    processes; while loading, each device holds the whole model's tensor shard.
    """
    if layout is None:
        return None
    target = layout.param_shardings(cfg)
    if all(s.addressable_devices for s in jax.tree.leaves(target)):
        return target
    everywhere = getattr(layout, "tensor_layout", None)
    if everywhere is None:
        raise ValueError("some weights have no shard on this process and the layout offers no tensor_layout "
                         "to restore them into")
    log.info("restoring every layer tensor-split over the whole mesh, then keeping each on its stage's devices")
    return everywhere.param_shardings(cfg)


def narrow_to_layout(params, layout, cfg):
    """Params restored into `restore_shardings`, on `layout`'s own shardings (no transfer)."""
    if layout is None:
        return params
    return jax.tree.map(_narrow, params, layout.param_shardings(cfg))


def _narrow(x: jax.Array, target) -> jax.Array:
    """`x` on `target`, a sharding over a subset of `x`'s devices that gives each of them the same
    index `x` does, built from `x`'s own local buffers (no transfer)."""
    if x.sharding == target:
        return x
    have = x.sharding.devices_indices_map(x.shape)
    want = target.devices_indices_map(x.shape)
    if any(have.get(d) != idx for d, idx in want.items()):
        raise ValueError(f"cannot narrow {x.sharding} to {target}: the shards differ")
    local = {s.device: s.data for s in x.addressable_shards}
    pieces = [local[d] for d in target.addressable_devices_indices_map(x.shape)]
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces, dtype=x.dtype)


def check_layout(layout) -> None:
    """In a multi-process run, the layout's mesh must hold devices of every process (each runs the
    whole program); raises a `ValueError` saying how many devices there are otherwise."""
    if jax.process_count() == 1:
        return
    mesh = getattr(layout, "mesh", None)
    if mesh is None or {d.process_index for d in mesh.devices.flat} != set(range(jax.process_count())):
        raise ValueError(f"a run over {jax.process_count()} processes needs a layout whose mesh spans the devices of "
                         f"every process ({jax.device_count()} in all, {jax.local_device_count()} per process): "
                         f"set tensor_parallel_size x pipeline_parallel_size to cover them")


def attach(engine):
    """The multi-host role of this process for `engine` (a `Leader` on process 0, a `Follower`
    elsewhere), or None when the run has one process. Every process must build the same engine."""
    if jax.process_count() == 1:
        return None
    check_layout(getattr(engine.runner, "layout", None))
    config = distributed.current() or distributed.DistributedConfig.from_env()
    global _attached
    _attached += 1  # every process builds the same engines in the same order: one channel each
    channel = distributed.Channel(distributed.coordination_client(), jax.process_index(), jax.process_count(),
                                  namespace=f"ridgeline/engine{_attached}")
    watchdog = distributed.Watchdog()
    role = Leader if jax.process_index() == 0 else Follower
    return role(engine, channel, config, watchdog)
