"""Step executables saved whole beside the persistent compilation cache, so a warm restart skips tracing.

JAX's persistent cache is keyed by the lowered program: to find an entry a
process must first trace and lower the step (about 1.2 s per bucket for the
embedded model on 2 CPU cores, against 0.2 s to load the executable). A
restart of the same server over the same model asks for the same buckets, so
the runner's own key of a bucket (`ModelRunner._program_key`: config, backend,
layout, bucket, argument shapes, dtypes and shardings) names the executable
well enough to load it without tracing, provided nothing else that shapes the
program changed. The file name therefore also hashes the JAX and jaxlib
versions, the devices, `XLA_FLAGS`, the JAX options that change lowering, and
the source of the packages the step is built from (`model`, `kernels_pallas`,
`sharding`, `serving/core`, `serving/features`): editing any of them starts a fresh set.

Entries are `jax.experimental.serialize_executable` payloads in
`<compilation cache dir>/steps/`, written atomically. Like the persistent
cache itself, the directory is trusted input (loading an entry runs the code in
it): keep it where only the server's user can write. A key whose text is not
stable across processes (an object printed with its address) is never stored.
An entry that fails to load is removed and the program compiles as usual, with
one warning naming it; a small program of `table.call` that loads but fails on its
first run does the same (an argument it donated excepted: that run cannot be
repeated). A multi-process run does not use the store.

Only an executable XLA compiled in the very `compile()` that produced it is
stored (`compile_to_store`): on XLA CPU an executable JAX loaded from its
persistent cache serializes without its kernels' object code, and such a
payload loads but fails on its first run ("Function wrapped_broadcast not
found"). JAX hands that executable back again, without asking XLA or its
cache, when the same function is lowered again with the same arguments in the
same process (a second engine over the same model, once the first is gone), so
a compile is told apart by whether it asked XLA at all, not only by whether
the persistent cache answered.

The runner's small programs (the KV pool's zeroing, page copies, the sampling
controls' row load) are stored the same way under their argument signature
(`.fn` entries, `table.call`): a warm start then lowers nothing at all, which
also spares it MLIR's start-up (about 0.4 s the first lowering of a process pays).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import time
from typing import Optional

import jax

from serving.compilation import compile_cache

log = logging.getLogger("ridgeline.warmup")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE_DIRS = ("model", "kernels_pallas", "sharding", os.path.join("serving", "core"), os.path.join("serving", "features"))
SUFFIX = ".step"
FUNCTION_SUFFIX = ".fn"  # the small programs of `table.call`
# JAX options that change what a traced step lowers to.
_LOWERING_OPTIONS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_numpy_rank_promotion",
                     "jax_default_prng_impl", "jax_threefry_partitionable")


@functools.cache
def source_digest() -> str:
    """A digest of every Python file the step program is built from."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for base, dirs, files in os.walk(os.path.join(ROOT, d)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(base, name)
                    h.update(os.path.relpath(path, ROOT).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _environment() -> str:
    import jaxlib

    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    options = [(name, str(getattr(jax.config, name, None))) for name in _LOWERING_OPTIONS]
    return repr((jax.__version__, jaxlib.__version__, devices, os.environ.get("XLA_FLAGS", ""), options,
                 source_digest()))


class ExecutableStore:
    """Saves and loads step executables by the runner's key of the bucket."""

    def __init__(self, directory: str, suffix: str = SUFFIX):
        self.directory = directory
        self.suffix = suffix  # SUFFIX for step executables, FUNCTION_SUFFIX for `table.call`'s

    def path(self, key) -> Optional[str]:
        text = repr(key)
        if " at 0x" in text:  # an object without a stable text: no name across processes
            return None
        digest = hashlib.sha256((text + "\0" + _environment()).encode()).hexdigest()
        return os.path.join(self.directory, digest + self.suffix)

    def load(self, key, what: Optional[str] = None):
        """The stored executable of `key`, or None; a load is counted as a cache hit (`compile_cache`).
        An entry that does not load is removed, with one warning naming `what` (the program)."""
        path = self.path(key)
        if path is None or not os.path.exists(path):
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            t = time.perf_counter()
            with open(path, "rb") as f:
                payload, in_tree, out_tree, device_ids = pickle.load(f)
            by_id = {d.id: d for d in jax.devices()}
            exe = deserialize_and_load(payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
            compile_cache.count_stored_load(time.perf_counter() - t)
            return exe
        except Exception as e:  # a torn or stale entry: compile instead, and forget it
            self.discard(key, what, e)
            return None

    def discard(self, key, what: Optional[str], error: Exception) -> None:
        """Removes the entry of `key`, which did not load or run, saying once which program compiles instead."""
        path = self.path(key)
        log.warning("stored executable of %s (%s) did not load (%s: %s); compiling it instead",
                    what or "a program", os.path.basename(path), type(error).__name__, error)
        try:
            os.remove(path)
        except OSError:
            pass

    def save(self, key, executable) -> None:
        path = self.path(key)
        if path is None:
            return
        from jax.experimental.serialize_executable import serialize

        try:
            devices = [d.id for d in executable.runtime_executable().local_devices()]  # what it runs on
            data = pickle.dumps((*serialize(executable), devices))
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # readers see the whole entry or none
        except Exception as e:  # e.g. an executable that cannot be serialized, a read-only directory
            log.warning("step executable not stored (%s)", e)


def compile_to_store(lowered, **options):
    """(`lowered.compile(**options)`, whether the store may keep it). On XLA CPU only an executable this
    call had XLA compile: not one JAX loaded from its persistent cache (serialized again, it loads but
    fails on its first run, "Function wrapped_broadcast not found": the kernels it was loaded with are
    not in the payload), nor one JAX's in-memory caches handed back from an earlier compile of the same
    lowering (which may have been such a load, and asked neither XLA nor the cache this time). JAX's
    cache has the program anyway; the store only skips the trace."""
    requests, hits = compile_cache.thread_compile_requests(), compile_cache.thread_cache_hits()
    exe = lowered.compile(**options)
    compiled_here = (compile_cache.thread_compile_requests() != requests
                     and compile_cache.thread_cache_hits() == hits)
    return exe, compiled_here or jax.default_backend() != "cpu"


def current(suffix: str = SUFFIX) -> Optional[ExecutableStore]:
    """The store beside the persistent compilation cache in use; None when that cache is off."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or jax.process_count() > 1:  # processes compile together; each sees only its devices
        return None
    return ExecutableStore(os.path.join(directory, "steps"), suffix)


def entries(directory: Optional[str], suffix: str = SUFFIX) -> int:
    """Step executables (or with `FUNCTION_SUFFIX`, `table.call`'s) stored under a compilation cache directory."""
    steps = os.path.join(directory or "", "steps")
    if not directory or not os.path.isdir(steps):
        return 0
    return sum(1 for name in os.listdir(steps) if name.endswith(suffix))
