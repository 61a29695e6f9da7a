"""KV pages beyond the device pool: the host tier of the prefix cache, and swap preemption.

The device prefix cache (`BlockManager`) keeps a freed page hittable until
allocation evicts it. With a host tier (`kv_offload_bytes`), an evicted page
is not lost: its K/V (with the scales of an int8 / fp8 cache) is copied to a
host page pool, indexed by the block's chained digest, and a later prefix hit
on it restores it into a free device page instead of recomputing it. Digests
carry the request's cache salt (`block_manager.salt_digest`), so tenants share
nothing here either: a block is found only by a request whose salt and tokens
produce its digest.

Timing, per engine step (`HostKVTier` is a `StepPart`):

* scheduling reports evictions and restores (`evicting`, `restoring`: the
  block manager's host hooks) and swaps (`Scheduler.on_preempt`);
* `after_schedule` (`flush`), before anything of the step writes the cache:
  one gather program copies every page leaving the device this step
  (`kv_pages.gather`), dispatched and not waited for; its result is moved to
  host memory asynchronously (`memory_kind="pinned_host"` where the backend
  offers it); then one scatter program writes the restored pages
  (`kv_pages.write`). The step, which reads the cache, runs after both; the
  scatter reads only the pages restored, so a restore waits for nothing else;
* `before_schedule` of the next step copies the arrived pages into the pool
  (`harvest`), where they become hittable.

Swap preemption (`preemption_mode`): a preempted sequence's full pages are
copied to the host (those not there yet) and pinned there until it runs again
(or ends: an abort frees the pages written for it); its resume finds them by
digest, on the device if they were not yet reused, else on the host. The
partial last page is recomputed, with the last token. `auto` swaps when moving
the pages (to the host and back, at the host<->device bandwidth measured at
warm-up) is cheaper than recomputing their tokens (at the step rate measured at
warm-up), and counts each choice.

The pool is bounded (`HostPagePool`: whole pages, least recently used evicted
first, pinned pages never); an offload that finds no room is dropped.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from kernels_pallas.pow2 import next_pow2, powers_of_two
from model.families import kv_bytes_per_token
from model.quant import SCALE_DTYPE, is_quantized_dtype
from serving.features import kv_pages
from serving.core.block_manager import NO_PAGE
from serving.core.engine_args import HOST_KV_TIER, PREEMPTION_MODES
from serving.core.sequence import SequenceStatus
from serving.core.step_parts import StepPart

# Buckets of the restore latency histogram (seconds).
RESTORE_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def offload_bytes(kv_offload_bytes: int, kv_offloading_size: Optional[float]) -> int:
    """The host tier's budget in bytes from the two spellings of the option (bytes, or vLLM's GiB)."""
    if kv_offload_bytes < 0 or (kv_offloading_size is not None and kv_offloading_size < 0):
        raise ValueError("kv_offload_bytes and kv_offloading_size must be >= 0")
    if kv_offloading_size is None:
        return kv_offload_bytes
    alias = int(kv_offloading_size * 2**30)
    if kv_offload_bytes and kv_offload_bytes != alias:
        raise ValueError(f"kv_offload_bytes={kv_offload_bytes} and kv_offloading_size={kv_offloading_size} GiB "
                         f"({alias} bytes) disagree; give one of them")
    return alias


@dataclasses.dataclass
class HostTierStats:
    """What the host tier holds and has moved (cumulative counters; `Engine.stats().host_kv`)."""

    capacity_pages: int
    capacity_bytes: int
    page_bytes: int
    used_pages: int = 0
    pages_offloaded: int = 0  # pages whose K/V arrived in the host pool
    pages_dropped: int = 0  # pages that found no room (every host page pinned)
    pages_restored: int = 0  # pages written back to the device from the pool
    restore_hit_tokens: int = 0  # prompt tokens served by restores
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    restore_latency_counts: list = dataclasses.field(default_factory=lambda: [0] * (len(RESTORE_LATENCY_BUCKETS) + 1))
    restore_latency_sum: float = 0.0
    bandwidth_bytes_per_s: Optional[float] = None  # measured host<->device copy rate
    recompute_tokens_per_s: Optional[float] = None  # measured step rate

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def restore_latency_bounds(self) -> tuple:
        """The upper bounds of `restore_latency_counts` (its last count is above them all)."""
        return RESTORE_LATENCY_BUCKETS

    def observe_restore(self, seconds: float) -> None:
        self.restore_latency_counts[bisect.bisect_left(RESTORE_LATENCY_BUCKETS, seconds)] += 1
        self.restore_latency_sum += seconds


class HostPagePool:
    """Whole KV pages in host memory, in the gather's layout (`[layers, 2, pages, page_size, kv_heads,
    head_dim]` in the cache's dtype, and `[layers, 2, pages, page_size, kv_heads]` fp32 scales for an int8 /
    fp8 cache), indexed by block digest, least recently used first.

    A page is `pending` from the moment a copy to it is dispatched until its bytes arrive (`fill`), and
    `pinned` while something will read it (a restore under way, a swapped-out sequence): neither kind is
    evicted or hit. The arrays take at most `capacity_bytes`."""

    def __init__(self, cfg, cache_dtype, page_size: int, capacity_bytes: int):
        self.page_bytes = kv_bytes_per_token(cfg, cache_dtype) * page_size  # scales included
        self.num_pages = capacity_bytes // self.page_bytes
        shape = (cfg.num_layers, 2, self.num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.data = np.zeros(shape, np.dtype(cache_dtype))  # zero pages are mapped lazily by the OS
        self.scale = np.zeros(shape[:-1], SCALE_DTYPE) if is_quantized_dtype(cache_dtype) else None
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # digest -> page, LRU first
        self.free = list(range(self.num_pages - 1, -1, -1))
        self.pending: set[bytes] = set()
        self.pins: collections.Counter = collections.Counter()

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)

    @property
    def num_used(self) -> int:
        return len(self.index)

    def holds(self, digest: bytes) -> bool:
        """Whether `digest`'s page is here and its bytes have arrived."""
        return digest in self.index and digest not in self.pending

    def touch(self, digest: bytes) -> None:
        self.index.move_to_end(digest)

    def reserve(self, digest: bytes) -> Optional[int]:
        """A page for `digest`'s bytes (pending until `fill`), evicting the least recently used page
        nobody pins; None when every page is pinned or pending (or `digest` has a page already)."""
        if digest in self.index:
            return None
        if not self.free:
            victim = next((d for d in self.index if not self.pins[d] and d not in self.pending), None)
            if victim is None:
                return None
            self.free.append(self.index.pop(victim))
        page = self.free.pop()
        self.index[digest] = page
        self.pending.add(digest)
        return page

    def fill(self, digests: list, pages: list, data: np.ndarray, scale: Optional[np.ndarray]) -> None:
        """Writes arrived bytes: `data[:, :, i]` (and `scale`) is page `pages[i]`, which holds `digests[i]`."""
        self.data[:, :, pages] = data
        if self.scale is not None:
            self.scale[:, :, pages] = scale
        self.pending.difference_update(digests)

    def read(self, digests: list) -> kv_pages.HostKV:
        """The pages of `digests` as per-token K/V (copies), in order."""
        pages = [self.index[d] for d in digests]
        for d in digests:
            self.touch(d)

        def tokens(x):  # [layers, 2, n, page_size, ...] -> [layers, 2, n * page_size, ...]
            x = x[:, :, pages]
            return x.reshape(x.shape[:2] + (x.shape[2] * x.shape[3],) + x.shape[4:])

        return kv_pages.HostKV(tokens(self.data), None if self.scale is None else tokens(self.scale))

    def pin(self, digest: bytes) -> None:
        self.pins[digest] += 1

    def unpin(self, digest: bytes) -> None:
        self.pins[digest] -= 1
        if self.pins[digest] <= 0:
            del self.pins[digest]

    def drop(self, digest: bytes) -> None:
        """Frees `digest`'s page unless something pins it or its bytes are on the way."""
        if digest in self.index and not self.pins[digest] and digest not in self.pending:
            self.free.append(self.index.pop(digest))

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent: every page is either free or holds
        exactly one digest, pending digests have pages, and the arrays stay within the budget's pages."""
        pages = list(self.index.values())
        assert len(set(pages)) == len(pages), "two digests share a host page"
        assert not set(pages) & set(self.free), "a host page is both used and free"
        assert len(pages) + len(self.free) == self.num_pages, "host pages lost"
        assert self.pending <= set(self.index), "a pending digest without a page"
        assert self.nbytes <= self.num_pages * self.page_bytes


@dataclasses.dataclass
class _Offload:
    """Pages on their way to the host: the gathered arrays (moving to host memory) and where they go."""

    digests: list
    pages: list  # host pages, None where the pool had no room
    data: object
    scale: object


def capacity_from_options(options) -> int:
    """The host tier's budget in bytes that the engine options ask for (0: no tier); a ValueError names
    the option when they do not fit together. `options`: a mapping or an `EngineConfig`."""
    get = options.get if isinstance(options, dict) else lambda name: getattr(options, name)
    capacity = offload_bytes(get("kv_offload_bytes"), get("kv_offloading_size"))
    if capacity == 0:
        if get("preemption_mode") != "recompute":
            raise ValueError(f"preemption_mode={get('preemption_mode')!r} swaps pages to the host tier: "
                             "set kv_offload_bytes (or kv_offloading_size)")
        return 0
    if not get("enable_prefix_caching"):
        raise ValueError("kv_offload_bytes: the host tier extends the prefix cache; it needs "
                         "enable_prefix_caching")
    return capacity


def for_engine(engine) -> Optional["HostKVTier"]:
    """The engine's host tier, when its options ask for one (`Engine(parts=...)` calls this once the
    engine's block manager, scheduler and runner exist)."""
    capacity = capacity_from_options(engine.config)
    if capacity == 0:
        return None
    if getattr(engine.runner, "_spans_processes", lambda: False)():
        raise ValueError("kv_offload_bytes: the host tier is not supported on a mesh spanning processes yet "
                         "(its copies to host memory are read on process 0 alone)")
    return HostKVTier(engine.block_manager, engine.scheduler, engine.runner, engine.cfg, engine.cache_dtype,
                      capacity, engine.config.preemption_mode)


class HostKVTier(StepPart):
    """The host tier and swap preemption, plugged into the block manager (`host`), the scheduler
    (`on_preempt`) and the engine step (a `StepPart`)."""

    serves = HOST_KV_TIER

    def __init__(self, block_manager, scheduler, runner, cfg, cache_dtype, capacity_bytes: int,
                 preemption_mode: str = "recompute", max_transfer_pages: int = 64):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.bm, self.scheduler, self.runner = block_manager, scheduler, runner
        self.page_size = block_manager.page_size
        self.pool = HostPagePool(cfg, cache_dtype, self.page_size, capacity_bytes)
        if self.pool.num_pages < 1:
            raise ValueError(f"kv_offload_bytes={capacity_bytes} holds no KV page of {self.pool.page_bytes} bytes")
        self.mode = preemption_mode
        # Pages one gather or scatter program moves (a power of two; more are split into several calls).
        self.max_transfer_pages = next_pow2(max(1, min(max_transfer_pages, block_manager.num_pages)))
        self.stats = HostTierStats(self.pool.num_pages, self.pool.nbytes, self.pool.page_bytes)
        self._to_host: dict[bytes, int] = {}  # digest -> device page, to copy out at the next flush
        self._restores: list[tuple[bytes, int]] = []  # (digest, device page) to restore at the next flush
        self._in_flight: list[_Offload] = []
        self._swapped: dict[int, tuple] = {}  # seq_id -> (seq, digests pinned, digests written for it)
        self._host_memory = _host_memory_kind()
        block_manager.host = self
        scheduler.on_preempt = self.on_preempt

    # --- the block manager's host hooks -----------------------------------------------------------
    def holds(self, digest: bytes) -> bool:
        return self.pool.holds(digest)

    def evicting(self, page: int, digest: bytes) -> None:
        """`page`, cached as `digest`, is leaving the device prefix cache: copy it out (unless the pool
        holds it already)."""
        if digest in self.pool.index:
            self.pool.touch(digest)
        else:
            self._to_host[digest] = page

    def restoring(self, digest: bytes, page: int) -> None:
        """`page` (fresh from the free queue) is to receive `digest`'s K/V before the step reads it."""
        self.pool.pin(digest)
        self._restores.append((digest, page))

    # --- swap preemption (the scheduler's on_preempt) -----------------------------------------------
    def on_preempt(self, seq) -> None:
        """Swaps `seq`'s full pages out (or lets them be recomputed), before the scheduler frees them."""
        table = self.bm.table(seq)
        full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.page_size, len(table))
        digests = self.bm.block_digests(seq, full) if self.bm.enable_prefix_caching else []
        to_copy = [d for d in digests if d not in self.pool.index]
        if not digests or not self._swap_is_cheaper(len(to_copy), len(digests)):
            self.stats.preemptions_recompute += 1
            return
        self.stats.preemptions_swap += 1
        self.bm.register_full_blocks(seq)  # so the pages are found again by digest
        previous = self._swapped.pop(seq.seq_id, None)  # (preempted again before its last swap was released)
        written = [] if previous is None else list(previous[2])
        for d in digests:
            self.pool.pin(d)
            page = self.bm.cached.get(d)
            if d not in self.pool.index and d not in self._to_host and page is not None and page != NO_PAGE:
                self._to_host[d] = page
                written.append(d)
        if previous is not None:  # after the new pins: nothing it shares is unpinned in between
            self._release_swap(previous, free=False)
        self._swapped[seq.seq_id] = (seq, digests, written)

    def _swap_is_cheaper(self, pages_out: int, pages_back: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        self._measure()
        bw, rate = self.stats.bandwidth_bytes_per_s, self.stats.recompute_tokens_per_s
        if not bw or not rate:
            return True
        swap_s = (pages_out + pages_back) * self.pool.page_bytes / bw
        recompute_s = pages_back * self.page_size / rate
        return swap_s < recompute_s

    def _release_swap(self, entry, free: bool) -> None:
        _, digests, written = entry
        for d in digests:
            self.pool.unpin(d)
        if free:  # the request ended while swapped out: its host pages go
            for d in written:
                self.pool.drop(d)

    # --- the step ---------------------------------------------------------------------------------
    def before_schedule(self, touched: dict, it) -> None:
        self.harvest()
        for sid, entry in list(self._swapped.items()):
            seq = entry[0]
            if seq.status is not SequenceStatus.WAITING:  # running again (its restores pinned what they read), or ended
                del self._swapped[sid]
                self._release_swap(entry, free=seq.status is SequenceStatus.FINISHED)
        self.stats.used_pages = self.pool.num_used

    def after_schedule(self, out) -> None:
        self.flush()

    def flush(self) -> None:
        """Dispatches the copies the scheduling decided, before anything writes the cache: one gather of
        the pages leaving the device (their move to host memory is started, not waited for), then one
        scatter of the pages restored."""
        to_host, self._to_host = list(self._to_host.items()), {}
        restores, self._restores = self._restores, []
        for i in range(0, len(to_host), self.max_transfer_pages):
            chunk = to_host[i:i + self.max_transfer_pages]
            data, scale = kv_pages.gather(self.runner, [p for _, p in chunk])
            self._in_flight.append(_Offload([d for d, _ in chunk], [], self._to_host_memory(data),
                                            None if scale is None else self._to_host_memory(scale)))
        if restores:
            self._restore(restores)
        for off in self._in_flight:  # host pages for the new offloads, after the restores read theirs
            if not off.pages:
                off.pages = [self.pool.reserve(d) for d in off.digests]
                self.stats.pages_dropped += sum(p is None for p in off.pages)

    def _restore(self, restores: list) -> None:
        t0 = time.perf_counter()
        for i in range(0, len(restores), self.max_transfer_pages):
            chunk = restores[i:i + self.max_transfer_pages]
            digests = [d for d, _ in chunk]
            kv = self.pool.read(digests)
            slots = kv_pages.token_slots([p for _, p in chunk], self.page_size, 0, len(chunk) * self.page_size)
            kv_pages.write(self.runner, slots, kv)
            for d in digests:
                self.pool.unpin(d)
            self.stats.bytes_to_device += len(chunk) * self.pool.page_bytes
        self.stats.pages_restored += len(restores)
        self.stats.restore_hit_tokens += len(restores) * self.page_size
        self.stats.observe_restore(time.perf_counter() - t0)

    def harvest(self) -> None:
        """Copies the pages that arrived into the pool, where they become hittable."""
        for off in self._in_flight:
            keep = [i for i, p in enumerate(off.pages) if p is not None]
            if keep:
                data = np.asarray(off.data)[:, :, keep]
                scale = None if off.scale is None else np.asarray(off.scale)[:, :, keep]
                self.pool.fill([off.digests[i] for i in keep], [off.pages[i] for i in keep], data, scale)
            self.stats.pages_offloaded += len(keep)
            self.stats.bytes_to_host += len(keep) * self.pool.page_bytes
        self._in_flight = []

    def _to_host_memory(self, x):
        """Starts `x`'s copy to host memory: into pinned host memory where the backend has it, else the
        runtime's own asynchronous copy."""
        if self._host_memory is not None:
            try:
                return jax.device_put(x, x.sharding.with_memory_kind(self._host_memory))
            except (ValueError, TypeError, NotImplementedError, jax.errors.JaxRuntimeError):
                self._host_memory = None
        x.copy_to_host_async()
        return x

    # --- warm-up and measurement ----------------------------------------------------------------
    def warm_up(self) -> dict:
        """Compiles the gather and the scatter for every transfer size, then measures the copy bandwidth
        and the step rate (`auto` preemption's cost model)."""
        t0 = time.perf_counter()
        before = kv_pages.compilation_count()
        pad = self.runner.num_pages * self.page_size
        sizes = powers_of_two(self.max_transfer_pages)
        for n in sizes:
            jax.block_until_ready(kv_pages.gather(self.runner, [0] * n))
            tokens = n * self.page_size
            kv_pages.write(self.runner, np.full(tokens, pad, np.int64),
                           kv_pages.HostKV.zeros(self.runner.cfg, self.runner.kv_dtype, tokens))
        jax.block_until_ready(self.runner.cache)
        self._measure(force=True)
        return {"seconds": time.perf_counter() - t0, "compiled": kv_pages.compilation_count() - before,
                "shapes": 2 * len(sizes)}

    def _measure(self, force: bool = False) -> None:
        """The host<->device copy rate (a gather of the largest transfer to host and its scatter back,
        timed) and the step's token rate (the largest compiled step, timed on an empty batch)."""
        if self.stats.bandwidth_bytes_per_s is not None and not force:
            return
        n = self.max_transfer_pages
        tokens = n * self.page_size
        pad = np.full(tokens, self.runner.num_pages * self.page_size, np.int64)  # every slot dropped
        zeros = kv_pages.HostKV.zeros(self.runner.cfg, self.runner.kv_dtype, tokens)

        def round_trip():
            data, scale = kv_pages.gather(self.runner, [0] * n)
            np.asarray(self._to_host_memory(data))
            if scale is not None:
                np.asarray(self._to_host_memory(scale))
            kv_pages.write(self.runner, pad, zeros)
            jax.block_until_ready(self.runner.cache)

        round_trip()  # compiled (if warm-up did not) and run once
        t0 = time.perf_counter()
        round_trip()
        self.stats.bandwidth_bytes_per_s = 2 * n * self.pool.page_bytes / (time.perf_counter() - t0)
        self.stats.recompute_tokens_per_s = _step_rate(self.runner)

    # --- other engine calls -------------------------------------------------------------------------
    def reset(self) -> int:
        """Forgets every host page nothing pins (the engine's `reset_prefix_cache`); returns how many."""
        self.harvest()
        n = 0
        for d in list(self.pool.index):
            before = self.pool.num_used
            self.pool.drop(d)
            n += before - self.pool.num_used
        self.stats.used_pages = self.pool.num_used
        return n

    def snapshot(self) -> HostTierStats:
        self.stats.used_pages = self.pool.num_used
        return dataclasses.replace(self.stats, restore_latency_counts=list(self.stats.restore_latency_counts))

    # --- the part's reports (`StepPart`) ---------------------------------------------------------------
    def engine_stats(self) -> dict:
        return {"host_kv": self.snapshot()}

    def describe(self) -> dict:
        return {"kv_offload_pages": self.pool.num_pages, "kv_offload_bytes": self.pool.nbytes}

    def reset_prefix_cache(self) -> None:
        self.reset()

    def check_invariants(self) -> None:
        """The pool's bookkeeping (`HostPagePool.check_invariants`); every pending page belongs to a copy
        under way; every page of a swapped-out sequence is pinned. Call between steps."""
        self.pool.check_invariants()
        on_the_way = {d for off in self._in_flight for d, p in zip(off.digests, off.pages) if p is not None}
        assert self.pool.pending == on_the_way, "a pending host page with no copy under way (or the reverse)"
        assert not self._restores, "restores left undone after the step"
        for _, digests, _ in self._swapped.values():
            assert all(self.pool.pins[d] > 0 for d in digests), "a swapped-out sequence's page is not pinned"


def _host_memory_kind() -> Optional[str]:
    """"pinned_host" when the default device can address it, else None."""
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # backends without memory kinds
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def _step_rate(runner) -> Optional[float]:
    """Tokens per second of the runner's largest step shape, timed on an empty batch (None if it cannot run
    one here, e.g. a pipeline's staged runner)."""
    feed = runner.feed  # the ids of a step still in flight, which the next step may read: kept
    try:
        shape = runner.warm_up_order()[-1]
        ibuf, fbuf, _ = shape.empty(runner.num_pages * runner.page_size)
        jax.block_until_ready(runner._run(ibuf, fbuf, shape))  # compiled: the warm-up ran it
        t0 = time.perf_counter()
        jax.block_until_ready(runner._run(ibuf, fbuf, shape))
        return shape.T / (time.perf_counter() - t0)
    except Exception:
        return None
    finally:
        runner.feed = feed

