"""Which LoRA adapters the engine serves, which are loaded in host memory, and which occupy device slots.

Three tiers, as vLLM has them:

* *registered*: every adapter a request may name (`--lora_modules`, `POST /v1/load_lora_adapter`,
  `LLM.generate(lora_request=...)`), name -> path. Registering reads and checks the adapter
  (`model.lora.load_adapter`), so a bad one is refused then, with its reason, never at first use.
* *host*: the adapters' matrices in host memory, an LRU of at most `max_cpu_loras`; an evicted one is
  read again from its path when a request needs it.
* *slots*: the `max_loras` device slots every step takes (`ModelRunner.load_lora`). An adapter gets a
  slot when a step schedules one of its requests; a slot is reused only when no running sequence
  uses its adapter, least recently used first. The scheduler never runs more than `max_loras`
  distinct adapters at once (`LoraAdmission`, the scheduler's gate), so a slot is always free or reusable.

Unloading an adapter that unfinished requests use is deferred: new requests can no longer name it,
and it leaves once its last request finishes (`after_step`). Requests count as users from the
moment `acquire` admits them until the engine `release`s them, so a request on its way to the
engine's queue holds its adapter too.

Thread-safety: registration, unloading and `acquire` run on the API's threads; slot assignment,
`release` and `after_step` on the engine's. One lock guards the tables; reading an adapter from disk
happens outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Iterable, Optional

import numpy as np

from model import lora as lora_model
from model.lora import LoraAdapter, LoraError
from serving.core.scheduler import AdmissionGate
from serving.core.step_parts import StepPart

# Steps a request waiting for a LoRA slot lets requests of the running adapters pass it (base-model
# requests always may: they hold no slot).
LORA_PASS_LIMIT = 32


class UnknownLoraError(LookupError):
    """A request or an unload named an adapter that is not registered (or is being unloaded)."""


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A request's adapter (`LLM.generate(..., lora_request=...)`), named as vLLM names it: a registered
    adapter by `lora_name`, or, with `lora_path`, one registered under that name on first use.
    `lora_int_id` is accepted for compatibility and not used (names identify adapters here)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: Optional[str] = None


def parse_lora_modules(spec) -> dict[str, str]:
    """`--lora_modules`: "name=path,name=path" (or a dict, or a list of "name=path") -> {name: path}."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = {}
    for item in items:
        name, sep, path = item.strip().partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: expected name=path, got {item!r}")
        if name in out:
            raise ValueError(f"lora_modules: adapter name {name!r} given twice")
        out[name] = path
    return out


class LoraAdmission(AdmissionGate):
    """The scheduler's gate for LoRA: a waiting request whose adapter would be one more than the `max_loras`
    device slots waits, keeping its place, while base-model requests (which hold no slot) and those of the
    adapters already running pass it; after `LORA_PASS_LIMIT` steps of waiting only base-model requests
    pass it, so the running adapters drain and a slot frees."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.waits: dict[int, int] = {}  # seq_id -> steps it has waited for a slot

    def needs(self, seq) -> bool:
        return seq.request.lora_name is not None

    def fits(self, seq, running) -> bool:
        name = seq.request.lora_name
        if name is None:
            return True
        active = {s.request.lora_name for s in running} - {None}
        return name in active or len(active) < self.max_loras

    def waited(self, seq) -> bool:
        waited = self.waits[seq.seq_id] = self.waits.get(seq.seq_id, 0) + 1
        return waited > LORA_PASS_LIMIT

    def forget(self, seq) -> None:
        self.waits.pop(seq.seq_id, None)


class LoraManager(StepPart):
    def __init__(self, cfg, runner, *, max_loras: int, max_lora_rank: int, max_cpu_loras: Optional[int] = None):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1 with LoRA")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        lora_model.check_model(cfg)
        self.cfg, self.runner = cfg, runner
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._lock = threading.Lock()
        self.registered: dict[str, str] = {}  # name -> path
        self.digests: dict[str, bytes] = {}  # name -> digest of the weights registered under it
        self.host: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()  # LRU, oldest first
        self.slots: list[Optional[tuple[str, bytes]]] = [None] * max_loras  # (name, digest) per slot
        self._slot_used: list[int] = [0] * max_loras  # last step each slot served (LRU)
        self.users: collections.Counter = collections.Counter()  # name -> unfinished requests
        self.unloading: set[str] = set()
        self.requests_total: collections.Counter = collections.Counter()  # name -> requests admitted
        self._step = 0

    # --- registration (any thread) -------------------------------------------------------------------
    def register(self, name: str, path: str) -> LoraAdapter:
        """Reads, checks and registers an adapter; `LoraError` says why one does not fit, ValueError names
        a name already in use."""
        if not isinstance(name, str) or not name:
            raise LoraError("lora_name must be a non-empty string")
        with self._lock:
            if name in self.registered:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = lora_model.load_adapter(path, self.cfg, self.max_lora_rank, name=name,
                                          dtype=np.dtype(self.cfg.jnp_dtype))
        with self._lock:
            if name in self.registered:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            self.registered[name] = path
            self.digests[name] = adapter.digest
            self._keep_on_host(adapter)
        return adapter

    def unregister(self, name: str) -> int:
        """Unloads an adapter: at once when no unfinished request uses it (returns 0), else once its last
        one finishes (returns how many it waits for). Unknown names raise `UnknownLoraError`."""
        with self._lock:
            if name not in self.registered or name in self.unloading:
                raise UnknownLoraError(f"no LoRA adapter named {name!r} is loaded")
            users = self.users[name]
            if users:
                self.unloading.add(name)
                return users
            self._drop(name)
            return 0

    def names(self) -> list[str]:
        with self._lock:
            return [n for n in self.registered if n not in self.unloading]

    def path(self, name: str) -> Optional[str]:
        return self.registered.get(name)

    # --- requests ------------------------------------------------------------------------------------
    def acquire(self, name: str) -> bytes:
        """A new request uses adapter `name`: returns the digest of its weights (what the request's
        prefix-cache pages are keyed by); `UnknownLoraError` when no such adapter can be used."""
        with self._lock:
            if name not in self.registered or name in self.unloading:
                raise UnknownLoraError(f"no LoRA adapter named {name!r} is loaded; loaded: "
                                       f"{sorted(n for n in self.registered if n not in self.unloading) or 'none'}")
            self.users[name] += 1
            self.requests_total[name] += 1
            return self.digests[name]

    def release(self, name: Optional[str]) -> None:
        """A request that used `name` left the engine (finished or aborted)."""
        if name is None:
            return
        with self._lock:
            self.users[name] -= 1
            if self.users[name] <= 0:
                del self.users[name]

    # --- slots (engine thread) -----------------------------------------------------------------------
    def assign(self, scheduled: Iterable, running: Iterable) -> dict[str, int]:
        """{adapter name: slot} for the scheduled items' adapters, loading each into a slot it lacks: a
        free slot, else the least recently used one that no running sequence's adapter holds."""
        self._step += 1
        wanted = {it.seq.request.lora_name for it in scheduled} - {None}
        if not wanted:
            return {}
        pinned = {s.request.lora_name for s in running} | wanted
        out = {}
        for name in sorted(wanted):
            with self._lock:
                key = (name, self.digests[name])
            slot = next((i for i, held in enumerate(self.slots) if held == key), None)
            if slot is None:
                with self._lock:  # empty, not pinned, or holding weights no longer registered under the name
                    free = [i for i, held in enumerate(self.slots) if held is None or held[0] not in pinned
                            or self.digests.get(held[0]) != held[1]]
                if not free:
                    raise RuntimeError(f"no LoRA slot free for {name!r}: {len(pinned)} adapters in use, "
                                       f"max_loras={self.max_loras}")
                slot = min(free, key=lambda i: (self.slots[i] is not None, self._slot_used[i]))
                self.runner.load_lora(slot, lora_model.slot_arrays(self._host_copy(name), self.cfg,
                                                                   self.max_lora_rank, np.float32))
                self.slots[slot] = key
            self._slot_used[slot] = self._step
            out[name] = slot
        return out

    def _host_copy(self, name: str) -> LoraAdapter:
        """The adapter's matrices, read again from its path when the host LRU dropped them."""
        with self._lock:
            adapter = self.host.get(name)
            if adapter is not None:
                self.host.move_to_end(name)
                return adapter
            path, digest = self.registered[name], self.digests[name]
        adapter = lora_model.load_adapter(path, self.cfg, self.max_lora_rank, name=name,
                                          dtype=np.dtype(self.cfg.jnp_dtype))
        if adapter.digest != digest:
            raise LoraError(f"LoRA adapter {name!r}: the files at {path!r} changed since it was loaded")
        with self._lock:
            self._keep_on_host(adapter)
        return adapter

    def _keep_on_host(self, adapter: LoraAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def _drop(self, name: str) -> None:
        self.registered.pop(name, None)
        self.digests.pop(name, None)
        self.host.pop(name, None)
        self.unloading.discard(name)
        # Its slot keeps the matrices until reused; no (name, digest) matches it any more.

    def after_step(self) -> None:
        """Finishes deferred unloads whose last request has left."""
        if not self.unloading:
            return
        with self._lock:
            for name in [n for n in self.unloading if not self.users[n]]:
                self._drop(name)

    # --- metrics -------------------------------------------------------------------------------------
    def info(self, running: Iterable, waiting: Iterable) -> dict:
        """vLLM's `lora_requests_info` labels: the adapters of running and of waiting requests (comma-
        separated names) and max_lora; plus the requests admitted per adapter."""
        run = sorted({s.request.lora_name for s in running} - {None})
        wait = sorted({s.request.lora_name for s in waiting} - {None})
        with self._lock:
            totals = dict(self.requests_total)
        return {"running_lora_adapters": ",".join(run), "waiting_lora_adapters": ",".join(wait),
                "max_lora": str(self.max_loras), "requests_total": totals}
