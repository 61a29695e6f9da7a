"""Joining JAX's multi-controller runtime, and the pieces multi-host serving is built from.

Every process of a multi-host run calls `initialize()` before JAX touches a
device. It reads the settings from its arguments, then the environment
(`RIDGELINE_COORDINATOR_ADDRESS`, `RIDGELINE_NUM_PROCESSES`,
`RIDGELINE_PROCESS_ID`, which `serving.launch` fills in), and leaves whatever
is still unset to `jax.distributed`'s own cluster detection (SLURM, Open MPI,
Kubernetes, Cloud TPU) when `RIDGELINE_DISTRIBUTED=1` (or `auto=True`) asks
for a multi-host run without naming the details. With nothing set it does
nothing: a single-process run never starts the runtime.

Collectives are JAX's own: gloo between CPU processes (set here, before the
backend starts), NCCL between GPUs (JAX's default there). Besides the
collectives, the runtime's coordination service gives every process a
key-value store; `Channel` sends the leading process's device calls to the
others through it (docs/serving.md, "Multi-host", says why the store and not a
collective).

Failure bounds (docs/serving.md lists them): a process that never joins makes
the others fail after `init_timeout_s`; a process that dies is noticed by the
coordination service within `heartbeat_timeout_s` (at once when it is process
0, which runs the service), which ends every other process; a process that is
alive but stuck makes its peers end themselves through `Watchdog` after
`call_timeout_s`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import sys
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

ENV_COORDINATOR = "RIDGELINE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "RIDGELINE_NUM_PROCESSES"
ENV_PROCESS_ID = "RIDGELINE_PROCESS_ID"
ENV_AUTO = "RIDGELINE_DISTRIBUTED"
ENV_INIT_TIMEOUT = "RIDGELINE_DIST_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "RIDGELINE_DIST_HEARTBEAT_TIMEOUT_S"
ENV_CALL_TIMEOUT = "RIDGELINE_DIST_CALL_TIMEOUT_S"

PEER_FAILURE_EXIT_CODE = 1  # what a process exits with when a peer failed (the cause is logged first)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the coordination service is, who this process is, and how long to wait for peers."""

    coordinator_address: Optional[str] = None  # host:port of process 0's coordination service
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    auto: bool = False  # join even with nothing above set: jax.distributed detects the cluster
    init_timeout_s: int = 120  # every process must have joined by then
    heartbeat_timeout_s: int = 30  # a process silent this long is declared dead by the service
    call_timeout_s: float = 300.0  # longest wait on a live peer: a device call, or the next call to replay
    shutdown_timeout_s: int = 30  # how long a process ending cleanly waits for the others to end too

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "DistributedConfig":
        """The environment's settings, with every `overrides` value that is not None taking precedence."""
        env = os.environ if environ is None else environ

        def get(name, cast):
            value = env.get(name, "")
            if value == "":
                return None
            try:
                return cast(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a valid {cast.__name__}") from None

        found = dict(coordinator_address=get(ENV_COORDINATOR, str), num_processes=get(ENV_NUM_PROCESSES, int),
                     process_id=get(ENV_PROCESS_ID, int), auto=get(ENV_AUTO, _parse_bool),
                     init_timeout_s=get(ENV_INIT_TIMEOUT, int), heartbeat_timeout_s=get(ENV_HEARTBEAT_TIMEOUT, int),
                     call_timeout_s=get(ENV_CALL_TIMEOUT, float))
        found.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in found.items() if v is not None})

    @property
    def requested(self) -> bool:
        """Whether this asks for a multi-process run (one process named alone does not)."""
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.num_processes == 1:
            return False
        return self.auto or any(v is not None for v in (self.coordinator_address, self.num_processes,
                                                         self.process_id))


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


_joined: Optional[DistributedConfig] = None


def current() -> Optional[DistributedConfig]:
    """The settings this process joined with; None when it runs alone."""
    return _joined


def initialize(config: Optional[DistributedConfig] = None, **overrides) -> bool:
    """Joins the multi-controller runtime when the settings ask for it; True when this run has
    several processes. Safe to call again (later calls return what the first one did)."""
    global _joined
    import jax

    if _joined is not None:
        return jax.process_count() > 1
    config = config or DistributedConfig.from_env(**overrides)
    if not config.requested:
        return False
    if jax.distributed.is_initialized():  # joined by the caller itself: keep it, note the settings
        _joined = config
        return jax.process_count() > 1
    try:  # CPU processes need a collectives implementation; GPUs use NCCL whatever this says
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # an option a future jax renames must not stop GPU runs
        log.warning("could not select gloo CPU collectives: %s", e)
    who = "process ?" if config.process_id is None else f"process {config.process_id}"
    log.info("%s of %s joining the JAX distributed runtime at %s (every process must join within %d s)", who,
             config.num_processes or "?", config.coordinator_address or "<auto-detected>", config.init_timeout_s)
    # JAX itself ends a process whose peers do not all join in time; this is the bound if it ever waits on.
    give_up = threading.Timer(config.init_timeout_s + 10, fatal, [
        f"not every one of the {config.num_processes or '?'} processes joined within {config.init_timeout_s} s "
        f"(coordinator {config.coordinator_address or '<auto-detected>'}): a process did not join"])
    give_up.daemon = True
    give_up.start()
    try:
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                                   initialization_timeout=config.init_timeout_s,
                                   heartbeat_timeout_seconds=config.heartbeat_timeout_s,
                                   shutdown_timeout_seconds=config.shutdown_timeout_s)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise RuntimeError("a multi-process run must join the JAX distributed runtime before JAX uses any "
                               "device: call serving.cluster.distributed.initialize() first (before building params, "
                               "jax.devices(), ...)") from e
        raise
    finally:
        give_up.cancel()
    _joined = config
    atexit.register(shutdown)
    log.info("process %d of %d joined: %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return jax.process_count() > 1


def shutdown() -> None:
    """Leaves the runtime together with the others (a barrier bounded by `shutdown_timeout_s`).

    Runs at exit, so a process that is done waits for its peers instead of taking process 0's
    coordination service down under them (which would abort them). Safe to call more than once.
    """
    import jax

    if not jax.distributed.is_initialized():
        return
    try:
        jax.distributed.shutdown()
    except Exception as e:  # a peer already gone: nothing left to wait for
        log.warning("leaving the distributed runtime: %s", e)


def fatal(message: str, code: int = PEER_FAILURE_EXIT_CODE) -> None:
    """Logs `message` and ends the process at once: a collective waiting on a dead peer never
    returns, so nothing short of `os._exit` can be relied on to stop it."""
    try:
        if logging.getLogger().handlers:  # into the configured logs too (absl, a server's log file)
            log.critical("%s", message)
        sys.stderr.write(f"ridgeline: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


class Watchdog:
    """A daemon thread that ends the process (`fatal`) when any registered check reports a problem.

    A check returns None while things are fine, or the message to die with.
    """

    def __init__(self, name: str = "ridgeline-watchdog", interval_s: float = 0.5):
        self._checks: list[Callable[[], Optional[str]]] = []
        self._lock = threading.Lock()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def add(self, check: Callable[[], Optional[str]]) -> None:
        with self._lock:
            self._checks.append(check)

    def _loop(self) -> None:
        while True:
            time.sleep(self._interval)
            with self._lock:
                checks = list(self._checks)
            for check in checks:
                problem = check()
                if problem:
                    fatal(problem)


class Deadline:
    """A wait bounded by a `Watchdog`: `with deadline.guard("step 3"): ...` ends the process when the
    body has not finished within `timeout_s`."""

    def __init__(self, watchdog: Watchdog, timeout_s: float, why: str):
        self.timeout_s = timeout_s
        self._why = why
        self._what: Optional[str] = None
        self._since = 0.0
        watchdog.add(self._check)

    def _check(self) -> Optional[str]:
        what, since = self._what, self._since
        if what is not None and time.monotonic() - since > self.timeout_s:
            return f"{what} has not finished after {self.timeout_s:.0f} s: {self._why}"
        return None

    def guard(self, what: str) -> "_Guard":
        return _Guard(self, what)


class _Guard:
    def __init__(self, deadline: Deadline, what: str):
        self._d, self._what = deadline, what

    def __enter__(self):
        self._d._since = time.monotonic()
        self._d._what = self._what

    def __exit__(self, *exc):
        self._d._what = None


def coordination_client():
    """The runtime's client of the coordination service (its key-value store). JAX keeps it in
    `jax._src.distributed.global_state`; its own multihost utilities and orbax read it there too."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("the JAX distributed runtime is not initialized (call serving.cluster.distributed.initialize)")
    return client


class Channel:
    """Ordered messages from process 0 to every other process, over the coordination service's
    key-value store.

    Message i for process p is the key `ridgeline/msg/p/i`; the receiver deletes it once read, so
    the store holds only messages in flight. A message is any picklable object (the device calls
    carry numpy arrays); large ones are split into parts of `PART_BYTES`.
    """

    PART_BYTES = 1 << 20

    def __init__(self, client, process_id: int, num_processes: int, namespace: str = "ridgeline/msg"):
        self._client = client
        self.process_id = process_id
        self.num_processes = num_processes
        self._ns = namespace
        self._seq = 0
        self._lock = threading.Lock()

    def _key(self, process: int, seq: int) -> str:
        return f"{self._ns}/{process}/{seq}"

    def send(self, message) -> None:
        """(process 0) Sends `message` to every other process; never blocks on them."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        parts = [data[i:i + self.PART_BYTES] for i in range(0, len(data), self.PART_BYTES)] or [b""]
        with self._lock:
            seq = self._seq
            self._seq += 1
            for p in range(1, self.num_processes):
                key = self._key(p, seq)
                for j, part in enumerate(parts[1:], 1):  # the extra parts first: the head announces them
                    self._client.key_value_set_bytes(f"{key}.{j}", part)
                self._client.key_value_set_bytes(key, len(parts).to_bytes(4, "little") + parts[0])

    def receive(self, timeout_s: float):
        """(other processes) The next message; raises TimeoutError when none came within `timeout_s`,
        RuntimeError when the coordination service cannot be reached."""
        key = self._key(self.process_id, self._seq)
        try:
            head = self._client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
        except Exception as e:
            if "DEADLINE_EXCEEDED" in str(e) or "deadline" in str(e).lower():
                raise TimeoutError(f"no message {self._seq} from process 0 within {timeout_s:.0f} s") from None
            raise RuntimeError(f"lost the coordination service while waiting for message {self._seq} from "
                               f"process 0: {e}") from e
        n = int.from_bytes(head[:4], "little")
        parts = [head[4:]]
        for j in range(1, n):
            parts.append(self._client.blocking_key_value_get_bytes(f"{key}.{j}", 60_000))
            self._client.key_value_delete(f"{key}.{j}")
        self._client.key_value_delete(key)
        self._seq += 1
        return pickle.loads(b"".join(parts))
