"""Serving before warm-up ends: the minimal set of step buckets, larger-bucket steps, background compiles.

The engine here has a KV pool size no other test uses, so its step executables are its own (the
executable table is shared by engines over the same model and pool) and the test controls when each
bucket is compiled.
"""

import socket

import httpx
import pytest

from serving import LLM, SamplingParams
from serving.compilation import step_programs, table
from serving.core.model_runner import compilation_count
from serving.server import ServerThread, check_port_free

PROMPTS = ["def __init__(self", "import os\n", "class Foo(object):\n    def bar(self, x):\n        return x * 2 + 1"]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_pages=37, page_size=16, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
              attention_backend="reference")
    yield llm
    llm.shutdown()


def _workload(llm):
    """Prefill chunks (the third prompt is longer than a step's 8 tokens and its context than 64
    tokens), decodes of several batch sizes, n > 1 and logprobs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8)
    outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:1], sampled)
    return [[c.token_ids for c in o.outputs] for o in outs], [o.outputs[0].logprobs for o in outs[:3]]


def test_serving_starts_on_the_minimal_set_and_finishes_warm_up_in_the_background(llm):
    """The server's warm-up: the minimal set compiled (the batch-1 decode quickly, XLA CPU at -O0), requests
    served at once in buckets that hold them, then in the background the decode bucket compiled fully and
    swapped in, and the rest compiled; the results are the same throughout."""
    runner = llm.engine.runner
    programs = runner.programs
    order = runner.warm_up_order()
    before, steps_before = compilation_count(), table.compiled_total("step")
    info = runner.warm_up(background=True, start_thread=False, quick=True)
    assert info["background"] == len(order) - 2 > 0 and info["quick"] == 1
    # Of the step, the smallest and the largest bucket (the rest are small programs: page copies).
    assert table.compiled_total("step") - steps_before == 2
    assert compilation_count() - before == info["compiled"]
    assert programs.is_compiled(order[0]) and programs.is_compiled(order[-1])
    assert not any(programs.is_compiled(s) for s in order[1:-1])
    quick, largest = programs.get(order[0]), programs.get(order[-1])

    # Requests are served at once: every step runs in a compiled bucket that holds it; no step compiles.
    # (The page copy and the control load are left to the background thread, not started here: the
    # workload's forks compile the copy on first use.)
    padded_tokens, padded_logprobs = _workload(llm)
    stats = runner.warmup_stats()
    assert not stats.ready and stats.compiled == 2 and stats.quick == 1
    assert stats.steps_in_larger_bucket > 0
    assert stats.compiles_after_ready == 0 and table.compiled_total("step") - steps_before == 2

    # The background recompiles the decode bucket fully first (a new executable), then the rest; every step then
    # runs in its own, fully compiled bucket, with the same results.
    programs.start_background()
    assert programs.wait(timeout=600)
    assert all(programs.is_compiled(s) for s in order)
    assert programs.get(order[0]) is not quick and programs.get(order[-1]) is largest
    stats = runner.warmup_stats()
    assert stats.ready and stats.compiled == len(order) and stats.quick == 0
    before = compilation_count()
    exact_tokens, exact_logprobs = _workload(llm)
    assert runner.warmup_stats().steps_in_larger_bucket == stats.steps_in_larger_bucket
    assert compilation_count() == before and runner.warmup_stats().compiles_after_ready == 0
    assert exact_tokens == padded_tokens
    for padded, exact in zip(padded_logprobs, exact_logprobs):
        for p, e in zip(padded, exact):
            assert p.keys() == e.keys()
            for tok in p:
                assert abs(p[tok].logprob - e[tok].logprob) < 1e-4


def test_health_says_warming_then_ready_and_metrics_count_larger_bucket_steps():
    llm = LLM(num_pages=41, page_size=16, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
              attention_backend="reference")
    programs = llm.engine.runner.programs
    llm.engine.runner.warm_up(background=True, start_thread=False)
    try:
        with ServerThread(llm, model_name="tiny") as srv:
            r = httpx.get(srv.url + "/health", timeout=30)
            assert r.status_code == 200  # it can serve
            assert r.json()["status"] == "warming"
            assert 0 < r.json()["step_executables_compiled"] < r.json()["step_executables_total"]
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 6,
                                                              "temperature": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            larger = [line for line in text.splitlines() if line.startswith("ridgeline:steps_in_larger_bucket_total")]
            assert larger and float(larger[0].split()[-1]) > 0, text
            programs.start_background()
            assert programs.wait(timeout=600)
            assert httpx.get(srv.url + "/health", timeout=30).json() == {"status": "ready"}
            assert 'ridgeline:compiles_after_ready_total{model_name="tiny"} 0.0' in httpx.get(srv.url + "/metrics").text
    finally:
        programs.stop()


def test_a_busy_port_is_reported_before_anything_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again: no error


def test_a_bucket_saved_by_an_earlier_process_loads_instead_of_padding(tmp_path, monkeypatch):
    """While warm-up goes on, a step whose bucket an earlier start saved whole runs in that bucket (loading
    it is cheap); one whose bucket must compile runs padded in a larger compiled one."""
    from serving.compilation import executable_store
    from serving.core.input_batch import StepShape

    monkeypatch.setattr(executable_store, "current", lambda: executable_store.ExecutableStore(str(tmp_path)))
    shapes = [StepShape(T, 1, P) for T, P in ((1, 1), (4, 1), (8, 1), (16, 2))]

    class Executable:  # what the table holds (weakly)
        pass

    class Lowered:
        def compile(self):
            return Executable()

    programs = step_programs.StepPrograms(lambda shape: Lowered(), lambda shape: ("fake-step", shape.T, shape.P))
    saved = executable_store.current().path(("fake-step", 4, 1))
    open(saved, "wb").close()  # what an earlier process left for bucket (4, 1)
    programs.warm_up(shapes, background=True, start_thread=False)  # (1, 1) and (16, 2) compiled now
    assert programs.shape_for(shapes[1]) == shapes[1]  # saved: loads on demand
    assert programs.shape_for(shapes[2]) == shapes[3]  # not saved: the smallest compiled bucket holding it
    assert programs.steps_in_larger_bucket == 1

    # The background compiles what nobody saved and leaves the saved bucket to load on first use.
    programs.start_background()
    assert programs.wait(timeout=60)
    assert programs.is_compiled(shapes[2]) and not programs.is_compiled(shapes[1])
    assert programs.stats().ready and programs.shape_for(shapes[1]) == shapes[1]


def test_quick_compiles_are_replaced_first_and_only_full_ones_are_saved(tmp_path, monkeypatch):
    """The smallest bucket's quick compile (the platform's quick options; the largest compiles fully) serves
    until the background thread's full compile of it replaces it, before any other bucket compiles; only
    full compiles go to the store, so a later process loads fully optimised programs. A platform without
    quick options compiles fully."""
    from jax._src import monitoring

    from serving.compilation import executable_store
    from serving.core.input_batch import StepShape

    monkeypatch.setattr(executable_store, "current", lambda: executable_store.ExecutableStore(str(tmp_path)))
    shapes = [StepShape(T, 1, 1) for T in (1, 4, 8)]
    compiles = []  # (T, compiler options) in order

    class Executable:
        def __init__(self, options):
            self.options = options

    class Lowered:
        def __init__(self, shape):
            self.shape = shape

        def compile(self, compiler_options=None):
            compiles.append((self.shape.T, compiler_options))
            # what an XLA compile records (`compile_cache`): the store keeps only what a call compiled
            monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 0.0)
            return Executable(compiler_options)

    saved = []
    monkeypatch.setattr(executable_store.ExecutableStore, "save", lambda self, key, exe: saved.append((key, exe)))
    key = lambda shape: ("fake-quick", shape.T)  # noqa: E731
    programs = step_programs.StepPrograms(Lowered, key, platform="cpu")
    programs.warm_up(shapes, background=True, start_thread=False, quick=True)
    quick_options = step_programs.QUICK_COMPILE_OPTIONS["cpu"]
    assert compiles == [(1, quick_options), (8, None)] and [k for k, _ in saved] == [key(shapes[2])]
    assert programs.get(shapes[0]).options == quick_options
    assert programs.stats().quick == 1 and not programs.stats().ready
    programs.start_background()
    assert programs.wait(timeout=60)
    assert compiles[2:] == [(1, None), (4, None)]  # the quick one replaced first, then the rest
    assert [k for k, _ in saved] == [key(shapes[2]), key(shapes[0]), key(shapes[1])]
    assert all(e.options is None for _, e in saved)
    assert programs.get(shapes[0]).options is None and programs.stats().quick == 0

    compiles.clear()
    other = step_programs.StepPrograms(Lowered, lambda shape: ("fake-full", shape.T), platform="elsewhere")
    other.first_in_background(lambda: compiles.append("small programs"))  # run by the thread, before its compiles
    other.warm_up(shapes, background=True, start_thread=False, quick=True)
    assert compiles == [(1, None), (8, None)] and other.stats().quick == 0
    other.start_background()
    assert other.wait(timeout=60) and compiles[2:] == ["small programs", (4, None)]


def test_steps_of_16_tokens_or_more_share_the_largest_page_bucket():
    """Fewer step shapes: a step of 16 or more tokens always takes the largest page bucket (a decode's
    attention visits each row's live pages whatever the bucket, a prefill's stops at its last visible key);
    only the smallest decodes keep a bucket per page count."""
    from serving.core.engine_args import BY_NAME
    from serving.core.input_batch import Buckets

    b = Buckets(max_num_batched_tokens=512, max_num_seqs=64, max_pages_per_seq=128, min_pages=4,
                decode_step=BY_NAME["decode_bucket_step"].default)
    shapes = b.all_shapes()
    # 1-8 tokens x 6 page counts, 16-64 tokens (multiples of 8) x 1, 128-512 x 1; 49 when the prefill-sized
    # steps had a bucket per page count, 64 when the decode-sized ones did too.
    assert len(shapes) == 4 * 6 + 7 + 3
    assert {p for t, _, p in shapes if t >= 16} == {128}
    assert {p for t, _, p in shapes if t <= 8} == {4, 8, 16, 32, 64, 128}
    assert (b.step_pages(8, 3), b.step_pages(16, 3), b.step_pages(64, 3), b.step_pages(128, 3)) == (4, 128, 128, 128)
    assert all((t, s, b.step_pages(t, 3)) in shapes for t, s, _ in shapes)  # every step lands in the set
    with pytest.raises(ValueError, match="exceed"):
        b.step_pages(16, 129)


def test_a_compile_after_warm_up_says_why(caplog):
    """`StepPrograms.why` names the key fields in which a program differs from the closest compiled one,
    and a compile after warm-up logs it and keeps it in `recompile_reasons`."""
    import dataclasses
    import types

    @dataclasses.dataclass(frozen=True)
    class Config:
        layers: int = 2
        vocab: int = 97

    @dataclasses.dataclass(frozen=True)
    class Shape:
        T: int
        P: int = 4
        cfg: Config = Config()

        @property
        def S(self):
            return self.T

    signature = {"sig": ((4, 8), "float32")}
    class Executable:  # a stand-in the process-wide table can hold weakly
        pass

    lowered = types.SimpleNamespace(compile=lambda **_: Executable())
    programs = step_programs.StepPrograms(
        lambda shape: lowered, lambda shape: ("step", shape.cfg, (shape.T, shape.P), signature["sig"]),
        key_fields=("program", "model config", "bucket", "argument signature"))
    shape = Shape
    assert programs.why(programs._key(shape(8))) == "the first step program of this process"
    programs.warm_up([shape(8), shape(16)], background=False)
    assert programs.why(programs._key(shape(16))) == "already compiled"
    with caplog.at_level("WARNING", logger="ridgeline.warmup"):
        programs.get(shape(32, P=8))
    assert programs.compiles_after_ready == 1
    assert programs.recompile_reasons == ["bucket: element 0: 32, closest compiled 8"]
    assert "on demand after warm-up: bucket" in caplog.text
    assert programs.why(programs._key(shape(8, cfg=Config(vocab=128)))) == \
        "model config: vocab=128 (closest compiled 97)"
    signature["sig"] = ((4, 16), "float32")
    assert programs.why(programs._key(shape(8))) == \
        "argument signature: element 0: element 1: 16, closest compiled 8"


def test_a_script_that_exits_during_the_background_warm_up_exits_cleanly(tmp_path):
    """`LLM(warmup="background")` leaves buckets compiling in a thread; a script that ends at once must not
    abort in the middle of an XLA compile ("FATAL: exception not rethrown", status 134): the compile under
    way ends first and no other starts."""
    import os
    import subprocess
    import sys

    from conftest import SUBPROCESS_XLA_FLAGS

    script = "from serving import LLM\nllm = LLM(warmup='background')\nassert llm.engine.stats().warmup.compiled < 49\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS,
               RIDGELINE_COMPILATION_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FATAL" not in proc.stderr and "Abort" not in proc.stderr
