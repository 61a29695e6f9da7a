"""Custom logits processors (`serving.features.logits_processors`) and step parts written outside the project.

The processors live in tests/logits_processor_examples.py, as a user's would live in their module:
the engine imports them by name ("module:Class"), in other processes too (tests/multihost_worker.py).
One engine with both processors serves most tests; the HTTP tests come last, since once a server
runs its loop owns that engine.
"""

import dataclasses
import json
import os

import httpx
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest

from model.checkpoint import load_checkpoint, load_config
from model.tokenizer import load_tokenizer
from serving import LLM, SamplingParams
from serving.core.engine import Engine, EngineConfig
from serving.core.model_runner import compilation_count
from serving.core.sampling_params import InvalidParameterError
from serving.core import step_parts
from serving.core.input_batch import TokenField
from serving.core.step_parts import StepPart
from serving.llm import default_checkpoint_dir
from serving.server import ServerThread

from conftest import run_to_completion
from logits_processor_examples import BanTokens

pytestmark = pytest.mark.skipif(not os.path.isdir(default_checkpoint_dir()), reason="needs the embedded model")

# The step shapes of tests/test_structured_outputs.py (two buckets).
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=32, min_token_bucket=32, page_size=16, max_model_len=128,
              attention_backend="reference")
STAR = ord("*")


PROCESSORS = ["logits_processor_examples:BanTokens", "logits_processor_examples:ForceAt"]


class RaisesInRows(BanTokens):
    def rows(self, samples):
        raise RuntimeError("no rows today")


class RowsWithoutTheSampleAxis(BanTokens):
    def rows(self, samples):
        return np.zeros(3, np.int32)


class AppliesTheWrongShape(BanTokens):
    def apply(self, rows, logits):
        return logits[:, :7]


@pytest.fixture(scope="module")
def llm():
    return LLM(warmup=True, logits_processors=PROCESSORS, **ENGINE)


@pytest.fixture(scope="module")
def plain():
    return LLM(**ENGINE)


PROMPTS = ["def __init__(self", "import os\nimport sys\n", "class Foo:\n    "]


def greedy(llm, prompts, args, max_tokens=12):
    sps = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=a) for a in args]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sps)]


def test_requests_without_extra_args_are_untouched(llm, plain):
    assert greedy(llm, PROMPTS, [None] * 3) == greedy(plain, PROMPTS, [None] * 3)


def test_ban_and_force_per_request_in_one_batch_with_no_compile(llm):
    base = greedy(llm, PROMPTS, [None] * 3)
    compiled = compilation_count()
    ban = {"ban": sorted(set(base[0]))}
    force = {"force": STAR, "at": [0, 2, 5]}
    together = greedy(llm, PROMPTS, [ban, force, None])
    assert not set(together[0]) & set(base[0]) and together[0] != base[0]
    assert [together[1][i] for i in (0, 2, 5)] == [STAR] * 3 and together[1] != [STAR] * 12
    assert together[2] == base[2]
    # Each request alone: the same tokens (one request's rows never reach another's).
    assert [greedy(llm, [p], [a])[0] for p, a in zip(PROMPTS, [ban, force, None])] == together
    # n samples: every sample gets its request's rows.
    n2 = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2,
                                                   extra_args=force))[0].outputs
    assert [list(o.token_ids) for o in n2] == [together[1]] * 2
    assert compilation_count() == compiled


def test_with_ngram_speculation_and_a_json_schema_in_one_batch(llm):
    """Speculation verifies k + 1 rows per sequence in one step; each row gets the rows of its own
    position (ForceAt), so the output is the plain engine's, next to a grammar-constrained request."""
    spec = LLM(speculative_method="ngram", num_speculative_tokens=3, logits_processors=PROCESSORS, **ENGINE)
    person = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "maxLength": 8}}}
    prompts = ["self.x = self.x + self.x + self.x + self", "self.x = self.x + self.x + self.x + self",
               "<|user|>\nA person\n<|assistant|>\n", "def f(self):\n    return self.f(self.f(self"]
    sps = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                          extra_args={"force": STAR, "at": [1, 4, 5, 9, 15]}),
           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args={"ban": [ord("x")]}),
           SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": person}),
           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sps)]
    compiled = compilation_count()
    got_outputs = spec.generate(prompts, sps)
    got = [list(o.outputs[0].token_ids) for o in got_outputs]
    st = spec.engine.stats().spec_decode
    assert st.num_accepted_tokens > 0, st
    assert got == want
    assert [got[0][i] for i in (1, 4, 5, 9, 15)] == [STAR] * 5 and ord("x") not in got[1]
    jsonschema.validate(json.loads(got_outputs[2].outputs[0].text), person)
    # A second round compiles nothing: the processors' inputs have one shape per bucket.
    compiled = compilation_count()
    assert [list(o.outputs[0].token_ids) for o in spec.generate(prompts, sps)] == got
    assert compilation_count() == compiled


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_under_tensor_and_pipeline_parallelism(llm, layout):
    sharded = LLM(logits_processors=PROCESSORS, **layout, **ENGINE)
    args = [{"ban": [ord("s"), ord("e")]}, {"force": STAR, "at": [0, 3]}, None]
    assert greedy(sharded, PROMPTS, args) == greedy(llm, PROMPTS, args)


@pytest.mark.parametrize("name, message", [
    ("RaisesInRows", "RuntimeError: no rows today"),
    ("RowsWithoutTheSampleAxis", "leading axis must be the samples"),
    ("AppliesTheWrongShape", r"apply\(\) returned \(3, 7\)"),
    ("NoSuchClass", "has no class 'NoSuchClass'"),
])
def test_a_broken_processor_refuses_to_start_naming_it(name, message):
    with pytest.raises(ValueError, match=f"logits processor {__name__}:{name}: .*{message}"):
        LLM(logits_processors=[f"{__name__}:{name}"], **ENGINE)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        LLM(logits_processors="no_such_module:Thing", **ENGINE)


def test_extra_args_are_checked_at_admission(llm, plain):
    def refused(engine, extra_args):
        with pytest.raises(InvalidParameterError) as e:
            engine.make_request("r", [1, 5, 6], SamplingParams(max_tokens=2, extra_args=extra_args))
        assert e.value.param == "extra_args"
        return str(e.value)

    assert "runs no logits processor" in refused(plain.engine, {"ban": [5]})
    assert "BanTokens: ban: expected a list of token ids" in refused(llm.engine, {"ban": [10**6]})
    assert "string keys" in refused(llm.engine, {5: 1})
    llm.engine.make_request("ok", [1, 5, 6], SamplingParams(max_tokens=2, extra_args={"ban": [5]}))


# --- a step part written outside the project -------------------------------------------------------


class CountingBias(StepPart):
    """A part of this module's own: refuses requests that ask for token 0, counts what it admits and what
    is scheduled, adds `extra_args["boost"]`'s bias on the device, and records every sampled token."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.admitted, self.scheduled, self.sampled = [], 0, []

    takes_fields = ("extra_args",)

    def admit(self, request):
        if (request.params.extra_args or {}).get("boost") == 0:
            raise InvalidParameterError("extra_args", "extra_args: boost: token 0 is reserved")
        self.admitted.append(request.request_id)

    def after_schedule(self, out):
        self.scheduled += len(out.scheduled)

    def step_input_spec(self, rows):
        import jax

        return jax.ShapeDtypeStruct((rows,), np.int32)

    def step_inputs(self, batch):
        boost = np.full(batch.shape.S, -1, np.int32)
        for row, (seq, _) in enumerate(batch.sample_rows):
            boost[row] = (seq.request.params.extra_args or {}).get("boost", -1)
        return boost

    def apply_to_logits(self, boost, logits, step):
        return logits + jnp.where(jnp.arange(self.vocab)[None, :] == boost[:, None], 1e4, 0.0)

    def new_tokens(self, out, sampled):
        self.sampled.extend(sampled)
        return ()


def test_a_part_from_a_test_module_admits_schedules_adds_inputs_and_processes_results():
    directory = default_checkpoint_dir()
    cfg, params = load_checkpoint(directory, None, load_config(directory))
    part = CountingBias(cfg.vocab_size)
    # Built from the engine, after its runner, the part's inputs would never reach the step: refused.
    with pytest.raises(ValueError, match="CountingBias: a part with device inputs of its own must be given built"):
        Engine(cfg, params, load_tokenizer(directory, cfg.vocab_size), EngineConfig(**ENGINE),
               parts=[lambda engine: part])
    engine = Engine(cfg, params, load_tokenizer(directory, cfg.vocab_size), EngineConfig(**ENGINE), parts=[part])
    with pytest.raises(InvalidParameterError, match="boost: token 0 is reserved"):
        engine.make_request("zero", [1, 5], SamplingParams(extra_args={"boost": 0}))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("boosted", [1, 70, 71], sp.clone(extra_args={"boost": STAR}))
    engine.add_request("plain", [1, 70, 71], sp)
    outs = run_to_completion(engine)
    assert outs["boosted"].outputs[0].token_ids == [STAR] * 6
    assert STAR not in outs["plain"].outputs[0].token_ids
    assert part.admitted == ["boosted", "plain"] and part.scheduled >= 7
    assert sorted(part.sampled) == sorted(outs["boosted"].outputs[0].token_ids + outs["plain"].outputs[0].token_ids)


@step_parts.state_program
@jax.jit
def set_head_scale(state, scale):
    """The `HeadScale` part's state program: its one float."""
    return jnp.asarray(scale, state.dtype)


class HeadScale(StepPart):
    """A part of this module's own that adapts the weights: a request argument `head_scale` (refused below 0)
    scales the final norm's weight for the steps that hold the request's tokens, through a device state the
    part places and writes itself and a per-token field it fills. It records what it admits, packs and lets go
    of, so the test sees every hook run."""

    takes_args = ("head_scale",)

    def __init__(self):
        self.admitted, self.left, self.packed = [], [], []
        self._runner = None

    def attach(self, engine):
        self._runner = engine.runner

    def admit(self, request):
        scale = request.part_args.get("head_scale")
        if scale is None:
            return
        if scale < 0:
            raise InvalidParameterError("head_scale", "head_scale: must be >= 0")
        request.part_state["head_scale"] = float(scale)
        self.admitted.append(request.request_id)

    def leave(self, request):
        if request.part_state.pop("head_scale", None) is not None:
            self.left.append(request.request_id)

    def after_schedule(self, out):
        scales = {it.seq.request.part_state.get("head_scale") for it in out.scheduled} - {None}
        assert len(scales) <= 1, "the test runs one scaled request at a time"
        if scales:
            self._runner.update_part_state(self, set_head_scale, np.float32(scales.pop()))

    def token_fields(self):
        return (TokenField("head_scaled"),)

    def pack(self, batch):
        field = batch.views()["head_scaled"]
        for seq, first, _, n in batch.token_spans:
            if "head_scale" in seq.request.part_state:
                field[first:first + n] = 1
        self.packed.append(field.copy())

    def weight_state(self, cfg, params, layout):
        return jax.device_put(np.float32(1.0), jax.devices()[0])

    def apply_to_weights(self, state, views, params, layout):
        scale = jnp.where(jnp.any(views["head_scaled"] > 0), state, 1.0)
        return dataclasses.replace(params, final_norm=params.final_norm * scale), {}

    def state_programs(self):
        return ((set_head_scale, "set-head-scale", (np.float32(1.0),)),)


class RefusesAll(StepPart):
    """Refuses every request that gives `refuse`, after the parts before it admitted it."""

    takes_args = ("refuse",)

    def admit(self, request):
        if request.part_args.get("refuse"):
            raise InvalidParameterError("refuse", "refuse: refused")


def test_a_weight_part_from_a_test_module_takes_arguments_fields_and_state_and_lets_go():
    """The hooks a LoRA-like part uses, on a part of this module: its request argument, its per-token field, its
    weight state written between steps and applied inside the step, and `leave` once per request it holds,
    however the request leaves (finished, aborted, refused by a later part); an argument no part takes is a 400."""
    directory = default_checkpoint_dir()
    cfg, params = load_checkpoint(directory, None, load_config(directory))
    part = HeadScale()
    engine = Engine(cfg, params, load_tokenizer(directory, cfg.vocab_size), EngineConfig(**ENGINE),
                    parts=[part, RefusesAll()])
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with pytest.raises(InvalidParameterError, match="head_scale: must be >= 0"):
        engine.make_request("negative", [1, 70, 71], sp, part_args={"head_scale": -1.0})
    with pytest.raises(InvalidParameterError, match="'x' is given, but no part of this engine takes it") as e:
        engine.make_request("unknown", [1, 70, 71], sp, part_args={"colour": "x"})
    assert e.value.param == "colour"
    engine.warm_up()
    before = compilation_count()
    engine.add_request("zeroed", [1, 70, 71], sp, part_args={"head_scale": 0.0})
    zeroed = run_to_completion(engine)["zeroed"].outputs[0].token_ids
    assert zeroed == [0] * 5  # a zero final norm: every logit 0, and the greedy draw the first id
    assert part.packed[0][:3].tolist() == [1, 1, 1] and not part.packed[0][3:].any()
    engine.add_request("plain", [1, 70, 71], sp)
    plain = run_to_completion(engine)["plain"].outputs[0].token_ids
    assert plain != zeroed and not part.packed[-1].any()
    engine.add_request("doubled", [1, 70, 71], sp, part_args={"head_scale": 2.0})  # (greedy: a positive scale)
    assert run_to_completion(engine)["doubled"].outputs[0].token_ids == plain
    assert compilation_count() == before, "writing the part's state recompiled a program"
    engine.add_request("aborted", [1, 70, 71], sp, part_args={"head_scale": 0.0})
    engine.abort_request("aborted")
    with pytest.raises(InvalidParameterError, match="refuse: refused"):
        engine.make_request("refused", [1, 70, 71], sp, part_args={"head_scale": 0.0, "refuse": True})
    assert part.admitted == ["zeroed", "doubled", "aborted", "refused"]
    assert part.left == ["zeroed", "doubled", "aborted", "refused"]


# --- over HTTP (last: the server's loop owns the engine from here on) ---------------------------------


@pytest.fixture(scope="module")
def server(llm):
    thread = ServerThread(llm, model_name="procs").start()
    try:
        yield thread
    finally:
        thread.stop()


def test_http_vllm_xargs_and_extra_args(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    force = {"force": STAR, "at": [0, 1, 2]}
    out = client.completions.create(model="procs", prompt="def f(", max_tokens=5, temperature=0.0,
                                    extra_body={"vllm_xargs": force})
    assert out.choices[0].text.startswith("***")
    chat = client.chat.completions.create(model="procs", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0.0, extra_body={"extra_args": force})
    assert chat.choices[0].message.content.startswith("***")
    # Refusals name the field as the client wrote it; the server goes on serving.
    for field, body in [("vllm_xargs", {"vllm_xargs": {"ban": [10**6]}}), ("extra_args", {"extra_args": {"ban": "x"}}),
                        ("vllm_xargs", {"vllm_xargs": {"ban": [1]}, "extra_args": {"ban": [2]}})]:
        bad = httpx.post(server.url + "/v1/completions", json={"model": "procs", "prompt": "x", "max_tokens": 2, **body},
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    again = client.completions.create(model="procs", prompt="def f(", max_tokens=5, temperature=0.0,
                                      extra_body={"extra_args": force})
    assert again.choices[0].text == out.choices[0].text
