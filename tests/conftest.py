"""Test configuration: 8 CPU devices for sharding tests, set before jax is imported."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile far more than they run, on tiny shapes: XLA CPU at LLVM -O0 without its expensive
# passes compiles a step program in about half the time (tests/test_scan_layers.py: 250 -> 152 CPU
# seconds), and the tiny steps still run quickly. Results do not change (neither level allows
# fast-math). Processes the tests start inherit it; those that need one CPU device set
# `SUBPROCESS_XLA_FLAGS` instead.
TEST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# XLA CPU's older loop emitters instead of its MLIR fusion emitters: the suite's compiles take about half
# the time again (tests/test_engine.py from a cold cache: 28 -> 16 s, 40 -> 21 CPU seconds) for the same
# results. Only where this XLA still knows the flag: an unknown flag in XLA_FLAGS aborts the process.
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    """Whether a process with `flag` in XLA_FLAGS starts JAX's CPU backend (asked of a child process)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def _named_in_xla_flags(flag: str) -> bool:
    """Whether XLA_FLAGS already sets `flag` (to any value)."""
    return flag.split("=")[0] in os.environ.get("XLA_FLAGS", "")


# (xdist's workers inherit the flags the controlling process chose, so only that one asks.)
if _named_in_xla_flags(LEGACY_EMITTERS_FLAG) or _xla_accepts(LEGACY_EMITTERS_FLAG):
    TEST_COMPILE_FLAGS += (LEGACY_EMITTERS_FLAG,)
SUBPROCESS_XLA_FLAGS = " ".join(TEST_COMPILE_FLAGS)
for _flag in ("--xla_force_host_platform_device_count=8",) + TEST_COMPILE_FLAGS:
    if not _named_in_xla_flags(_flag):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Engines started by the tests cache compilations in a fresh directory, never the user's.
os.environ.setdefault("RIDGELINE_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="ridgeline-jax-cache-"))
# `LLM()` compiles each step bucket on first use here, with no background thread: tests that count compiles or
# drive a warm-up themselves start from nothing, and engines do not compile beside other tests. Tests of the
# default (`warmup="as_needed"`) ask for it by name.
os.environ.setdefault("RIDGELINE_WARMUP", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def tiny_config(**overrides):
    """A small random-weight config for tests (not the embedded model's shape)."""
    from model.config import LlamaConfig

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, rope_theta=10000.0, dtype="float32", max_position_embeddings=1024,
                bos_token_id=1, eos_token_ids=(2,))
    base.update(overrides)
    return LlamaConfig(**base)


# Files that take minutes run first: under the README's `-n 2 --dist loadfile` each file goes to one
# worker, and a long file handed out last would leave the other worker idle at the end.
SLOW_FILES_FIRST = ("test_multihost.py", "test_gpu_check_smoke.py", "test_composition.py", "test_lora_engine.py",
                    "test_vision_composition.py", "test_vision_gemma3.py", "test_pipeline.py", "test_startup.py",
                    "test_spec_decode.py", "test_scan_layers.py", "test_quant.py", "test_engine_tp.py",
                    "test_xla_attention.py", "test_disagg_engine.py", "test_async_scheduling.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES_FIRST)))  # stable: files stay whole


@pytest.fixture
def small_cfg():
    return tiny_config()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drops what JAX's caches still hold of its compiled programs.

    Every XLA:CPU executable keeps its machine code in memory mappings of its own (hundreds for
    a step program), and JAX's caches keep an executable alive as long as its lowering is cached,
    so a whole-suite run accumulates them until the process reaches the kernel's per-process
    mapping limit (vm.max_map_count, 65530 by default) and LLVM aborts while mapping the next
    one. Engines that fixtures keep across modules hold their own step executables."""
    yield
    import gc

    gc.collect()
    jax.clear_caches()


# --- helpers shared by several test files ------------------------------------------------------------


def assert_same_logprobs(got, want, tol: float) -> None:
    """Per request, per position: the same candidate tokens, each logprob within `tol` (outputs'
    `logprobs` lists of {token: Logprob})."""
    for got_request, want_request in zip(got, want, strict=True):
        for g, w in zip(got_request, want_request, strict=True):
            assert g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) < tol for t in g)


def ragged_prompts(vocab: int, n: int = 6, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    """`n` prompts of BOS plus 2..`max_len` random token ids (seeded), ragged so batches mix lengths."""
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, max_len))] for _ in range(n)]


def greedy(llm, batch, max_tokens: int = 8) -> list[list[int]]:
    """Sample 0's token ids of each prompt, greedy and ignoring EOS (a fixed-length, comparable output)."""
    from serving import SamplingParams

    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def run_to_completion(engine, max_steps: int = 10_000) -> dict:
    """Steps `engine` until it has nothing left; {request_id: final RequestOutput}."""
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    raise AssertionError("engine did not finish")


def run_with_random_arrivals(engine, jobs, seed: int, spread: int, max_steps: int) -> dict:
    """Adds each (request_id, prompt, SamplingParams) job at a random step in [0, spread] (seeded) and steps
    until every job has output; {request_id: its last RequestOutput}."""
    import random

    rng = random.Random(seed)
    arrivals = {}
    for job in jobs:
        arrivals.setdefault(rng.randint(0, spread), []).append(job)
    done, step = {}, 0
    while len(done) < len(jobs):
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(rid, prompt, sp)
        for out in engine.step():
            done[out.request_id] = out
        step += 1
        assert step < max_steps
    return done


def wait_until_serving(proc, log_path, timeout: float = 300) -> str:
    """Waits until a server subprocess whose output goes to `log_path` logs that uvicorn is serving; returns
    the log so far. Fails with the log's end when the process exits first or `timeout` seconds pass."""
    import time

    deadline = time.monotonic() + timeout
    while "Uvicorn running" not in (text := log_path.read_text()):
        assert proc.poll() is None, f"server exited early:\n{text[-3000:]}"
        assert time.monotonic() < deadline, f"server did not come up:\n{text[-3000:]}"
        time.sleep(0.2)
    return text


def interrupt_server(proc, timeout: float = 60) -> int:
    """Stops a server subprocess as Ctrl-C would (SIGINT, a graceful drain) and returns its exit status; kills it
    and raises when it does not exit within `timeout` seconds."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def metric_value(text: str, name: str, require: bool = False, **labels) -> float:
    """The sum of the samples of `name` (or `name`_total, a counter's) in Prometheus text whose labels
    include `labels`: 0 when there is none (a labelled counter nothing has counted yet), unless `require`."""
    total, found = 0.0, False
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        metric, _, rest = sample.partition("{")
        if metric in (name, name + "_total") and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
            found = True
    assert found or not require, f"no sample of {name} {labels or ''} in:\n{text[-2000:]}"
    return total
