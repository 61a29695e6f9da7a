"""The step's compiled programs, one per bucket: compiled ahead of time, most of them in the background.

Why not let `jax.jit` compile each bucket on first use: a server that waits for
every bucket before it answers starts in minutes (one executable per (T, P)
bucket, 40-60 of them), and one that compiles on first use stalls a live
request for seconds. So the runner compiles each bucket explicitly
(`jit(...).lower(...).compile()`), keeps the executables here and calls them
directly, which lets startup be split:

* `warm_up(background=True)` compiles a *minimal set* first: the smallest
  step (a batch-1 decode) and the largest (which holds every step), and
  returns. The other buckets compile in a background thread, one at a time.
* Until a step's exact bucket is compiled, `shape_for` hands out the smallest
  compiled bucket that holds it (more padding, no waiting); padding rows and
  tokens are inert, so the step's results are the same. A bucket an earlier
  process saved whole (`executable_store`) is loaded on demand instead: that
  takes a fraction of a second, a padded step of a deep model on CPU seconds.
  The background thread leaves such buckets to load on first use (it counts
  them as ready), so a warm restart serves without loads competing with it.
* With `quick`, the smallest bucket (the batch-1 decode) is compiled with
  the platform's quick compiler options (`QUICK_COMPILE_OPTIONS`: on XLA
  CPU, LLVM at -O0), in about half the time; the background thread first
  recompiles it fully and swaps it in, then compiles the rest. The largest
  bucket always compiles fully: the steps padded into it while warm-up goes
  on are the expensive ones, and at -O0 a deep model's first prefill took
  twice as long. Only full compiles are saved whole (`executable_store`), so
  a warm restart loads full programs.
* `start_as_needed` (`LLM`'s default) compiles nothing up front: a thread
  waits for the buckets a call says it will need (`want`, from
  `serving.core.bucket_plan.expected_shapes`) and compiles those, while the
  call's steps pad into whichever compiled (or coming) bucket holds them
  cheaply (`bucket_plan.holds_cheaply`: at most about twice the work) and
  compile their own bucket only when none does. Buckets no call needs are
  not compiled while a call runs: on XLA CPU a compile takes the cores the
  steps run on. Buckets an earlier process saved whole load in the same
  thread as soon as it starts (`preload_stored`), so that no step waits for
  its load.
* Once no call has run for `FILL_AFTER_IDLE_SECONDS`, a second thread, at the
  lowest CPU priority, compiles the buckets steps were padded out of, the
  most padded first (`end_call`). Each is used from the next step that fits
  it and saved whole like any full compile, so a process's later calls, and
  the next process over the same store, run their steps in their own buckets:
  without it an `LLM` would pad the same steps into the same larger buckets
  for as long as it lives. A script that exits as soon as its last call
  returns starts no such compile, so its exit does not wait for one.
* A bucket nobody compiled yet (no warm-up: tests) compiles on first
  use, as `jit` would. After a warm-up such a compile is counted
  (`stats().compiles_after_ready`): it means a shape escaped the bucket set.
  `why(key)` is the one place that says why a program compiles: the fields
  of its key (named by the runner's `key_fields`) in which it differs from
  the closest executable this process holds; the warning of a compile after
  warm-up quotes it, and `recompile_reasons` keeps the last few.

Executables are found through the process's one table of programs
(`serving.compilation.table`), keyed by everything that determines the
program (config, backend, layout, bucket, and the shapes, dtypes and
shardings of params, cache and host inputs), so engines over the same model
share them; each `StepPrograms` keeps its own alive.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional

from serving.compilation import table


log = logging.getLogger("ridgeline.warmup")

# Compiler options of a quick compile, per platform (`jax.Device.platform`). XLA CPU at LLVM -O0:
# measured on the embedded model (2 cores, benchmarks/quick_compile.py), a bucket compiles in about
# half the time and its steps run at 0.5-0.65x speed, with the same tokens, until the full compile
# replaces it. Platforms without an entry compile fully from the start.
QUICK_COMPILE_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0}}


def _first_difference(new, old) -> str:
    """`new` against `old`: for two tuples of equal length the first element where they differ, for two
    dataclasses of one type the fields that differ, otherwise both values."""
    if dataclasses.is_dataclass(new) and type(new) is type(old):
        fields = [f.name for f in dataclasses.fields(new) if getattr(new, f.name) != getattr(old, f.name)]
        return ", ".join(f"{f}={getattr(new, f)!r} (closest compiled {getattr(old, f)!r})" for f in fields)
    if isinstance(new, tuple) and isinstance(old, tuple) and len(new) == len(old):
        for i, (a, b) in enumerate(zip(new, old)):
            if a != b:
                return f"element {i}: {_first_difference(a, b)}"
    return f"{new!r}, closest compiled {old!r}"


def _serve_wants(ref, wake: threading.Condition) -> None:
    """The thread of `StepPrograms.start_as_needed`: compiles each bucket calls want, in order, and when none
    waits loads the stored ones (`preload_stored`), until the programs stop or nothing refers to them any
    more (checked every few seconds while idle)."""
    programs = ref()
    if programs is not None:
        for work in programs._first:
            if not programs._stopping:
                work()
    while True:
        with wake:
            if programs is None or programs._stopping:
                return
            wanted = bool(programs._wanted)
            shape = programs._wanted[0] if wanted else programs._next_preload()
            if shape is None:
                programs = None  # while waiting, only the weak reference
                wake.wait(timeout=5.0)
                programs = ref()
                continue
        if wanted:
            programs._compile_wanted(shape)
        else:
            programs._compile(shape, programs._key(shape), on_demand=False)  # loads it from the store


# Under `start_as_needed`, how long no call must have run before the buckets steps were padded out of start
# compiling (`StepPrograms.end_call`). Long enough that a script's next call, or its exit, usually comes first
# (a process exits only after a compile under way ends), short enough that an interactive session's pause fills.
FILL_AFTER_IDLE_SECONDS = 2.0


def _lower_this_threads_priority() -> None:
    """The calling thread at the lowest CPU priority (Linux: a thread's own nice value), so that its compiles
    take only the cores' idle time. Elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _fill_when_idle(ref, wake: threading.Condition) -> None:
    """The thread of `StepPrograms.end_call`: compiles, one at a time and at the lowest priority, the buckets
    steps were padded out of, while no call runs; holds its programs only weakly while it waits."""
    _lower_this_threads_priority()
    programs = ref()
    while True:
        with wake:
            if programs is None or programs._stopping:
                return
            shape, wait = programs._next_fill()
            if shape is None:
                programs = None  # while waiting, only the weak reference
                wake.wait(timeout=wait)
                programs = ref()
                continue
            programs._filling = shape
        try:
            programs._compile_fill(shape)
        finally:
            with wake:
                programs._filling = None
                wake.notify_all()


@dataclasses.dataclass(frozen=True)
class WarmupStats:
    """Where warm-up stands, for `/health`, `/metrics` and the startup log."""

    total: int  # buckets in the warm-up set
    compiled: int  # of those, compiled (or found in the table)
    steps_in_larger_bucket: int  # steps run in a bigger bucket than their own, its own not compiled yet
    compiles_after_ready: int  # buckets compiled on demand after the minimal set was ready
    quick: int = 0  # of the compiled, buckets still running a quick compile (their full one is on its way)
    filled: int = 0  # buckets compiled while idle because steps had been padded out of them (`end_call`)

    @property
    def ready(self) -> bool:
        return self.compiled >= self.total and not self.quick


class StepPrograms:
    """The step executables of one runner and the warm-up that fills them.

    `lower(shape)` returns the `jax.stages.Lowered` step for a bucket (`StepShape`);
    `key(shape)` the table key of its executable.
    """

    def __init__(self, lower: Callable, key: Callable, platform: Optional[str] = None, key_fields: tuple = (),
                 holds_cheaply: Optional[Callable] = None):
        """`key_fields`: a name for each position of the tuples `key` returns (for `why`). `holds_cheaply(holder,
        shape)`: whether a step of `shape` may pad into `holder` under `start_as_needed`."""
        self._lower = lower
        self._holds_cheaply = holds_cheaply
        self._ready: set = set()  # buckets whose executable this runner holds (or, wanted, loads from the store)
        self._as_needed = False  # `start_as_needed`: pad only cheaply, compile what calls `want`
        self._wanted: list = []  # buckets a call asked for, compiled first by the thread
        self._wake = threading.Condition()
        self._key = key
        self._key_fields = key_fields
        self._quick_options = QUICK_COMPILE_OPTIONS.get(platform)
        self._quick: set = set()  # buckets whose executable is a quick compile, until the background's full one
        self._own: dict = {}  # key -> executable: what keeps this runner's programs alive
        self._stored: dict = {}  # shape -> whether `executable_store` holds it (checked once)
        self._warm_set: list = []  # every bucket warm-up was asked to compile
        self._compiled: set = set()  # buckets of `_warm_set` compiled
        self._warmed_up = False  # the minimal set is in: compiles on demand are now counted
        self._thread: Optional[threading.Thread] = None
        self._rest: list = []  # the buckets left to the background
        self._first: list = []  # callables the background thread runs before its compiles
        self._stopping = False
        self._calls = 0  # calls running (`begin_call` .. `end_call`)
        self._idle_since = time.monotonic()  # when the last call ended
        self._padded_out: dict = {}  # bucket -> steps padded out of it, not compiled yet (`start_as_needed`)
        self._filling = None  # the bucket the fill thread is compiling
        self._preload: list = []  # buckets to load from the store when no wanted compile waits
        self._fill_thread: Optional[threading.Thread] = None
        self.filled = 0
        self.steps_in_larger_bucket = 0
        self.compiles_after_ready = 0
        self.recompile_reasons: list[str] = []  # `why` of the last compiles after warm-up (at most 8)

    # --- the executables ------------------------------------------------------------------------
    def get(self, shape):
        """The executable of `shape`, compiled now if no one has (or waited for, if another thread is)."""
        key = self._key(shape)
        exe = self._own.get(key)
        if exe is None:
            exe, _ = self._compile(shape, key, on_demand=True)
            if shape in self._warm_set:
                self._compiled.add(shape)
        return exe

    def _compile(self, shape, key, on_demand: bool, quick: bool = False, lowered=None):
        """(executable, how): "found" in the table, "loaded" from the store or "compiled" now (with
        `quick` and quick options for this platform: "compiled quickly", and not saved), from
        `lowered` when the caller traced it already (`table.get`)."""
        def count_late_compile():
            if on_demand and self._warmed_up:
                self.compiles_after_ready += 1
                reason = self.why(key)
                self.recompile_reasons = (self.recompile_reasons + [reason])[-8:]
                log.warning("compiling step bucket T=%d, P=%d on demand after warm-up: %s", shape.T, shape.P, reason)

        exe, how = table.get(key, lambda: lowered or self._lower(shape), self._own,
                             what=f"step bucket T={shape.T}, P={shape.P}",
                             quick_options=self._quick_options if quick else None, on_compile=count_late_compile)
        if how == "compiled quickly":
            self._quick.add(shape)
        self._ready.add(shape)
        return exe, how

    def _replace_quick(self, shape, key) -> None:
        """Compiles a quickly compiled bucket fully and swaps it in (steps pick it up from the next one)."""
        table.put(key, table.compile_full(key, self._lower(shape)), self._own)
        self._quick.discard(shape)

    def _is_stored(self, shape) -> bool:
        """Whether an earlier process saved this bucket's executable (`executable_store`)."""
        found = self._stored.get(shape)
        if found is None:
            store = table.store("step")
            path = None if store is None else store.path(self._key(shape))
            found = self._stored[shape] = path is not None and os.path.exists(path)
        return found

    def why(self, key) -> str:
        """Why `key` needs a program of its own: how it differs from the closest key whose executable
        this process holds, field by field ("bucket: (T=64, S=8, P=4), closest compiled (T=32, S=8,
        P=4)"; for the argument signature, the first argument leaf that differs)."""
        known = [k for k in list(self._own) + table.keys() if len(k) == len(key)]
        if not known:
            return "the first step program of this process"
        if key in known:
            return "already compiled"

        def differing(other):
            return [i for i, (a, b) in enumerate(zip(key, other)) if a != b]

        closest = min(known, key=lambda k: len(differing(k)))
        parts = []
        for i in differing(closest):
            name = self._key_fields[i] if i < len(self._key_fields) else f"key field {i}"
            parts.append(f"{name}: {_first_difference(key[i], closest[i])}")
        return "; ".join(parts)

    def is_compiled(self, shape) -> bool:
        key = self._key(shape)
        return key in self._own or table.holds(key)

    # --- choosing a bucket ----------------------------------------------------------------------
    def shape_for(self, shape):
        """`shape`, or while warm-up is still compiling it, the smallest compiled bucket that holds it. Under
        `start_as_needed` only a bucket that holds it cheaply, compiled or asked for by a call (the step then
        waits for that compile, which is under way or due anyway); none: its own, compiled now."""
        if self._thread is None or shape in self._compiled or self.is_compiled(shape) or self._is_stored(shape):
            return shape  # (a stored executable loads on demand in a fraction of a second: no reason to pad)
        if self._as_needed:
            def fits(s):
                return self._holds_cheaply(s, shape)
            holders = [s for s in list(self._ready) if fits(s)] or [s for s in list(self._wanted) if fits(s)]
        else:
            holders = [s for s in list(self._compiled | self._ready) if s.T >= shape.T and s.S >= shape.S
                       and s.P >= shape.P]
        if not holders:
            return shape  # compiles on demand (counted once warm-up is done)
        holder = min(holders, key=lambda s: (s.T, s.P))
        if holder == shape:
            return shape  # a call asked for this very bucket: the step waits for its compile
        self.steps_in_larger_bucket += 1
        if self._as_needed:
            with self._wake:
                self._padded_out[shape] = self._padded_out.get(shape, 0) + 1
        return holder

    # --- warm-up --------------------------------------------------------------------------------
    def warm_up(self, shapes: list, *, background: bool, start_thread: bool = True, quick: bool = False) -> dict:
        """Compiles `shapes`: all of them now, or with `background` the minimal set now (the first and
        the last of `shapes`, which must be sorted smallest to largest) and the rest in a thread
        (`start_thread=False` leaves them for `start_background()`). With `quick` (and `background`)
        the smallest bucket is compiled quickly, and fully again first thing in the thread. Returns
        seconds, how many compiled now, how many of those quickly and how many were left to the
        background. (One at a time: XLA CPU's compile of one step already keeps two cores busy; two
        compiles at once took as long in all.)"""
        t0 = time.perf_counter()
        self._warm_set = list(shapes)
        first = [shapes[0], shapes[-1]] if background and len(shapes) > 2 else list(shapes)
        self._rest = [s for s in shapes if s not in first]
        compiled_before = table.compiled_total("step")
        self._compile_overlapped(first, t0, len(shapes), quick=quick and bool(self._rest))
        self._warmed_up = True
        info = {"seconds": time.perf_counter() - t0, "compiled": table.compiled_total("step") - compiled_before,
                "shapes": len(first), "background": len(self._rest), "quick": len(self._quick)}
        self._rest = sorted(self._quick, key=first.index) + self._rest  # their full compiles come first
        if self._rest:
            self._thread = threading.Thread(target=self._background, args=(len(shapes),), name="ridgeline-warmup",
                                            daemon=True)
            if start_thread:
                self._thread.start()
        return info

    def start_as_needed(self) -> None:
        """Starts a thread that compiles, one at a time, the buckets calls `want`; nothing compiles before
        this returns (`first_in_background` work runs first in the thread). Other buckets compile on first
        use, when no wanted one holds their step cheaply. On XLA CPU a compile takes the cores the steps run on, so compiling buckets nobody asked for beside
        (or between) a script's calls would slow it more than their steps' padding costs; on a GPU it would
        not, but the same few programs serve there too."""
        self._warm_set = []  # the buckets calls asked for (what `stats` counts)
        self._as_needed = True
        # The thread holds this object only weakly while it waits: an `LLM` a script lets go of frees its weights
        # and KV pool, and its thread ends.
        self._thread = threading.Thread(target=_serve_wants, args=(weakref.ref(self), self._wake),
                                        name="ridgeline-warmup", daemon=True)
        self._thread.start()

    def want(self, shapes: list) -> None:
        """Has the thread compile `shapes` next, in this order (a call's `bucket_plan.expected_shapes`)."""
        if not self._as_needed:
            return
        new = [s for s in shapes if not self.is_compiled(s) and not self._is_stored(s)]
        self._compiled.update(s for s in shapes if s not in new)
        self._ready.update(s for s in shapes if s not in new)  # (a stored one loads when a step first runs in it)
        with self._wake:
            self._warm_set += [s for s in shapes if s not in self._warm_set]
            self._wanted = new + [s for s in self._wanted if s not in new]
            self._wake.notify_all()

    def preload_stored(self, shapes: list) -> None:
        """Under `start_as_needed`: those of `shapes` an earlier process saved whole (`executable_store`)
        load in the thread, in this order, whenever no wanted compile waits, rather than inside the first
        step that runs in each (about 0.3 s apiece for the 125M model's steps on CPU, a step's host
        time many times over)."""
        with self._wake:
            self._preload += [s for s in shapes if s not in self._preload]
            self._wake.notify_all()

    def _next_preload(self):
        """The next bucket `preload_stored` left that is stored and not loaded yet, or None; under `_wake`."""
        while self._preload:
            shape = self._preload.pop(0)
            if self._is_stored(shape) and not self.is_compiled(shape):
                return shape
        return None

    def _compile_wanted(self, shape) -> None:
        """The thread's compile of a wanted bucket; then off the list (steps pick it from `_ready`)."""
        t = time.perf_counter()
        _, how = self._compile(shape, self._key(shape), on_demand=False)  # the table's when found
        with self._wake:
            self._wanted = [s for s in self._wanted if s != shape]
            self._wake.notify_all()
        if shape in self._warm_set:
            self._compiled.add(shape)
        log.info("step executable (T=%d, S=%d, P=%d) %s in %.1f s, as a call asked", shape.T, shape.S, shape.P,
                 how, time.perf_counter() - t)

    def begin_call(self) -> None:
        """A call starts running steps: no fill compile starts until it ends (one under way finishes)."""
        with self._wake:
            self._calls += 1

    def end_call(self) -> None:
        """A call's steps are done. Under `start_as_needed`, once no call has run for
        `FILL_AFTER_IDLE_SECONDS`, the buckets its steps were padded out of compile in a thread at the
        lowest CPU priority, the most padded first."""
        with self._wake:
            self._calls = max(0, self._calls - 1)
            if self._calls:
                return
            self._idle_since = time.monotonic()
            if self._padded_out and self._fill_thread is None and not self._stopping:
                self._fill_thread = threading.Thread(target=_fill_when_idle, args=(weakref.ref(self), self._wake),
                                                     name="ridgeline-fill", daemon=True)
                self._fill_thread.start()
            self._wake.notify_all()

    def _next_fill(self):
        """(the bucket to fill now, None) or (None, seconds to wait before asking again); under `_wake`."""
        if self._calls or not self._padded_out:
            return None, 5.0
        idle = time.monotonic() - self._idle_since
        if idle < FILL_AFTER_IDLE_SECONDS:
            return None, FILL_AFTER_IDLE_SECONDS - idle
        shape = max(self._padded_out, key=self._padded_out.get)
        del self._padded_out[shape]
        if self.is_compiled(shape) or self._is_stored(shape):
            return None, 0.0  # (asked again at once)
        return shape, 0.0

    def _compile_fill(self, shape) -> None:
        t = time.perf_counter()
        _, how = self._compile(shape, self._key(shape), on_demand=False)
        self.filled += 1
        log.info("step executable (T=%d, S=%d, P=%d) %s in %.1f s while idle: steps had been padded out of it",
                 shape.T, shape.S, shape.P, how, time.perf_counter() - t)

    def wait_filled(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every bucket steps were padded out of is compiled (or the programs stop); True then."""
        with self._wake:
            return self._wake.wait_for(lambda: self._stopping or (not self._padded_out and self._filling is None),
                                       timeout)

    def start_background(self) -> None:
        """Starts compiling the buckets a `warm_up(background=True, start_thread=False)` left."""
        self._thread.start()

    def first_in_background(self, work: Callable) -> None:
        """Has the background thread run `work` before its compiles (the runner's small programs, which
        compile in a fraction of a second each: serving need not wait for them)."""
        self._first.append(work)

    def _background(self, total: int) -> None:
        for work in self._first:
            if not self._stopping:
                work()
        self._compile_rest(self._rest, total)

    def _compile_rest(self, shapes: list, total: int) -> None:
        """The background thread's compiles, one at a time: quick compiles replaced, then the rest."""
        t0 = time.perf_counter()
        # Saved whole by an earlier process: each loads on first use in a fraction of a second, so loading
        # them now would only compete with the requests being served. They count as ready at once.
        stored = [s for s in shapes if s not in self._quick and not self.is_compiled(s) and self._is_stored(s)]
        self._compiled.update(stored)
        if stored:
            log.info("step executables: %d of %d stored by an earlier start, ready (each loads on first use)",
                     len(stored), total)
        shapes = [s for s in shapes if s not in stored]
        for i, shape in enumerate(shapes):
            if self._stopping:
                return
            t = time.perf_counter()
            key = self._key(shape)
            if shape in self._quick:
                self._replace_quick(shape, key)
                log.info("step executable (T=%d, P=%d) recompiled fully in %.1f s, replacing its quick compile",
                         shape.T, shape.P, time.perf_counter() - t)
                continue
            _, how = self._compile(shape, key, on_demand=False)  # the table's when found
            self._compiled.add(shape)
            elapsed = time.perf_counter() - t0
            left = len(shapes) - i - 1
            log.info("step executable %d/%d (T=%d, P=%d) %s in %.1f s; %.0f s elapsed%s", len(self._compiled),
                     total, shape.T, shape.P, how, time.perf_counter() - t, elapsed,
                     f", about {elapsed / (i + 1) * left:.0f} s left" if left else "")
        log.info("warm-up done: all %d step executables ready (%d steps ran in a larger bucket meanwhile)",
                 total, self.steps_in_larger_bucket)

    def _compile_overlapped(self, shapes: list, t0: float, total: int, quick: bool) -> None:
        """What warm-up compiles before serving, each bucket traced while the one before it compiles in
        a helper thread: XLA's compile releases the GIL and leaves part of a core free, which tracing
        (one core of Python) takes. Measured on the embedded model's two minimal buckets, 2 CPU cores:
        6.1 s instead of 7.0 s one after the other."""
        def finish(i, shape, t, compiled):
            how = compiled.result()[1]
            self._compiled.add(shape)
            elapsed = time.perf_counter() - t0
            left = len(shapes) - i - 1
            log.info("step executable %d/%d (T=%d, P=%d) %s in %.1f s; %.0f s elapsed%s", len(self._compiled), total,
                     shape.T, shape.P, how, time.perf_counter() - t, elapsed,
                     f", about {elapsed / (i + 1) * left:.0f} s left" if left else "")

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ridgeline-compile") as helper:
            in_flight = None  # (i, shape, start, future): at most one compile runs while the next is traced
            for i, shape in enumerate(shapes):
                t = time.perf_counter()
                key = self._key(shape)
                lowered = None if self.is_compiled(shape) or self._is_stored(shape) else self._lower(shape)
                if in_flight is not None:
                    finish(*in_flight)
                # Only the batch-1 decode compiles quickly: its steps stay cheap at -O0 at any depth, while
                # steps padded into the largest bucket are the costly ones (below).
                in_flight = (i, shape, t, helper.submit(self._compile, shape, key, False, quick and i == 0, lowered))
            if in_flight is not None:
                finish(*in_flight)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the background compiles end (under `start_as_needed`: those asked for so far); True
        when none is left."""
        if self._as_needed:
            with self._wake:
                self._wake.wait_for(lambda: not self._wanted or self._stopping, timeout)
            return self.stats().ready
        if self._thread is not None:
            if self._thread.ident is not None:  # started
                self._thread.join(timeout)
        return self.stats().ready

    def stop(self, timeout: float = 120.0) -> None:
        """Ends the background compiles after the one under way (a process should not exit mid-compile)."""
        self._stopping = True
        with self._wake:
            self._wake.notify_all()
        for thread in (self._thread, self._fill_thread):
            if thread is not None and thread.ident is not None:
                thread.join(timeout)

    def stats(self) -> WarmupStats:
        return WarmupStats(total=len(self._warm_set), compiled=len(self._compiled),
                           steps_in_larger_bucket=self.steps_in_larger_bucket,
                           compiles_after_ready=self.compiles_after_ready, quick=len(self._quick),
                           filled=self.filled)
