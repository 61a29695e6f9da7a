"""The one table of compiled programs in a process, and the one way an executable gets into it.

Every program the runner runs is found by a key that says everything that
determines it: a step bucket by the runner's key (config, backend, layout,
bucket, and the shapes, dtypes and shardings of its arguments); a small
program beside the steps (the KV pool's zeroing, the page copies, a part's
state update) by its name and its arguments' signature (`call`). `get` looks
a key up, in order:

1. the table: the executables of this process, so that engines over the same
   model share them (as they shared `jit`'s cache). It holds them weakly;
   each runner keeps its own in a dict of its own (`held`), so an executable
   lives as long as some runner that uses it, and a process that builds many
   engines (a test suite, a notebook) keeps none that no runner uses;
2. the executables an earlier process saved whole (`executable_store`),
   loaded without tracing;
3. a compile: the caller's lowering, then XLA, which JAX's persistent
   compilation cache (`compile_cache`) may answer; saved whole for the next
   process where that is safe (`executable_store.compile_to_store`).

One thread compiles a key at a time; another that wants it meanwhile waits
for that compile and takes its result. What the steps' warm-up compiles, and
when, is `step_programs`' business; this module only says how.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import jax
import numpy as np

from serving.compilation import executable_store

_TABLE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # key -> jax.stages.Compiled
_LOCK = threading.Lock()  # the table is filled from the engine's thread and the warm-up's
_IN_PROGRESS: dict = {}  # key -> threading.Event set when its compile ends
_COUNTS = {"step": 0, "small": 0}  # executables compiled or loaded, by kind
_UNTRIED: set = set()  # keys of `call` loaded from the store that have not run yet (`_first_run`)


def compiled_total(kind: Optional[str] = None) -> int:
    """Executables compiled (or loaded from the store) so far in this process: of one kind ("step": step
    buckets; "small": `call`'s programs), or all. What `model_runner.compilation_count` adds to jit's caches."""
    return sum(_COUNTS.values()) if kind is None else _COUNTS[kind]


def holds(key) -> bool:
    """Whether this process holds an executable of `key`."""
    with _LOCK:
        return key in _TABLE


def keys() -> list:
    with _LOCK:
        return list(_TABLE.keys())


def put(key, exe, held: dict, kind: str = "step") -> None:
    """Makes `exe` the executable of `key` (a full compile replacing a quick one, a compile of its own)."""
    with _LOCK:
        _TABLE[key] = held[key] = exe
        _COUNTS[kind] += 1


def store(kind: str):
    """The store of whole executables for programs of `kind` ("step" or "small"), or None when there is none
    (no persistent cache, several processes: `executable_store.current`)."""
    return executable_store.current() if kind == "step" else executable_store.current(executable_store.FUNCTION_SUFFIX)


def compile_full(key, lowered, kind: str = "step"):
    """`lowered` compiled with the default options, and saved whole when the store may keep it."""
    exe, storable = executable_store.compile_to_store(lowered)
    kept = store(kind)
    if kept is not None and storable:
        kept.save(key, exe)
    return exe


def get(key, lower: Callable, held: dict, *, what: str, kind: str = "step", quick_options: Optional[dict] = None,
        on_compile: Optional[Callable] = None):
    """(executable of `key`, how): "found" (held by the caller or in the table), "loaded" from the store,
    "compiled" now, or "compiled quickly" with `quick_options` (compiler options; such an executable is
    not saved). `lower()` makes the `jax.stages.Lowered` program when a compile is needed; `on_compile()`
    is called just before (the warm-up counts compiles after it is done); `what` names the program in
    log lines. The executable is put in `held`, the caller's dict, which keeps it alive."""
    exe = held.get(key)
    if exe is not None:
        return exe, "found"
    while True:
        with _LOCK:
            exe = _TABLE.get(key)
            if exe is not None:
                held[key] = exe
                return exe, "found"
            pending = _IN_PROGRESS.get(key)
            if pending is None:
                _IN_PROGRESS[key] = threading.Event()
                break
        pending.wait()  # another thread is compiling it; then take its result
    try:
        saved = store(kind)
        exe, how = (None if saved is None else saved.load(key, what)), "loaded"
        if exe is not None and kind == "small":
            with _LOCK:
                _UNTRIED.add(key)
        if exe is None:
            if on_compile is not None:
                on_compile()
            lowered = lower()
            if quick_options:
                exe, how = lowered.compile(compiler_options=quick_options), "compiled quickly"
            else:
                exe, how = compile_full(key, lowered, kind), "compiled"
        put(key, exe, held, kind)
        return exe, how
    finally:
        with _LOCK:
            _IN_PROGRESS.pop(key).set()


# --- the small programs beside the steps ---------------------------------------------------------


def call(jitted, name: str, held: dict, *args):
    """`jitted(*args)` through the table, keyed by `name` and the arguments' signature (tree, shapes,
    dtypes, shardings), so that a warm start neither traces nor lowers the small programs beside the step
    (the KV pool's zeroing, page copies, the sampling controls' row load). `name` tells programs apart (an
    argument-free one's signature says nothing: its name must say what it builds). Without a store (no
    persistent cache, several processes) this is `jitted(*args)`. A stored executable that fails on its
    first run is dropped and the program compiled (`_first_run`)."""
    if store("small") is None:
        return jitted(*args)
    key = _key(name, args)
    exe, _ = get(key, lambda: jitted.lower(*args), held, what=_describe(name), kind="small")
    return _first_run(jitted, name, held, key, exe, args) if key in _UNTRIED else exe(*args)


def prepare(jitted, name: str, held: dict, *args):
    """The executable `call` runs for these arguments (arrays or `jax.ShapeDtypeStruct`s of them), loaded
    or compiled now if needed, without running it: a background warm-up prepares the small programs so.
    Needs the store (`store("small")`)."""
    return get(_key(name, args), lambda: jitted.lower(*args), held, what=_describe(name), kind="small")[0]


def _key(name: str, args) -> tuple:
    """`call`'s key of a program: its name and the arguments' signature (tree, shapes, dtypes, shardings)."""
    leaves, treedef = jax.tree.flatten(args)
    signature = (treedef, tuple((np.shape(x), np.dtype(getattr(x, "dtype", None) or np.result_type(x)).name,
                                 getattr(x, "sharding", None)) for x in leaves))
    return (name, signature)


def _describe(name: str) -> str:
    """The program's name for a log line: a name printed from a tuple (the KV pool's zeroing: its
    config, pages, ...) by its first field."""
    return name.split(",", 1)[0].lstrip("(").strip("'\"") if name.startswith("(") else name


def _first_run(jitted, name: str, held: dict, key, exe, args):
    """Runs an executable loaded from the store for the first time. Loading proves little: a payload
    without its kernels loads and fails here ("Function ... not found"). Then the entry is removed, with
    one warning, and the program compiled and run, so a start over a bad store still serves; unless the
    failed run consumed a donated argument, which nothing can give back."""
    try:
        out = exe(*args)
    except Exception as e:
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(args)):
            raise
        store("small").discard(key, _describe(name), e)
        exe = compile_full(key, jitted.lower(*args), "small")
        put(key, exe, held, "small")
        with _LOCK:
            _UNTRIED.discard(key)
        return exe(*args)
    with _LOCK:
        _UNTRIED.discard(key)
    return out
