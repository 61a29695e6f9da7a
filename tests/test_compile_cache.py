"""The persistent compilation cache: a second start with a warm cache compiles nothing.

Each start is a fresh Python process (the in-memory jit caches die with it),
so only the persistent cache can carry executables from one start to the
next. Compilations are counted from JAX's monitoring events
(`serving.compilation.compile_cache.compile_counts`), never by timing.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import SUBPROCESS_XLA_FLAGS
from serving.compilation import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One start: enable the cache (unless told "off"), build and warm up an LLM over random weights, generate greedily,
# and report what was compiled or loaded over the whole process.
START = r"""
import json, sys
sys.path.insert(0, "tests")
cache_dir = sys.argv[1]
warmup = json.loads(sys.argv[2]) if len(sys.argv) > 2 else True
from serving.compilation import compile_cache
compile_cache.enable(cache_dir)  # before anything compiles, so the whole process is counted
before = compile_cache.compile_counts()
import jax
from conftest import tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
from serving.compilation import executable_store
from serving.core.model_runner import ModelRunner
lowered = []  # step buckets traced and lowered in this process
_lower = ModelRunner._lower_step
ModelRunner._lower_step = lambda self, shape: lowered.append(shape) or _lower(self, shape)
cfg = tiny_config()
llm = LLM(config=cfg, params=init_params(cfg, jax.random.key(3)), max_num_seqs=4, max_num_batched_tokens=16,
          min_token_bucket=16, page_size=8, num_pages=8, max_model_len=16, attention_backend="reference",
          compilation_cache_dir=cache_dir, warmup=warmup)
outs = llm.generate([[1, 5, 9, 4], [1] + list(range(10, 19))],
                    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
total = compile_cache.compile_counts() - before
print("RESULT " + json.dumps({
    "requests": total.requests, "xla_compiled": total.compiled, "cache_hits": total.cache_hits,
    "cache_writes": total.cache_writes, "warmup": llm.warmup_info, "cache_dir": llm.compilation_cache_dir,
    "entries": compile_cache.cache_entries(llm.compilation_cache_dir), "lowered": len(lowered),
    "stored_steps": executable_store.entries(llm.compilation_cache_dir),
    "stored_functions": executable_store.entries(llm.compilation_cache_dir, executable_store.FUNCTION_SUFFIX),
    "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def start(cache_dir: str, warmup=True) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one CPU device: a quicker start
    env.pop(compile_cache.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", START, cache_dir, json.dumps(warmup)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_second_start_with_a_warm_cache_compiles_nothing(tmp_path):
    cache_dir = str(tmp_path / "jax-cache")
    cold = start(cache_dir)
    assert cold["cache_dir"] == cache_dir
    assert cold["xla_compiled"] > 0 and cold["cache_hits"] == 0
    assert cold["cache_writes"] == cold["xla_compiled"]  # even the small CPU executables are written
    assert cold["entries"] == cold["cache_writes"]
    assert cold["warmup"]["xla_compiled"] == cold["warmup"]["compiled"] > 0

    assert cold["lowered"] == cold["stored_steps"] > 0  # every step bucket saved whole
    assert cold["stored_functions"] == 3  # and the KV pool zeroing, the page copy (one program), the control load

    warm = start(cache_dir)
    assert warm["lowered"] == 0  # step executables loaded whole: no bucket was even traced
    assert warm["requests"] == cold["requests"]  # the same executables were needed...
    assert warm["xla_compiled"] == 0 and warm["cache_writes"] == 0  # ...and none was compiled
    assert warm["cache_hits"] == cold["requests"]  # (loads from the step store count as hits)
    assert warm["warmup"]["xla_compiled"] == 0
    assert warm["warmup"]["cache_hits"] == warm["warmup"]["compiled"] == cold["warmup"]["compiled"]
    assert warm["entries"] == cold["entries"] and warm["stored_steps"] == cold["stored_steps"]
    assert warm["stored_functions"] == cold["stored_functions"]
    assert warm["tokens"] == cold["tokens"]  # executables loaded from disk compute the same thing


def test_an_empty_directory_turns_the_cache_off(tmp_path):
    import jax
    import numpy as np

    from conftest import tiny_config
    from model.params import init_params
    from serving import LLM

    previous = jax.config.jax_compilation_cache_dir
    try:
        on = str(tmp_path / "on")
        assert compile_cache.enable(on) == on
        before = compile_cache.compile_counts()
        jax.jit(lambda x: x * 3 + 1)(np.arange(5)).block_until_ready()
        assert (compile_cache.compile_counts() - before).cache_writes == 1
        assert compile_cache.cache_entries(on) == 1

        cfg = tiny_config()
        llm = LLM(config=cfg, params=init_params(cfg, jax.random.key(0)), max_num_seqs=2, max_num_batched_tokens=8,
                  num_pages=4, page_size=8, max_model_len=16, compilation_cache_dir="")
        assert llm.compilation_cache_dir is None and jax.config.jax_compilation_cache_dir is None
        entries = compile_cache.cache_entries(on)  # init_params compiled (and cached) before LLM turned it off
        before = compile_cache.compile_counts()
        jax.jit(lambda x: x * 5 - 2)(np.arange(7)).block_until_ready()
        done = compile_cache.compile_counts() - before
        assert done.compiled == 1 and done.cache_writes == 0 and compile_cache.cache_entries(on) == entries
    finally:
        compile_cache.enable(previous or "")


def test_cache_directory_precedence(monkeypatch, tmp_path):
    import jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    assert compile_cache.default_cache_dir() == str(tmp_path / "xdg" / "ridgeline" / "jax")
    previous = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert compile_cache.resolve_cache_dir(None) == compile_cache.default_cache_dir()
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jaxcfg"))
        assert compile_cache.resolve_cache_dir(None) == str(tmp_path / "jaxcfg")  # JAX's own setting is kept
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    assert compile_cache.resolve_cache_dir("") is None
    assert compile_cache.resolve_cache_dir(str(tmp_path / "a")) == str(tmp_path / "a")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve_cache_dir(None) == str(tmp_path / "env")
    assert compile_cache.resolve_cache_dir(str(tmp_path / "a")) == str(tmp_path / "a")  # explicit wins
    monkeypatch.setenv(compile_cache.ENV_VAR, "")
    assert compile_cache.resolve_cache_dir(None) is None  # "" in the environment turns it off


def test_describe_warmup_says_what_the_cache_did():
    info = {"compiled": 12, "shapes": 12, "seconds": 3.25, "xla_compiled": 2, "cache_hits": 10}
    line = compile_cache.describe_warmup(info, "/c")
    assert line.startswith("warm-up: compiled 12 executables for 12 step shapes in 3.2 s")
    assert "XLA compiled 2 and 10 were loaded from the persistent compilation cache /c" in line
    assert compile_cache.describe_warmup(info, None).endswith("(persistent compilation cache off)")


def test_an_unwritable_directory_turns_the_cache_off_instead_of_failing():
    import jax

    previous = jax.config.jax_compilation_cache_dir
    try:
        assert compile_cache.enable("/proc/ridgeline-cannot-create-this") is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        compile_cache.enable(previous or "")


def test_the_step_store_names_entries_by_everything_that_shapes_the_program(tmp_path, monkeypatch):
    """A key without a stable text is never stored; a change to the step's source names another entry; an
    entry that does not load is removed (and the caller compiles)."""
    import jax
    import jax.numpy as jnp

    from serving.compilation import executable_store

    store = executable_store.ExecutableStore(str(tmp_path))
    assert store.path(("step", object())) is None
    key = ("step", "cfg", 3)
    first = store.path(key)
    assert first == store.path(key) and first.endswith(executable_store.SUFFIX)
    monkeypatch.setattr(executable_store, "source_digest", lambda: "edited")
    assert store.path(key) != first
    monkeypatch.undo()

    exe = jax.jit(lambda x: x * 2 + 1).lower(jnp.arange(4.0)).compile()
    store.save(key, exe)
    loaded = store.load(key)
    assert loaded is not None and list(loaded(jnp.arange(4.0))) == [1.0, 3.0, 5.0, 7.0]
    with open(first, "wb") as f:
        f.write(b"torn")
    assert store.load(key) is None and not os.path.exists(first)


def test_a_small_program_prepared_from_shapes_is_the_one_a_later_call_runs(tmp_path, monkeypatch):
    """`table.prepare` compiles a small program from argument shapes alone (what a background
    warm-up does, touching no live array); the call with real arguments then runs that executable,
    compiling and loading nothing, and a later process loads it from the store."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from serving.compilation import executable_store, table

    store = executable_store.ExecutableStore(str(tmp_path))
    monkeypatch.setattr(executable_store, "current", lambda suffix=executable_store.SUFFIX: store)
    jitted = jax.jit(lambda pool, i: pool.at[i].set(pool[i] + 1.0), donate_argnums=(0,))
    pool = jnp.arange(8.0)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)),
                          (pool, np.int32(3)))
    held = {}
    exe = table.prepare(jitted, "bump", held, *shapes)
    assert len(held) == 1 and len(os.listdir(str(tmp_path))) == 1
    compiled = table.compiled_total("small")
    monkeypatch.setattr(jitted, "lower", lambda *a: pytest.fail("lowered again"))
    monkeypatch.setattr(store, "load", lambda key: pytest.fail("loaded again"))
    out = table.call(jitted, "bump", held, pool, np.int32(3))
    assert list(np.asarray(out)) == [0.0, 1.0, 2.0, 4.0, 4.0, 5.0, 6.0, 7.0]
    assert table.compiled_total("small") == compiled and held[next(iter(held))] is exe
    monkeypatch.undo()
    later = executable_store.ExecutableStore(str(tmp_path))
    assert later.load(next(iter(held))) is not None  # saved for the next process


# A program JAX's persistent cache already holds (compiled by a plain jit call first), then prepared
# through the step store, then loaded from the store as a later start would load it, and run.
FROM_JAX_CACHE = r"""
import sys
from serving.compilation import compile_cache, executable_store, table
compile_cache.enable(sys.argv[1])
import jax, jax.numpy as jnp
build = lambda: (jnp.zeros((4, 16, 2, 8), jnp.float32), jnp.ones((4, 16, 2, 8), jnp.float32))
jax.jit(build)()  # compiled, and written to JAX's persistent cache
jax.clear_caches()
before = compile_cache.compile_counts()
table.prepare(jax.jit(build), "zeros-and-ones", {})
assert (compile_cache.compile_counts() - before).cache_hits == 1, "expected JAX's cache to answer"
table._TABLE.clear()  # as a later process: only the store (or JAX's cache) has it
zeros, ones = table.call(jax.jit(build), "zeros-and-ones", {})
print("RESULT", float(zeros.sum()), float(ones.sum()))
"""


def test_llms_default_warm_up_loads_what_it_compiled_from_a_warm_cache_without_tracing(tmp_path):
    """`LLM`'s as-needed warm-up stores the buckets a call compiled; the same script again loads them from the
    executable store: nothing traced, lowered or compiled, the same tokens."""
    cache_dir = str(tmp_path / "jax-cache")
    cold = start(cache_dir, "as_needed")
    assert cold["xla_compiled"] > 0 and cold["lowered"] == cold["stored_steps"] > 0
    warm = start(cache_dir, "as_needed")
    assert warm["xla_compiled"] == 0 and warm["lowered"] == 0
    assert warm["tokens"] == cold["tokens"]


def test_an_executable_from_jaxs_cache_is_not_stored_where_it_could_not_run(tmp_path):
    """On XLA CPU an executable JAX loaded from its persistent cache serializes into a payload that loads
    but fails on its first run ("Function wrapped_broadcast not found"); the store must not keep it, so
    the program a later start gets always runs."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one CPU device
    env.pop(compile_cache.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", FROM_JAX_CACHE, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT 0.0 1024.0" in proc.stdout


# A second lowering of the same jitted function in one process: JAX hands back the executable of the first
# (here one it loaded from its persistent cache) without asking XLA or the cache again.
LOWERED_AGAIN = r"""
import sys
from serving.compilation import compile_cache, executable_store, table
compile_cache.enable(sys.argv[1])
import jax, jax.numpy as jnp
build = jax.jit(lambda: jnp.zeros((4, 16, 2, 8), jnp.float32) + 1.0)
build()  # compiled, and written to JAX's persistent cache
jax.clear_caches()
table.prepare(build, "ones", {})  # JAX's cache answers: not stored
table._TABLE.clear()  # the first caller is gone
table.prepare(build, "ones", {})  # the same executable again, from JAX's in-memory caches
print("STORED", executable_store.entries(sys.argv[1], executable_store.FUNCTION_SUFFIX))
table._TABLE.clear()  # as a later process: only the store (or JAX's cache) has it
print("RESULT", float(table.call(build, "ones", {}).sum()))
"""


def test_an_executable_jax_hands_back_from_memory_is_not_stored_where_it_could_not_run(tmp_path):
    """Lowered again in the same process, a function's executable comes back from JAX's in-memory caches with
    no compile and no persistent-cache hit to see; when JAX had loaded it from its persistent cache, its
    payload has no kernels ("Function wrapped_broadcast not found" on the first run of a later start). Only
    an executable XLA compiled in that very call is stored."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    env.pop(compile_cache.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", LOWERED_AGAIN, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STORED 0" in proc.stdout and "RESULT 1024.0" in proc.stdout
    assert "did not load" not in proc.stderr


# Starts over one cache directory after the step's source changed: the store's names change with it, JAX's
# cache keys do not. "fill": a first engine fills both, the store is emptied (as the edit would leave it),
# a second engine gets every program from JAX's cache, and a third, built once the second is gone, gets them
# again from JAX's in-memory caches. "again": a later process over the same directory.
SOURCE_EDITED = r"""
import gc, json, os, shutil, sys
sys.path.insert(0, "tests")
cache_dir, phase = sys.argv[1], sys.argv[2]
from serving.compilation import compile_cache
compile_cache.enable(cache_dir)
import jax
from conftest import tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
cfg = tiny_config()
params = init_params(cfg, jax.random.key(3))

def generate():
    llm = LLM(config=cfg, params=params, max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16,
              page_size=8, num_pages=8, max_model_len=16, attention_backend="reference",
              compilation_cache_dir=cache_dir, warmup=False)
    outs = llm.generate([[1, 5, 9, 4], [1, 5, 9, 4, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]

tokens = generate()
if phase == "fill":
    gc.collect()
    shutil.rmtree(os.path.join(cache_dir, "steps"))
    jax.clear_caches()
    assert generate() == tokens
    gc.collect()
    assert generate() == tokens
print("RESULT " + json.dumps(tokens))
"""


def test_a_start_after_the_source_changed_leaves_a_store_the_next_start_runs_from(tmp_path):
    """The second start over a cache directory must run. Here the store was emptied while JAX's cache kept
    every program (a source edit does that), and a later engine of the first process got those programs
    back from JAX's in-memory caches: they must not be stored, or the next start loads step programs
    without their kernels and its first step fails ("NOT_FOUND: Function ... not found")."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    env.pop(compile_cache.ENV_VAR, None)
    results = []
    for phase in ("fill", "again"):
        proc = subprocess.run([sys.executable, "-c", SOURCE_EDITED, str(tmp_path), phase], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "did not load" not in proc.stderr
        results.append(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")))
    assert results[0] == results[1]


class _FailsOnFirstRun:
    """A loaded executable whose kernels are missing: it loads, and its first run fails."""

    def __call__(self, *args):
        raise RuntimeError("NOT_FOUND: Function wrapped_broadcast not found (type id: 1)")


@pytest.mark.parametrize("damage", ["torn", "fails on its first run"])
def test_a_stored_program_that_does_not_load_or_run_compiles_instead_with_one_warning(tmp_path, monkeypatch,
                                                                                      caplog, damage):
    """A torn entry, or one that loads but fails on its first run: `call` still answers, the program compiles,
    one warning names it, and the bad entry is gone (the next start does not meet it again)."""
    import logging
    import weakref

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import serialize_executable

    from serving.compilation import executable_store, table

    store = executable_store.ExecutableStore(str(tmp_path), executable_store.FUNCTION_SUFFIX)
    monkeypatch.setattr(executable_store, "current", lambda suffix=executable_store.SUFFIX: store)
    monkeypatch.setattr(table, "_TABLE", weakref.WeakValueDictionary())
    # A program no earlier test compiled: one JAX's persistent cache held would not be stored (`compile_to_store`).
    offset = float(np.random.default_rng().integers(1, 2**20))
    jitted = jax.jit(lambda x: x * 3.0 - offset)
    name = repr(("scale-rows", 3, "float32", offset))  # printed from a tuple, as the KV pool's zeroing names itself
    x = jnp.arange(5.0)
    table.prepare(jitted, name, {}, x)  # compiled and stored
    (entry,) = os.listdir(str(tmp_path))
    path = os.path.join(str(tmp_path), entry)
    table._TABLE.clear()  # a later process: only the store has it
    if damage == "torn":
        with open(path, "wb") as f:
            f.write(b"torn")
    else:
        monkeypatch.setattr(serialize_executable, "deserialize_and_load", lambda *a, **k: _FailsOnFirstRun())
    held = {}
    with caplog.at_level(logging.WARNING, logger="ridgeline.warmup"):
        want = [3.0 * i - offset for i in range(5)]
        out = table.call(jitted, name, held, x)
        assert list(np.asarray(out)) == want
        assert list(np.asarray(table.call(jitted, name, held, x))) == want
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "scale-rows" in warnings[0] and "compiling it instead" in warnings[0]
    # Removed; not stored again either: JAX handed the first compile's executable back (`compile_to_store`).
    assert not os.path.exists(path)
