"""JAX's persistent compilation cache, on by default, and counters that say what startup compiled.

Warm-up compiles one executable per step shape; on a 2-core CPU that is
minutes, on a GPU tens of seconds. With the persistent cache a second start
with the same model shape, buckets, jax version and flags loads every
executable from disk instead (JAX still traces and lowers each shape, which is
cheap; only XLA's compile is skipped).

Where the cache lives, in order of precedence:

1. an explicit directory (`LLM(compilation_cache_dir=...)`, the server's
   `--compilation_cache_dir`);
2. the environment variable `RIDGELINE_COMPILATION_CACHE_DIR`;
3. a directory already configured in JAX itself (`JAX_COMPILATION_CACHE_DIR`
   or `jax.config`), left as it is;
4. `$XDG_CACHE_HOME/ridgeline/jax`, i.e. `~/.cache/ridgeline/jax`.

An empty string at step 1 or 2 turns the cache off. The setting is
process-wide (it is JAX's): the last `enable()` wins.

JAX by default skips executables that compiled in under a second, which would
leave out nearly every step shape of a small model on CPU; `enable()` drops
that threshold and the minimum entry size so every executable is written.

The cache is trusted input (it holds executables): keep it in a directory only
you can write.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Optional

import jax

log = logging.getLogger(__name__)

ENV_VAR = "RIDGELINE_COMPILATION_CACHE_DIR"

# Events JAX records (jax._src.monitoring). The backend-compile duration event
# wraps every request for an XLA executable, whether it is then compiled or
# read from the persistent cache; a hit also records `_HIT_EVENT`.
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_WRITE_EVENT = "/jax/compilation_cache/cache_misses"  # recorded when a fresh executable is written


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ridgeline", "jax")


def resolve_cache_dir(directory: Optional[str] = None) -> Optional[str]:
    """The directory the cache should use (None: off), following the precedence in the module docstring."""
    if directory is None:
        directory = os.environ.get(ENV_VAR)
    if directory is None:
        configured = jax.config.jax_compilation_cache_dir
        directory = configured if configured else default_cache_dir()
    if not directory:
        return None
    return os.path.abspath(os.path.expanduser(directory))


_lock = threading.Lock()


def enable(directory: Optional[str] = None) -> Optional[str]:
    """Points JAX's persistent compilation cache at `directory` (see `resolve_cache_dir`); returns the
    directory in use, or None when the cache is off. Safe to call again with another directory."""
    from jax.experimental.compilation_cache import compilation_cache as jax_cc

    path = resolve_cache_dir(directory)
    _counters.install()
    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if path is not None:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:  # a read-only home must not stop a server from starting
                log.warning("compilation cache disabled: cannot create %s (%s)", path, e)
                path = None
        if current != path:
            jax.config.update("jax_compilation_cache_dir", path)
            jax_cc.reset_cache()  # JAX opens its cache once; make it reopen at the new path
        if path is not None:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def cache_entries(directory: Optional[str]) -> int:
    """Executables stored in a cache directory."""
    if not directory or not os.path.isdir(directory):
        return 0
    return sum(1 for name in os.listdir(directory) if name.endswith("-cache"))


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """Process-wide totals since the counters were installed; subtract two to get what happened between."""

    requests: int = 0  # executables asked of XLA (compiled or loaded from the persistent cache)
    cache_hits: int = 0  # of those, loaded from the persistent cache
    cache_writes: int = 0  # freshly compiled executables written to the cache
    seconds: float = 0.0  # time spent in those requests

    @property
    def compiled(self) -> int:
        """Executables XLA actually compiled."""
        return self.requests - self.cache_hits

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.requests - other.requests, self.cache_hits - other.cache_hits,
                             self.cache_writes - other.cache_writes, self.seconds - other.seconds)


class _Counters:
    """Listeners on JAX's monitoring events, registered once per process (JAX keeps listeners forever)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._installed = False
        self._requests = self._hits = self._writes = 0
        self._seconds = 0.0
        self._thread = threading.local()  # this thread's requests and hits (a compile's listeners run on its thread)

    def install(self) -> None:
        from jax._src import monitoring

        with self._lock:
            if self._installed:
                return
            self._installed = True
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **_kwargs) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            self._thread.requests = getattr(self._thread, "requests", 0) + 1
            with self._lock:
                self._requests += 1
                self._seconds += duration

    def _on_event(self, event: str, **_kwargs) -> None:
        if event == _HIT_EVENT:
            self._thread.hits = getattr(self._thread, "hits", 0) + 1
            with self._lock:
                self._hits += 1
        elif event == _WRITE_EVENT:
            with self._lock:
                self._writes += 1

    def on_stored_load(self, seconds: float) -> None:
        """An executable loaded whole from `serving.compilation.executable_store`: a cache hit, untraced."""
        with self._lock:
            self._requests += 1
            self._hits += 1
            self._seconds += seconds

    def thread_hits(self) -> int:
        return getattr(self._thread, "hits", 0)

    def thread_requests(self) -> int:
        return getattr(self._thread, "requests", 0)

    def snapshot(self) -> CompileCounts:
        with self._lock:
            return CompileCounts(self._requests, self._hits, self._writes, self._seconds)


_counters = _Counters()


def count_stored_load(seconds: float) -> None:
    _counters.install()
    _counters.on_stored_load(seconds)


def thread_cache_hits() -> int:
    """Persistent-cache hits of compiles on the calling thread so far (to tell whether one compile
    was loaded from the cache: `executable_store.compile_to_store`)."""
    _counters.install()
    return _counters.thread_hits()


def thread_compile_requests() -> int:
    """Executables the calling thread asked of XLA so far, compiled or loaded from the persistent cache
    (JAX's in-memory caches answer without asking: a `compile()` that adds none was handed an executable
    made earlier in the process, `executable_store.compile_to_store`)."""
    _counters.install()
    return _counters.thread_requests()


def compile_counts() -> CompileCounts:
    """Totals so far (counting starts at the first `enable()` or `compile_counts()` call)."""
    _counters.install()
    return _counters.snapshot()


def describe_warmup(info: dict, cache_dir: Optional[str]) -> str:
    """The startup log line of a warm-up: executables, shapes, time, and what the persistent cache did.

    `info` is `ModelRunner.warm_up()`'s dict, plus `xla_compiled` and `cache_hits` when the caller
    counted them (`LLM` does).
    """
    line = (f"warm-up: compiled {info.get('compiled')} executables for {info.get('shapes')} step shapes "
            f"in {info.get('seconds', 0.0):.1f} s")
    if info.get("background"):
        line += f" ({info['background']} more step shapes compile in the background while serving"
        if info.get("quick"):
            line += f", after full compiles of the {info['quick']} compiled quickly now"
        line += ")"
    if not cache_dir:
        return line + " (persistent compilation cache off)"
    if "xla_compiled" not in info:
        return line + f" (persistent compilation cache {cache_dir})"
    return (line + f"; of those, XLA compiled {info['xla_compiled']} and {info['cache_hits']} were loaded from "
                   f"the persistent compilation cache {cache_dir}")
