"""Pipeline parallelism on 8 CPU devices: `LLM(pipeline_parallel_size=P, tensor_parallel_size=T,
num_microbatches=M)`.

Greedy tokens of a mixed batch (chunked prefills next to decodes, ragged lengths, sequences cut
by microbatch boundaries) must equal the single-device engine's at PP=2 x TP=4 (KV heads
replicated inside a stage) and PP=4 x TP=2 (one KV head per device), with one microbatch (the
plain sequential pipeline) and several (including a count that does not divide the tokens).
Weights and KV pages must really live on their stage only, the step must not copy the KV pool,
nothing may compile after warm-up, and impossible layouts must fail with a clear message.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import greedy, ragged_prompts as prompts, tiny_config
from model.blocks import NO_WINDOW
from model.cache import cache_bytes, init_cache, pack_batch
from model.families import family_for_config
from model.forward import forward_jit
from model.params import abstract_params, init_params
from serving import LLM, SamplingParams
from serving.spec_decode import SpecDecoder
from serving.core.input_batch import StepShape
from serving.core.model_runner import _step_jit
from sharding import MeshError, make_mesh, param_shardings
from sharding.hlo import collectives, shape_dims
from sharding.pipeline import (PipelineError, copy_staged_pages, make_pipeline_layout, pipeline_forward_jit,
                               stage_layer_inputs)

CFG = tiny_config(vocab_size=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=8)
NUM_PAGES, PAGE = 48, 8
COMMON = dict(page_size=PAGE, max_model_len=64, num_pages=NUM_PAGES, max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=32, min_context_bucket=64, attention_backend="reference")


@functools.cache
def params():
    return init_params(CFG, jax.random.key(7))


@functools.cache
def single_device_tokens():
    return greedy(LLM(config=CFG, params=params(), **COMMON), prompts(CFG.vocab_size))


@functools.cache
def pipelined(pp, tp, m):
    """(LLM, its greedy tokens) for one layout; shared by the placement tests."""
    llm = LLM(config=CFG, params=params(), pipeline_parallel_size=pp, tensor_parallel_size=tp,
              num_microbatches=m, **COMMON)
    return llm, greedy(llm, prompts(CFG.vocab_size))


@pytest.mark.parametrize("pp,tp,m", [(2, 4, 1), (2, 4, 3), (4, 2, 4)])
def test_greedy_tokens_identical_to_single_device(pp, tp, m):
    want = single_device_tokens()
    assert sum(map(len, want)) == 48 and len({tuple(t) for t in want}) == 6  # not vacuous
    llm, got = pipelined(pp, tp, m)
    assert llm.engine.runner.layout.pipeline_parallel_size == pp
    assert got == want


@pytest.mark.parametrize("pp,tp,m", [(2, 4, 3), (4, 2, 4)])
def test_weights_and_kv_pages_live_on_their_stage_only(pp, tp, m):
    llm, _ = pipelined(pp, tp, m)
    runner = llm.engine.runner
    layout, staged, cache = runner.layout, runner.params, runner.cache
    per_stage = CFG.num_layers // pp
    host = params()
    stage_of = {d: s for s in range(pp) for d in layout.mesh.devices[:, s, :].flat}
    for j, layer in enumerate(staged.stages):
        for name in ("wq", "wk", "w_down", "attn_norm"):
            arr = getattr(layer, name)
            # Content: stage s's block is global layer s * L/p + j ...
            want = np.concatenate([np.asarray(getattr(host.layers[s * per_stage + j], name)) for s in range(pp)])
            np.testing.assert_array_equal(np.asarray(arr), want)
            # ... and each device holds a piece of its own stage's block, nothing else.
            rows = arr.shape[0] // pp
            for shard in arr.addressable_shards:
                first = shard.index[0].start or 0
                assert first // rows == (first + shard.data.shape[0] - 1) // rows == stage_of[shard.device]
    # Bytes per device: exactly 1/p of what tensor parallelism alone keeps per device.
    tp_only = param_shardings(CFG, make_mesh(tensor=tp), "megatron")
    tp_layer_bytes = sum(
        np.prod(sh.shard_shape(a.shape)) * a.dtype.itemsize
        for layer, layer_sh in zip(host.layers, tp_only.layers)
        for a, sh in zip(jax.tree.leaves(layer), jax.tree.leaves(layer_sh)))
    staged_bytes = {}
    for a in jax.tree.leaves(staged.stages):
        for shard in a.addressable_shards:
            staged_bytes[shard.device] = staged_bytes.get(shard.device, 0) + shard.data.nbytes
    assert len(staged_bytes) == pp * tp
    assert set(staged_bytes.values()) == {tp_layer_bytes // pp}
    # KV: each device holds its stage's L/p layers of every page, its share of the KV heads.
    kv_local = CFG.num_kv_heads // tp if tp <= CFG.num_kv_heads else CFG.num_kv_heads
    assert len(cache.k) == per_stage
    for arr in cache.k + cache.v:
        assert {s.data.shape for s in arr.addressable_shards} == {(NUM_PAGES, PAGE, kv_local, CFG.head_dim)}
    full = cache_bytes(init_cache(CFG, NUM_PAGES, PAGE))
    kv_bytes = {}
    for a in cache.k + cache.v:
        for shard in a.addressable_shards:
            kv_bytes[shard.device] = kv_bytes.get(shard.device, 0) + shard.data.nbytes
    assert set(kv_bytes.values()) == {full // pp * kv_local // CFG.num_kv_heads}


# --- the pipelined forward against the plain one --------------------------------------------------


def steps():
    """Two steps: two prefills (7 and 6 tokens), then a decode, a second chunk and a new prompt."""
    rng = np.random.default_rng(0)
    return [
        [(rng.integers(3, 128, 7), 0, [0, 1, 2]), (rng.integers(3, 128, 6), 0, [3, 4, 5, 6])],
        [(rng.integers(3, 128, 1), 7, [0, 1, 2]), (rng.integers(3, 128, 4), 6, [3, 4, 5, 6]),
         (rng.integers(3, 128, 3), 0, [7, 8])],
    ]


def run_steps(fn, p, cache):
    out = []
    for chunks in steps():
        tokens, md = pack_batch(chunks, page_size=4, num_pages=16, num_tokens=16, max_seqs=4, pages_per_seq=5,
                                logits_rows=4)
        logits, cache = fn(p, cache, tokens, md)
        out.append(np.asarray(logits))
    return out


@functools.cache
def reference_logits():
    return run_steps(lambda p, c, t, md: forward_jit(p, c, t, md, CFG, "reference"), params(),
                     init_cache(CFG, 16, 4))


@pytest.mark.parametrize("pp,tp,m", [(2, 4, 3), (4, 2, 16), (2, 1, 5), (2, 2, 64)])
def test_pipelined_forward_logits_match(pp, tp, m):
    """m=3 and 5 do not divide the 16 tokens (padded microbatches); m=16 is one token each,
    so every multi-token chunk is cut across microbatches; m=64 is capped at the 16 tokens."""
    layout = make_pipeline_layout(pp, tp, m)
    fn = lambda p, c, t, md: pipeline_forward_jit(p, c, t, md, CFG, "reference", layout)
    got = run_steps(fn, layout.stage_params(CFG, params()), layout.init_cache(CFG, 16, 4))
    for a, b in zip(got, reference_logits()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_pallas_kernels_run_inside_the_stages():
    """The Pallas kernels (interpreted) inside each stage's tensor-parallel shard_map, fed the
    derived per-microbatch metadata (sequences with no token in a microbatch in the middle of
    the batch). TP=4 over 2 KV heads: each device slices its replicated KV head."""
    cfg = tiny_config(vocab_size=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16)
    host = init_params(cfg, jax.random.key(3))
    want = run_steps(lambda p, c, t, md: forward_jit(p, c, t, md, cfg, "reference"), host, init_cache(cfg, 16, 4))
    layout = make_pipeline_layout(2, 4, 3)
    fn = lambda p, c, t, md: pipeline_forward_jit(p, c, t, md, cfg, "pallas_interpret", layout)
    got = run_steps(fn, layout.stage_params(cfg, host), layout.init_cache(cfg, 16, 4))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_step_keeps_the_kv_pool_in_place_and_hands_activations_forward():
    """One KV head per device (PP=2 x TP=2): a stage-local squeeze of the pool once made XLA
    copy it in and out of every step. The compiled step aliases the pool, copies neither it nor
    any weight, moves activations between stages with collective-permutes and all-gathers no
    weight."""
    llm, _ = pipelined(4, 2, 4)
    runner = llm.engine.runner
    shape = StepShape(32, 8, 8)
    ibuf, fbuf, _ = shape.empty(NUM_PAGES * PAGE)
    ibuf, fbuf = jax.device_put((ibuf, fbuf), runner.layout.replicated)
    hlo = _step_jit.lower(runner.params, runner.cache, ibuf, fbuf, cfg=CFG, backend="reference", shape=shape,
                          layout=runner.layout).compile().as_text()
    assert "input_output_alias" in hlo.split("\n", 1)[0]
    local_pool = re.escape(f"[{NUM_PAGES},{PAGE},1,{CFG.head_dim}]")
    staged_pool = re.escape(f"[{4 * NUM_PAGES},{PAGE},1,{CFG.head_dim}]")
    copies = [line for line in hlo.splitlines() if re.search(r"\bcopy\(", line)]
    assert not [c for c in copies if re.search(local_pool, c) or re.search(staged_pool, c)]
    kinds = [c["kind"] for c in collectives(hlo)]
    assert "collective-permute" in kinds
    weight_shapes = {tuple(a.shape) for a in jax.tree.leaves(params())}
    gathered = {shape_dims(c["shape"]) for c in collectives(hlo) if c["kind"] == "all-gather"}
    assert not gathered & weight_shapes


def test_copy_on_write_copies_pages_on_every_stage():
    layout = make_pipeline_layout(2, 2)
    cache = layout.init_cache(CFG, 6, 2)
    rng = np.random.default_rng(1)
    values = [rng.standard_normal(a.shape).astype(np.float32) for a in cache.k + cache.v]
    cache = jax.tree.map(lambda a, v: jax.device_put(v, a.sharding), cache,
                         type(cache)(k=values[:len(cache.k)], v=values[len(cache.k):]))
    src, dst = np.array([1, 4, 0], np.int32), np.array([3, 5, 6], np.int32)  # 6 == pages: dropped
    out = jax.jit(copy_staged_pages, static_argnames="layout")(cache, src, dst, layout=layout)
    for got, before in zip(out.k + out.v, values):
        want = before.reshape(2, 6, *before.shape[1:]).copy()  # [stage, page, ...]
        want[:, 3], want[:, 5] = want[:, 1], want[:, 4]
        np.testing.assert_array_equal(np.asarray(got), want.reshape(before.shape))
        assert got.sharding == cache.k[0].sharding


def test_embedded_checkpoint_restores_into_stages_and_nothing_compiles_after_warm_up():
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if "backend_compile" in name else None)
    common = dict(COMMON, min_token_bucket=16)  # 16-token steps: 3 microbatches of 6 tokens, padded
    batch = prompts(256, n=4, seed=1)
    want = greedy(LLM(**common), batch)
    llm = LLM(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=3, warmup=True, **common)
    assert llm.warmup_info["shapes"] >= 2
    # Restored straight onto the stages: layer 3 of the checkpoint is stage 1's second layer.
    up = llm.engine.runner.params.stages[1].w_up
    assert len(up.sharding.device_set) == 4
    seen = len(events)
    assert greedy(llm, batch) == want
    llm.generate([[1, 5, 6]], SamplingParams(temperature=0.7, n=2, seed=3, max_tokens=3))
    assert len(events) == seen, "a backend compile happened after warm-up"


def test_impossible_layouts_are_clear_errors():
    with pytest.raises(PipelineError, match="pipeline_parallel_size=3 must divide the model's 4 layers"):
        LLM(config=CFG, params=params(), pipeline_parallel_size=3, **COMMON)
    with pytest.raises(MeshError, match="needs 16 devices, but only 8"):
        LLM(config=CFG, params=params(), pipeline_parallel_size=4, tensor_parallel_size=4, **COMMON)
    with pytest.raises(ValueError, match="num_microbatches=2 needs pipeline_parallel_size > 1"):
        LLM(config=CFG, params=params(), num_microbatches=2, **COMMON)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        LLM(config=CFG, params=params(), pipeline_parallel_size=2, num_microbatches=0, **COMMON)


# --- every model family through the stages ----------------------------------------------------------

_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_router="softmax_topk")
_GEMMA = dict(norm_offset=1.0, scale_embeddings=True, hidden_act="gelu_tanh", sandwich_norms=True,
              query_pre_attn_scalar=16.0, tie_word_embeddings=True)
# The steps' sequences reach 13 tokens, so a window of 4 hides keys; Gemma 3's four layers put a
# global layer first on stage 1 (stage-local layer 0), so a stage reading another stage's windows
# or RoPE bases, or its layers' in the wrong order, computes something else.
FAMILY_CONFIGS = {
    "qwen2": tiny_config(**_SMALL, architecture="Qwen2ForCausalLM", attention_bias=True),
    "qwen3": tiny_config(**_SMALL, architecture="Qwen3ForCausalLM", qk_norm=True, tie_word_embeddings=True),
    "mistral_sliding": tiny_config(**_SMALL, architecture="MistralForCausalLM", sliding_window=4),
    "phi3": tiny_config(**_SMALL, architecture="Phi3ForCausalLM", sliding_window=4),
    "gemma2": tiny_config(**_SMALL, architecture="Gemma2ForCausalLM", **_GEMMA, sliding_window=4,
                          layer_types=("sliding_attention", "full_attention"), attn_logit_softcap=5.0,
                          final_logit_softcap=3.0),
    "gemma3": tiny_config(**dict(_SMALL, num_layers=4), architecture="Gemma3ForCausalLM", **_GEMMA, qk_norm=True,
                          sliding_window=4, rope_theta=1e6, rope_local_theta=1e4,
                          layer_types=("sliding_attention", "sliding_attention", "full_attention",
                                       "sliding_attention")),
    "mixtral": tiny_config(**_SMALL, architecture="MixtralForCausalLM", **dict(_MOE, moe_router="topk_softmax")),
    "qwen2_moe": tiny_config(**_SMALL, architecture="Qwen2MoeForCausalLM", **_MOE, attention_bias=True,
                             shared_expert_intermediate_size=24),
    "qwen3_moe": tiny_config(**_SMALL, architecture="Qwen3MoeForCausalLM", **_MOE, qk_norm=True, norm_topk_prob=True),
}


def _random_params(cfg, seed=5):
    """Random weights drawn on the host, biases and norms included: norms scale by about one, as trained
    ones do, whether a family stores the scale (w) or its offset from one (Gemma's 1 + w)."""
    rng = np.random.default_rng(seed)
    center = 1.0 - cfg.norm_offset

    def draw(a):
        if a.ndim == 1:
            return (center + 0.2 * rng.standard_normal(a.shape)).astype(np.float32)
        return (rng.standard_normal(a.shape) / np.sqrt(a.shape[-1])).astype(np.float32)

    return jax.tree.map(draw, abstract_params(cfg))


@pytest.mark.parametrize("name,tp", [(n, 1) for n in FAMILY_CONFIGS] + [("qwen2_moe", 2), ("gemma3", 2)])
def test_every_family_pipelined_forward_matches_the_plain_forward(name, tp):
    """The stages run the family's own blocks: biases, q/k norms, Gemma's norms, scalings and soft caps,
    per-layer windows and RoPE bases, and the experts (split over `tensor` inside each stage at TP=2:
    expert parallelism)."""
    cfg = FAMILY_CONFIGS[name]
    host = _random_params(cfg)
    layout = make_pipeline_layout(2, tp, 3)
    staged = layout.stage_params(cfg, host)
    # Every weight of every layer is staged, the family's optional ones included.
    assert type(staged.stages[0]) is type(host.layers[0])
    assert len(jax.tree.leaves(staged.stages)) * 2 == len(jax.tree.leaves(host.layers))
    want = run_steps(lambda p, c, t, md: forward_jit(p, c, t, md, cfg, "reference"), host, init_cache(cfg, 16, 4))
    got = run_steps(lambda p, c, t, md: pipeline_forward_jit(p, c, t, md, cfg, "reference", layout), staged,
                    layout.init_cache(cfg, 16, 4))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_each_stage_gets_its_own_layers_per_layer_data():
    cfg = FAMILY_CONFIGS["gemma3"]
    per_layer = family_for_config(cfg).blocks.layer_inputs(cfg)
    for stage, windows in ((0, [4, 4]), (1, [NO_WINDOW, 4])):
        got = stage_layer_inputs(per_layer, jnp.int32(stage), 2)
        assert np.asarray(got.window).tolist() == windows
        np.testing.assert_array_equal(np.asarray(got.inv_freq), np.asarray(per_layer.inv_freq)[2 * stage:2 * stage + 2])


# --- engines: a sliding-window family and a mixture of experts, controls and structured outputs -------

ENGINE = dict(page_size=4, max_model_len=64, num_pages=64, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, min_context_bucket=64, attention_backend="reference")
# Byte-level vocabulary, so the engine has a tokenizer (structured outputs compile against it).
SLIDING = tiny_config(**dict(_SMALL, vocab_size=320), architecture="MistralForCausalLM", sliding_window=8)
MOE = FAMILY_CONFIGS["qwen3_moe"]


@functools.cache
def family_engines(name):
    """(the plain engine, PP=2 with 2 microbatches) over the same random weights."""
    cfg = {"sliding": SLIDING, "moe": MOE}[name]
    host = _random_params(cfg, seed=9)
    return (LLM(config=cfg, params=host, **ENGINE),
            LLM(config=cfg, params=host, pipeline_parallel_size=2, num_microbatches=2, **ENGINE))


@pytest.mark.parametrize("name", ["sliding", "moe"])
def test_family_engine_greedy_tokens_identical(name):
    plain, piped = family_engines(name)
    assert piped.engine.runner.layout.pipeline_parallel_size == 2
    cfg = plain.config
    batch = prompts(cfg.vocab_size, n=4, seed=2, max_len=30)
    want = greedy(plain, batch, max_tokens=12)
    assert len({tuple(t) for t in want}) == len(batch)  # not vacuous
    assert greedy(piped, batch, max_tokens=12) == want
    if name == "sliding":  # every layer slides: both block managers let pages before the window go
        assert piped.engine.block_manager.window == plain.engine.block_manager.window == 8


def _texts(llm, batch, sps):
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(batch, sps)]


def test_sampling_controls_and_structured_outputs_under_stages():
    plain, piped = family_engines("sliding")
    assert any(state is not None for state in piped.engine.runner.part_states)  # the controls' slot state
    batch = prompts(SLIDING.vocab_size, n=4, seed=3, max_len=20)
    free = greedy(plain, batch, max_tokens=10)
    sps = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={free[0][0]: -100.0, 65: 5.0}),
           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8,
                          presence_penalty=0.5),
           SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, bad_words=[chr(free[2][1])],
                          ignore_eos=True),
           SamplingParams(temperature=0.8, seed=4, max_tokens=10, ignore_eos=True, frequency_penalty=0.7)]
    want = _texts(plain, batch, sps)
    assert want[0][0] != free[0] and free[0][0] not in want[0][0]  # the controls changed something
    assert want[1][0] != free[1]
    assert _texts(piped, batch, sps) == want

    sp = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": "(ab|cd){1,4}x"})
    want = [o.outputs[0].text for o in plain.generate(batch[:2], sp)]
    assert all(re.fullmatch("(ab|cd){1,4}x", t) for t in want), want
    assert [o.outputs[0].text for o in piped.generate(batch[:2], sp)] == want


# --- speculative decoding through the stages ----------------------------------------------------------


def _spec_prompts(n=4, seed=4):
    """Ragged prompts, every other one a repeated pattern (prompt lookup finds drafts there)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(4, 20))
        if i % 2:
            body = np.tile(rng.integers(3, CFG.vocab_size, int(rng.integers(2, 5))), length)[:length]
        else:
            body = rng.integers(3, CFG.vocab_size, length)
        out.append([1] + [int(t) for t in body])
    return out


SPEC = dict(ENGINE, max_model_len=32, num_pages=32, min_context_bucket=32)  # one step shape


@functools.cache
def spec_baseline():
    return greedy(LLM(config=CFG, params=params(), **SPEC), _spec_prompts(), max_tokens=10)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_through_the_stages_gives_the_plain_greedy_tokens(method):
    """PP=2 with 2 microbatches verifies drafts in its one step: prompt lookup, and a draft model (the
    target's weights perturbed, so drafts are both accepted and rejected) replicated over the pipeline's
    mesh. Greedy tokens of a mixed batch (prefill chunks beside verifying decodes) are the plain engine's."""
    noisy = jax.tree.map(lambda w: w + 0.3 * w.std() * jax.random.normal(jax.random.key(3), w.shape, w.dtype),
                         params())
    llm = LLM(config=CFG, params=params(), pipeline_parallel_size=2, num_microbatches=2, speculative_method=method,
              num_speculative_tokens=3, speculative_draft=(CFG, noisy), **SPEC)
    assert greedy(llm, _spec_prompts(), max_tokens=10) == spec_baseline()
    st = llm.engine.stats().spec_decode
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    if method == "draft":
        assert st.num_accepted_tokens < st.num_draft_tokens
        draft = llm.engine.part(SpecDecoder).proposer
        mesh_devices = set(llm.engine.runner.layout.mesh.devices.flat)
        assert all(a.sharding.device_set == mesh_devices for a in jax.tree.leaves((draft.params, draft.cache)))
