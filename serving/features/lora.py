"""LoRA adapters as a step part: which adapters the engine serves, which are loaded in host memory, which
occupy device slots, and how a step's tokens run with theirs.

Three tiers, as vLLM has them:

* *registered*: every adapter a request may name (`--lora_modules`, `POST /v1/load_lora_adapter`,
  `LLM.generate(lora_request=...)`), name -> path. Registering reads and checks the adapter
  (`model.lora.load_adapter`), so a bad one is refused then, with its reason, never at first use.
* *host*: the adapters' matrices in host memory, an LRU of at most `max_cpu_loras`; an evicted one is
  read again from its path when a request needs it.
* *slots*: the `max_loras` device slots every step takes, the part's weight state
  (`StepPart.weight_state`, written by `write_slot_jit` through `ModelRunner.update_part_state`). An
  adapter gets a slot when a step schedules one of its requests; a slot is reused only when no running
  sequence uses its adapter, least recently used first. The scheduler never runs more than `max_loras`
  distinct adapters at once (`LoraAdmission`, the scheduler's gate), so a slot is always free or reusable.

Inside the step each token's slot (the per-token field `lora_slot`, -1 for the base model) picks its
adapter in every target projection (`model.lora.attach`; a pipeline layout attaches each stage's
layers itself, `sharding.pipeline`), so one step mixes base-model rows and up to `max_loras` adapters.
A request names its adapter as the request argument `lora_name` (`Engine.make_request(part_args=...)`);
its prefix-cache pages are keyed by the adapter's weights too.

Unloading an adapter that unfinished requests use is deferred: new requests can no longer name it,
and it leaves once its last request finishes (`after_step`). Requests count as users from the
moment `admit` acquires their adapter until they `leave` the engine, so a request on its way to the
engine's queue holds its adapter too.

Thread-safety: registration, unloading and `acquire` run on the API's threads; slot assignment,
`release` and `after_step` on the engine's. One lock guards the tables; reading an adapter from disk
happens outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Iterable, NamedTuple, Optional

import jax
import numpy as np

from model import lora as lora_model
from model.lora import LoraAdapter, LoraError
from serving.core import engine_args, step_parts
from serving.core.block_manager import adapter_digest
from serving.core.input_batch import TokenField
from serving.core.sampling_params import InvalidParameterError
from serving.core.scheduler import AdmissionGate
from serving.core.step_parts import StepPart

KEY = "lora"  # the part's entry of `Request.part_state`: the request's `Adapter`
ARG = "lora_name"  # the request argument naming the adapter (`Request.part_args`)
FIELD = "lora_slot"  # the per-token field of the packed step: the token's slot, -1 for the base model

# Steps a request waiting for a LoRA slot lets requests of the running adapters pass it (base-model
# requests always may: they hold no slot).
LORA_PASS_LIMIT = 32


class UnknownLoraError(LookupError):
    """A request or an unload named an adapter that is not registered (or is being unloaded)."""


class Adapter(NamedTuple):
    """The adapter a request runs with: its name and the digest of its weights when the request was admitted."""

    name: str
    digest: bytes


def request_adapter(request) -> Optional[Adapter]:
    """The adapter `request` runs with (None: the base model)."""
    return request.part_state.get(KEY)


def adapter_name(seq) -> Optional[str]:
    """The adapter name of a sequence's request (None: the base model)."""
    adapter = seq.request.part_state.get(KEY)
    return None if adapter is None else adapter.name


# Writes one slot (a traced index, so any slot, any adapter: one program); the contents come as the leaves
# of `model.lora.slot_arrays` in the slots' tree order. Not donated: with overlapped scheduling the step
# still in flight may read the slot being replaced, and keeps the arrays it was given.
@step_parts.state_program
@jax.jit
def write_slot_jit(slots, slot, *contents):
    return lora_model.write_slot(slots, slot, jax.tree.unflatten(jax.tree.structure(slots), list(contents)))


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
        return adapter_name(seq) is not None

    def fits(self, seq, running) -> bool:
        name = adapter_name(seq)
        if name is None:
            return True
        active = {adapter_name(s) for s in running} - {None}
        return name in active or len(active) < self.max_loras

    def waited(self, seq) -> bool:
        waited = self.waits[seq.seq_id] = self.waits.get(seq.seq_id, 0) + 1
        return waited > LORA_PASS_LIMIT

    def forget(self, seq) -> None:
        self.waits.pop(seq.seq_id, None)


class LoraManager(StepPart):
    """The LoRA part (see the module's docstring): built from the options before the engine
    (`serving.features.build_parts`), it adds the adapter slots to every step the runner compiles."""

    takes_args = (ARG,)
    serves = engine_args.LORA

    def __init__(self, cfg, *, max_loras: int, max_lora_rank: int, max_cpu_loras: Optional[int] = None):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1 with LoRA")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        lora_model.check_model(cfg)
        self.cfg = cfg  # the engine's own once it is attached (its compute dtype)
        # The engine, weakly: the part is a static argument of the step program, so JAX's tracing cache holds it
        # past the engine's life, and a strong reference would keep the runner's weights and KV pool alive.
        self._engine = lambda: None
        self._step_slots: dict[str, int] = {}  # adapter name -> slot, of the step being packed
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

    # --- the engine and its requests ----------------------------------------------------------------
    def attach(self, engine) -> None:
        self.cfg, self._engine = engine.cfg, weakref.ref(engine)

    def gate(self):
        return LoraAdmission(self.max_loras)

    def admit(self, request) -> None:
        """Acquires the adapter the request names (`lora_name`), keying its prefix-cache pages by the adapter's
        weights; refuses an adapter that is not loaded, naming `lora_request`."""
        name = request.part_args.get(ARG)
        if name is None:
            return
        try:
            digest = self.acquire(name)
        except UnknownLoraError as e:
            raise InvalidParameterError("lora_request", f"lora_request: {e}") from None
        request.part_state[KEY] = Adapter(name, digest)
        request.hash_root = adapter_digest(request.hash_root, digest)

    def leave(self, request) -> None:
        adapter = request.part_state.pop(KEY, None)
        if adapter is not None:
            self.release(adapter.name)

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
    def after_schedule(self, out) -> None:
        engine = self._engine()
        self._step_slots = self.assign(out.scheduled, engine.scheduler.running if engine is not None else ())

    def pack(self, batch) -> None:
        """Each scheduled token of an adapter's request carries the adapter's slot (`lora_slot`)."""
        if not self._step_slots:
            return
        field = batch.views()[FIELD]
        for seq, first, _, n in batch.token_spans:
            name = adapter_name(seq)
            if name is not None:
                field[first:first + n] = self._step_slots[name]

    def assign(self, scheduled: Iterable, running: Iterable) -> dict[str, int]:
        """{adapter name: slot} for the scheduled items' adapters, loading each into a slot it lacks: a
        free slot, else the least recently used one that no running sequence's adapter holds."""
        self._step += 1
        wanted = {adapter_name(it.seq) for it in scheduled} - {None}
        if not wanted:
            return {}
        pinned = {adapter_name(s) for s in running} | wanted
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
                self._load(slot, self._host_copy(name))
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

    # --- the device slots ----------------------------------------------------------------------------
    def _slot_contents(self, adapter: Optional[LoraAdapter]) -> list:
        """One slot's contents (`model.lora.slot_arrays`, in the compute dtype) as `write_slot_jit`'s leaves."""
        contents = lora_model.slot_arrays(adapter, self.cfg, self.max_lora_rank, np.float32)
        return [np.asarray(x, self.cfg.jnp_dtype) for x in jax.tree.leaves(contents)]

    def _load(self, slot: int, adapter: Optional[LoraAdapter]) -> None:
        """Writes an adapter (None: zeros) into a device slot before the next step reads it."""
        self._engine().runner.update_part_state(self, write_slot_jit, np.int32(slot), *self._slot_contents(adapter))

    def token_fields(self) -> tuple:
        return (TokenField(FIELD, fill=-1),)

    def weight_state(self, cfg, params, layout):
        """Every slot empty (all zeros), each array sharded like its base weight (a pipeline layout stages
        them like the layers)."""
        self.cfg = cfg
        decl = lora_model.declare_slots(cfg, self.max_loras, self.max_lora_rank, cfg.jnp_dtype)
        if hasattr(layout, "stage_lora_slots"):
            decl, shardings = layout.stage_lora_slots(cfg, params, decl)
        else:
            shardings = lora_model.slot_shardings(params, decl)
            if shardings is None:
                shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), decl)
        return lora_model.zeros_like_tree(decl, shardings)

    def apply_to_weights(self, state, views, params, layout):
        if hasattr(layout, "forward"):  # pipeline stages: the layout attaches each stage's layers
            return params, {"lora": (state, views[FIELD], self.max_lora_rank)}
        return lora_model.attach(params, state, views[FIELD], self.max_lora_rank), {}

    def state_programs(self) -> tuple:
        if self._empty_slot is None:  # (asked for again at warm-up: made once)
            self._empty_slot = (np.int32(0), *self._slot_contents(None))  # into slot 0, which nothing holds yet
        return ((write_slot_jit, "write-lora-slot", self._empty_slot),)

    _empty_slot = None

    def program_key(self):
        return ("lora", self.max_loras, self.max_lora_rank)

    # --- metrics -------------------------------------------------------------------------------------
    def engine_stats(self) -> dict:
        engine = self._engine()
        if engine is None:
            return {}
        return {"lora": self.info(list(engine.scheduler.running), list(engine.scheduler.waiting))}

    def info(self, running: Iterable, waiting: Iterable) -> dict:
        """vLLM's `lora_requests_info` labels: the adapters of running and of waiting requests (comma-
        separated names) and max_lora; plus the requests admitted per adapter."""
        run = sorted({adapter_name(s) for s in running} - {None})
        wait = sorted({adapter_name(s) for s in waiting} - {None})
        with self._lock:
            totals = dict(self.requests_total)
        return {"running_lora_adapters": ",".join(run), "waiting_lora_adapters": ",".join(wait),
                "max_lora": str(self.max_loras), "requests_total": totals}
