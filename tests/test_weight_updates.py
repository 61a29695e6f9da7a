"""Weight updates of a running engine: `LLM.get_weights`, `LLM.update_weights`, `LLM.reset_prefix_cache`
(`serving.features.weight_updates`), and a prefix cache that never serves K/V computed under older weights."""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from model.convert_hf import conversion_plan
from model.params import flatten_params, init_params
from model.quantize import quantize_params
from model.tokenizer import ByteTokenizer
from serving import LLM, SamplingParams
from serving.compilation import compile_cache
from serving.core.block_manager import BlockManager
from serving.core.model_runner import compilation_count
from serving.core.sequence import Request

V = 300
CFG = tiny_config(vocab_size=V, max_position_embeddings=256)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, num_pages=48, min_token_bucket=32,
              min_context_bucket=96)
PROMPT = [1] + list(range(10, 30))  # 21 tokens: its first page (16) is cacheable
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def build(params, **kw) -> LLM:
    return LLM(config=CFG, params=params, tokenizer=ByteTokenizer(V), **ENGINE, **kw)


def run(llm, prompt=PROMPT):
    """(token ids, prompt tokens served from the prefix cache) of one greedy request."""
    out = llm.generate([prompt], GREEDY)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def on_host(tree):
    return jax.tree.map(np.asarray, tree)


def placed_like(tree, engine_tree):
    """`tree`'s values placed exactly as the engine holds its own (same shardings, committed)."""
    return jax.tree.map(lambda x, t: jax.device_put(np.asarray(x), t.sharding), tree, engine_tree)


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def p0():
    return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def p1():
    return init_params(CFG, jax.random.key(1))


@pytest.fixture(scope="module")
def llm(p0):
    return build(p0)


@pytest.fixture(scope="module")
def fresh1(p1):
    """An engine built on the new weights: what an updated engine must answer."""
    return build(p1)


def test_rebinding_takes_the_callers_arrays(llm, p0, p1):
    """Arrays that already have the engine's shardings and dtypes become the engine's leaves as they are."""
    new = placed_like(p1, llm.get_weights())
    before = llm.weight_version
    assert llm.update_weights(new) == before + 1 == llm.weight_version
    got = jax.tree.leaves(llm.get_weights())
    assert len(got) == len(jax.tree.leaves(new)) and all(a is b for a, b in zip(got, jax.tree.leaves(new)))
    llm.update_weights(placed_like(p0, llm.get_weights()), version=100)
    assert llm.weight_version == 100


def test_update_from_host_matches_a_fresh_engine_and_the_prefix_cache_follows(llm, fresh1, p0, p1):
    """Host numpy weights are placed; the same prompt hits the prefix cache before the update, not after
    it (its pages hold K/V of the old weights), and answers as an engine built on the new weights."""
    llm.update_weights(on_host(p0))
    before, _ = run(llm)
    assert run(llm)[1] > 0  # a repeat under the same weights hits
    llm.update_weights(on_host(p1))
    after, cached = run(llm)
    assert cached == 0
    want, _ = run(fresh1)
    assert after == want != before
    assert run(llm) == (want, 16)  # and under the new weights it caches again
    shardings = [x.sharding for x in jax.tree.leaves(fresh1.get_weights())]
    assert [x.sharding for x in jax.tree.leaves(llm.get_weights())] == shardings


def test_nothing_compiles_over_many_updates(llm, p0, p1):
    """Ten updates (host arrays, the engine's own placement) with a generate after each: no step program,
    no backend compile."""
    run(llm)
    steps, backend = compilation_count(), compile_cache.compile_counts()
    start = llm.weight_version
    for i in range(10):
        weights = (p0, p1)[i % 2]
        llm.update_weights(on_host(weights) if i % 3 else placed_like(weights, llm.get_weights()))
        run(llm)
    assert llm.weight_version == start + 10
    assert compilation_count() == steps
    assert (compile_cache.compile_counts() - backend).compiled == 0


def test_hugging_face_names(llm, fresh1, p1):
    """A flat dict keyed by Hugging Face tensor names (as a trainer's state dict holds them)."""
    flat = {k: np.asarray(v) for k, v in flatten_params(p1).items()}
    hf = {t.hf: flat[t.ours].reshape(t.hf_shape) for t in conversion_plan(CFG)}
    assert all(name.endswith(".weight") for name in hf)
    llm.update_weights(hf)
    assert leaves_equal(llm.get_weights(), p1)
    assert run(llm)[0] == run(fresh1)[0]
    hf.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        llm.update_weights(hf)


def test_bad_input_names_the_leaf_and_changes_nothing(llm, p0, p1):
    llm.update_weights(on_host(p0))
    held, version, epoch = jax.tree.leaves(llm.get_weights()), llm.weight_version, llm.engine.weights_epoch
    good = on_host(p1)

    def with_leaf(name, value):
        flat = flatten_params(good)
        flat[name] = value
        return flat

    bad = {
        "missing": (with_leaf("layers.1.wq", None), "missing.*layers.1.wq"),
        "shape": (with_leaf("layers.1.w_up", np.zeros((3, 3), np.float32)), r"layers.1.w_up: shape \(3, 3\)"),
        "dtype": (with_leaf("final_norm", np.asarray(good.final_norm, np.float16)), "final_norm: dtype float16"),
        "not an array": (with_leaf("embed", 3.0), "embed: expected an array"),
        "a nested list": (with_leaf("embed", good.embed.tolist()), r"missing \[.embed.\]"),
        "extra": ({**flatten_params(good), "layers.7.wq": good.embed}, "unexpected.*layers.7.wq"),
    }
    for what, (weights, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            llm.update_weights(weights)
        # the leaves before the bad one were valid too: none was replaced
        assert all(a is b for a, b in zip(jax.tree.leaves(llm.get_weights()), held)), what
        assert llm.weight_version == version and llm.engine.weights_epoch == epoch
    with pytest.raises(ValueError, match="version"):
        llm.update_weights(good, version="v2")
    assert llm.weight_version == version


def test_our_flat_names(llm, p1):
    llm.update_weights({k: np.asarray(v) for k, v in flatten_params(p1).items()})
    assert leaves_equal(llm.get_weights(), p1)


def test_tensor_parallel_engine_takes_weights_of_another_placement(fresh1, p0, p1):
    """A TP=2 engine updated from host arrays and from another engine's single-device arrays answers as
    the engine built on those weights, its leaves keeping their TP shardings."""
    tp = build(p0, tensor_parallel_size=2)
    shardings = [x.sharding for x in jax.tree.leaves(tp.get_weights())]
    assert len(tp.get_weights().layers[0].wq.sharding.device_set) == 2
    old, _ = run(tp)
    want, _ = run(fresh1)
    tp.update_weights(on_host(p1))
    assert run(tp) == (want, 0)
    tp.update_weights(on_host(p0))
    assert run(tp)[0] == old
    steps = compilation_count()
    tp.update_weights(fresh1.get_weights())  # committed to one device: resharded leaf by leaf
    assert [x.sharding for x in jax.tree.leaves(tp.get_weights())] == shardings
    assert run(tp) == (want, 0)
    assert compilation_count() == steps  # (JAX compiled its resharding copies, once per leaf shape)
    backend = compile_cache.compile_counts()
    tp.update_weights(on_host(p0))
    tp.update_weights(fresh1.get_weights())
    assert run(tp) == (want, 0)
    assert compilation_count() == steps and (compile_cache.compile_counts() - backend).compiled == 0


def test_int8_engine_quantizes_float_updates_as_at_load(p0, p1):
    """An int8 engine quantizes float weights as it does at load (the same bytes); its quantized form is
    taken as it is; after the first update's quantizers nothing compiles."""
    q = build(p0, weight_dtype="int8")
    before, _ = run(q)
    q.update_weights(on_host(p1))
    _, want = quantize_params(p1, CFG, "int8")
    assert leaves_equal(q.get_weights(), want)
    assert run(q)[0] != before
    steps, backend = compilation_count(), compile_cache.compile_counts()
    q.update_weights(p0)  # float device arrays
    assert run(q)[0] == before
    assert compilation_count() == steps and (compile_cache.compile_counts() - backend).compiled == 0
    quantized = placed_like(want, q.get_weights())
    q.update_weights(quantized)
    assert all(a is b for a, b in zip(jax.tree.leaves(q.get_weights()), jax.tree.leaves(quantized)))
    flat = {k: np.asarray(v) for k, v in flatten_params(p1).items()}
    flat["layers.0.wq"] = flat["layers.0.wq"].astype(np.int32)
    with pytest.raises(ValueError, match=r"layers.0.wq: dtype int32"):
        q.update_weights(flat)


def test_reset_prefix_cache(llm, p0):
    llm.update_weights(on_host(p0))
    run(llm)
    assert run(llm)[1] > 0
    assert llm.reset_prefix_cache() > 0
    assert run(llm)[1] == 0


def test_block_digests_follow_the_weights_epoch():
    """A request made after an update names its blocks apart from one made before (so the device pool
    and the host tier, both keyed by these digests, never hit across weights); epoch 0 keeps the names
    of an engine that never updated."""
    bm = BlockManager(8, 4)
    ids = list(range(1, 13))

    def digests(epoch, salt=None):
        req = Request("r", None, ids, SamplingParams(max_tokens=1), 0, 0.0, cache_salt=salt, weights_epoch=epoch)
        return bm.block_digests(req.seqs[0], 3)

    plain = Request("r", None, ids, SamplingParams(max_tokens=1), 0, 0.0)
    assert digests(0) == bm.block_digests(plain.seqs[0], 3)
    assert len({digests(0)[0], digests(1)[0], digests(2)[0], digests(1, "s")[0]}) == 4
    assert digests(1) == digests(1)


def test_a_step_in_flight_finishes_under_the_old_weights(llm, fresh1, p0, p1):
    """With overlapped scheduling an update may come while a step is dispatched: that step keeps the arrays
    it was given (its token is the old weights'), the next dispatched step runs the new ones."""
    from conftest import run_to_completion

    llm.update_weights(on_host(p0))
    old, _ = run(llm)
    engine = llm.engine
    assert engine.overlap
    engine.add_request("in-flight", PROMPT, GREEDY)
    engine.step()  # the prefill, dispatched and not yet processed
    llm.update_weights(on_host(p1))
    out = run_to_completion(engine)["in-flight"]
    new, _ = run(fresh1)
    assert new[0] != old[0]  # (so the first token tells which weights the dispatched step ran)
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].token_ids[0] == old[0]
    assert run(llm) == (new, 0)


MOE_CFG = tiny_config(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=256, architecture="Qwen3MoeForCausalLM", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, moe_router="softmax_topk", qk_norm=True,
                      norm_topk_prob=True)


def hf_tensors(params, cfg) -> dict:
    """`params` under their Hugging Face names (the converter's plan read backwards: reshapes, experts)."""
    flat = {k: np.asarray(v) for k, v in flatten_params(params).items()}
    out = {}
    for t in conversion_plan(cfg):
        a = flat[t.ours] if t.stack is None else flat[t.ours][t.stack[0]]
        out[t.hf] = a.reshape(t.hf_shape)
    return out


def test_stacked_layers_take_per_layer_weights_and_hugging_face_experts():
    """An engine that stacks its layers for the layer scan (a mixture of experts, here on CPU) takes the
    model's per-layer weights and a Hugging Face dict (one tensor per expert), stacked as at load."""
    m0, m1 = init_params(MOE_CFG, jax.random.key(0)), init_params(MOE_CFG, jax.random.key(1))
    moe = LLM(config=MOE_CFG, params=m0, tokenizer=ByteTokenizer(V), **ENGINE)
    assert not isinstance(moe.get_weights().layers, list)
    before, _ = run(moe)
    stacked = lambda p: jax.tree.map(lambda *xs: np.stack(xs), *[on_host(x) for x in p.layers])  # noqa: E731
    moe.update_weights(hf_tensors(m1, MOE_CFG))
    assert leaves_equal(moe.get_weights().layers, stacked(m1)) and leaves_equal(moe.get_weights().embed, m1.embed)
    changed, _ = run(moe)
    moe.update_weights(on_host(m0))
    assert leaves_equal(moe.get_weights().layers, stacked(m0))
    assert run(moe) == (before, 0) and changed != before


def test_pipeline_engine_takes_its_staged_structure(fresh1, p0, p1):
    """A pipeline engine holds its weights staged: it takes that structure (placed stage by stage) and
    refuses the model's own, saying why."""
    pp = build(p0, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline stages"):
        pp.update_weights(on_host(p1))
    staged = on_host(pp.engine.runner.layout.stage_params(CFG, p1))
    shardings = [x.sharding for x in jax.tree.leaves(pp.get_weights())]
    pp.update_weights(staged)
    assert [x.sharding for x in jax.tree.leaves(pp.get_weights())] == shardings
    assert run(pp) == (run(fresh1)[0], 0)
