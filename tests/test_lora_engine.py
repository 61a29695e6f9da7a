"""Multi-LoRA serving in the engine: mixed batches, slots changing without recompiles, caches keyed by adapter.

One tiny random Llama (written by transformers, converted) and four PEFT adapters (written by `peft`,
random B, different ranks and targets) are shared by the module; one engine serves them all.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from model.quant import GroupQuantizedArray, dequantize, dequantize_grouped, is_quantized  # noqa: E402
from model.quantize import quantize_params  # noqa: E402
from serving import LLM, LoRARequest, SamplingParams  # noqa: E402
from serving.spec_decode import SpecDecoder
from serving.core.model_runner import compilation_count  # noqa: E402
from tests.test_hf_parity import hf_greedy, save_and_convert, scale_weights_  # noqa: E402
from serving.features.lora import LoraManager, adapter_name  # noqa: E402
from tests.test_lora_format import BASES, make_adapter  # noqa: E402

MAX_TOKENS = 6
ADAPTERS = {  # name -> (target modules, rank)
    "sql": (["q_proj", "v_proj"], 4),
    "chat": (["q_proj", "k_proj", "v_proj", "o_proj"], 8),
    "code": (["gate_proj", "up_proj", "down_proj"], 8),
    "late": (["q_proj", "o_proj", "down_proj"], 2),
}
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, min_token_bucket=8, page_size=8, num_pages=64,
              max_model_len=64, min_context_bucket=64, enable_lora=True, max_loras=3, max_lora_rank=8,
              max_cpu_loras=3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_cls, config_cls, kwargs = BASES["llama"]
    torch.manual_seed(11)
    hf = model_cls(config_cls(**kwargs)).eval()
    scale_weights_(hf)
    hf_dir, _, cfg, params = save_and_convert(hf, tmp_path_factory, "lora_engine")
    paths, peft_models = {}, {}
    for i, (name, (targets, rank)) in enumerate(sorted(ADAPTERS.items())):
        paths[name] = str(tmp_path_factory.mktemp(f"adapter_{name}"))
        peft_models[name] = make_adapter(hf_dir, paths[name], targets, rank, False, seed=20 + i)
    return cfg, params, hf, paths, peft_models


@pytest.fixture(scope="module")
def llm(setup):
    cfg, params, _, paths, _ = setup
    modules = ",".join(f"{n}={paths[n]}" for n in ("sql", "chat", "code"))
    return LLM(config=cfg, params=params, lora_modules=modules, warmup=True, **ENGINE)


def prompts(n, seed=0, length=10):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 97, length + i).tolist() for i in range(n)]


def greedy(llm, batch, lora):
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_adapter_tokens_match_peft(setup, llm):
    _, _, hf, _, peft_models = setup
    p = prompts(1, seed=1)[0]
    assert greedy(llm, [p], None)[0] == hf_greedy(hf, p, MAX_TOKENS)
    for name in ("sql", "chat", "code"):
        assert greedy(llm, [p], name)[0] == hf_greedy(peft_models[name], p, MAX_TOKENS), name


def test_mixed_batch_equals_alone_and_slots_change_without_recompiles(setup, llm):
    """Base + three adapters in one batch (max_loras=3) give each request its tokens alone; then a fourth
    adapter loaded at run time and one unloaded between requests, with no compilation at all."""
    _, _, _, paths, peft_models = setup
    batch = prompts(8, seed=2)
    loras = [None, "sql", "chat", "code"] * 2
    alone = [greedy(llm, [p], lora)[0] for p, lora in zip(batch, loras)]
    before = compilation_count()
    assert greedy(llm, batch, loras) == alone
    manager = llm.engine.part(LoraManager)
    assert manager.unregister("code") == 0
    with pytest.raises(Exception, match="no LoRA adapter named 'code'"):
        greedy(llm, [batch[0]], "code")
    late = greedy(llm, batch[:2], [LoRARequest("late", 4, paths["late"]), "sql"])
    assert late[0] == hf_greedy(peft_models["late"], batch[0], MAX_TOKENS)
    assert late[1] == alone[1]
    llm.engine.part(LoraManager).register("code", paths["code"])  # back, for the other tests
    assert greedy(llm, [batch[3]], "code")[0] == alone[3]
    assert compilation_count() == before, "changing adapters recompiled a program"


def test_more_adapters_than_slots_never_share_a_step(setup, llm, monkeypatch):
    """Four adapters (and the base) with three slots: every step holds at most max_loras distinct ones, and
    every request still gets its tokens alone."""
    _, _, _, paths, _ = setup
    if "late" not in llm.engine.part(LoraManager).names():
        llm.engine.part(LoraManager).register("late", paths["late"])
    batch = prompts(10, seed=3, length=6)
    loras = [None, "sql", "chat", "code", "late"] * 2
    alone = {i: greedy(llm, [p], lora)[0] for i, (p, lora) in enumerate(zip(batch, loras))}
    seen = []
    assign = llm.engine.part(LoraManager).assign

    def spy(scheduled, running):
        scheduled = list(scheduled)
        seen.append({adapter_name(it.seq) for it in scheduled} - {None})
        return assign(scheduled, running)

    monkeypatch.setattr(llm.engine.part(LoraManager), "assign", spy)
    assert greedy(llm, batch, loras) == [alone[i] for i in range(len(batch))]
    assert max(len(s) for s in seen) <= 3 and set().union(*seen) == {"sql", "chat", "code", "late"}


def test_prefix_cache_is_keyed_by_adapter(llm):
    """The attack: prime the cache with a prompt under one adapter, then send it under another and under
    the base model: neither may hit those pages (they hold K/V of other weights); the same adapter does."""
    p = prompts(1, seed=4, length=40)[0]
    engine = llm.engine
    engine.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def cached(lora):
        return llm.generate([p], sp, lora_request=lora)[0].num_cached_tokens

    assert cached("sql") == 0
    assert cached("chat") == 0
    assert cached(None) == 0
    assert cached("sql") > 0 and cached("chat") > 0 and cached(None) > 0


def test_unloading_an_adapter_in_use_is_deferred(llm, setup):
    _, _, _, paths, _ = setup
    engine = llm.engine
    engine.add_request("busy", prompts(1, seed=5)[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       part_args={"lora_name": "chat"})
    assert engine.part(LoraManager).unregister("chat") == 1  # deferred: one request still uses it
    assert "chat" not in engine.part(LoraManager).names()
    with pytest.raises(Exception, match="no LoRA adapter named 'chat'"):
        engine.make_request("new", [5, 6, 7], part_args={"lora_name": "chat"})
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert engine.part(LoraManager).path("chat") is None  # gone once its request finished
    engine.part(LoraManager).register("chat", paths["chat"])


def test_lora_options_are_checked(setup):
    cfg, params, _, paths, _ = setup
    with pytest.raises(ValueError, match="needs enable_lora"):
        LLM(config=cfg, params=params, lora_modules=f"sql={paths['sql']}", max_num_seqs=4,
            max_num_batched_tokens=16, num_pages=16, page_size=8)
    base = LLM(config=cfg, params=params, max_num_seqs=4, max_num_batched_tokens=16, num_pages=16, page_size=8)
    with pytest.raises(Exception, match="enable_lora is off"):
        base.generate([[5, 6]], lora_request="sql")


def test_kv_export_import_carries_the_adapter(llm):
    """A prompt prefilled under an adapter and shipped resumes the same adapter's request with its tokens
    alone; the payload names the adapter, and a request of another adapter or of the base is refused."""
    from serving.core.sampling_params import InvalidParameterError
    from serving.disaggregation import kv_transfer as kt
    from serving.disaggregation import kv_wire
    from tests.conftest import run_to_completion

    engine, keys = llm.engine, kv_wire.SigningKeys("k")
    p = prompts(1, seed=6, length=13)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = greedy(llm, [p], "sql")[0]
    first = sp.clone()
    first.max_tokens = 1
    exports = []
    req = engine.make_request("pre", p, first, part_args={"lora_name": "sql", "kv_export": kt.Exporter(exports.append)})
    engine.enqueue(req)
    run_to_completion(engine)
    payload = kt.encode_payload(exports[0], engine.cfg, engine.runner.kv_dtype, keys)
    header, body = kt.decode_payload(payload, keys, engine.cfg, engine.runner.kv_dtype, engine.max_model_len)
    assert header["lora"]["name"] == "sql"
    imp = kt.to_import(header, body, engine.cfg, engine.runner.kv_dtype)
    for other in (None, "chat"):
        wrong = engine.make_request(f"wrong-{other}", p, sp, part_args={"lora_name": other})
        with pytest.raises(InvalidParameterError, match="computed under LoRA adapter 'sql'"):
            kt.check_import(wrong, imp)
        engine.drop_request(wrong)
    engine.reset_prefix_cache()
    req = engine.make_request("resume", p, sp, part_args={"lora_name": "sql", "kv_import": imp})
    engine.enqueue(req)
    assert list(run_to_completion(engine)["resume"].outputs[0].token_ids) == want


def test_tensor_parallel_slots(tmp_path_factory):
    """Under 2-way tensor parallelism the slots are split like their base weights (B of wq by q heads, A of
    wo and w_down by their input) and a batch mixing the base and two adapters gives PEFT's tokens (a base
    whose vocabulary splits over two devices)."""
    model_cls, config_cls, kwargs = BASES["llama"]
    torch.manual_seed(12)
    hf = model_cls(config_cls(**{**kwargs, "vocab_size": 128})).eval()
    scale_weights_(hf)
    hf_dir, _, cfg, params = save_and_convert(hf, tmp_path_factory, "lora_tp")
    paths, models = {}, {None: hf}
    for i, name in enumerate(("a", "b")):
        paths[name] = str(tmp_path_factory.mktemp(f"tp_adapter_{name}"))
        models[name] = make_adapter(hf_dir, paths[name], ["q_proj", "v_proj", "o_proj", "down_proj"], 8, False,
                                    seed=60 + i)
    modules = ",".join(f"{n}={p}" for n, p in paths.items())
    batch = prompts(3, seed=8)
    loras = [None, "a", "b"]
    want = [hf_greedy(models[lora], p, MAX_TOKENS) for p, lora in zip(batch, loras)]  # PEFT's, on one device
    tp = LLM(config=cfg, params=params, lora_modules=modules, tensor_parallel_size=2, **ENGINE)
    slots = tp.engine.runner.weight_states[0]
    assert slots["wq"][1].sharding.spec[1] is not None and slots["wq"][0].sharding.spec[2] is None
    assert slots["wo"][0].sharding.spec[2] is not None and slots["w_down"][0].sharding.spec[2] is not None
    assert greedy(tp, batch, loras) == want


def test_pipeline_stages(setup, llm):
    """Two pipeline stages (two microbatches) hold each its layers' slots: a batch mixing the base and the
    three adapters gives the tokens of the one-device engine alone, and swapping an adapter into a slot
    between batches recompiles nothing."""
    cfg, params, _, paths, _ = setup
    modules = ",".join(f"{n}={paths[n]}" for n in ("sql", "chat", "code"))
    batch = prompts(4, seed=10)
    loras = [None, "sql", "chat", "code"]
    alone = [greedy(llm, [p], lora)[0] for p, lora in zip(batch, loras)]
    pp = LLM(config=cfg, params=params, lora_modules=modules, pipeline_parallel_size=2, num_microbatches=2,
             **ENGINE)
    a_wq = pp.engine.runner.weight_states[0]["wq"][0]
    assert a_wq.shape[:2] == (2, cfg.num_layers // 2) and a_wq.sharding.spec[0] == "pipeline"
    assert greedy(pp, batch, loras) == alone
    before = compilation_count()
    pp.engine.part(LoraManager).register("late", paths["late"])
    assert greedy(pp, batch[:2], ["late", "sql"])[1] == alone[1]
    assert compilation_count() == before


def dequantized(params):
    """`params` with every quantized weight widened back to float32 (what its kind represents)."""
    def widen(x):
        if isinstance(x, GroupQuantizedArray):
            return dequantize_grouped(x)
        return dequantize(x) if is_quantized(x) else x
    return jax.tree_util.tree_map(widen, params, is_leaf=is_quantized)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4_g32", "fp8_g32"])
def test_quantized_base(setup, kind):
    """Over quantized base weights of each kind (per-channel int8 and fp8, int4 and fp8 in groups of 32) a
    mixed batch gives each request its tokens alone, the adapters changing them; and they are the tokens
    of the float engine over the dequantized weights with the same adapters: each adapter's delta adds to
    the quantized base's product as PEFT adds it to the base weight."""
    cfg, params, _, paths, _ = setup
    modules = ",".join(f"{n}={paths[n]}" for n in ("sql", "chat", "code"))
    batch = prompts(4, seed=8)
    loras = [None, "sql", "chat", "code"]
    q = LLM(config=cfg, params=params, lora_modules=modules, weight_dtype=kind, **ENGINE)
    mixed = greedy(q, batch, loras)
    assert mixed == [greedy(q, [p], lora)[0] for p, lora in zip(batch, loras)]
    assert mixed[1:] != [greedy(q, [p], None)[0] for p in batch[1:]]
    _, qparams = quantize_params(params, cfg, kind)
    widened = LLM(config=cfg, params=dequantized(qparams), lora_modules=modules, **ENGINE)
    assert greedy(widened, batch, loras) == mixed


@pytest.mark.parametrize("options", [
    dict(speculative_method="ngram", num_speculative_tokens=3),
    dict(num_pages=12, async_scheduling=False, enable_prefix_caching=False),
], ids=["ngram_speculation", "preemption"])
def test_mixed_batch_with_speculation_and_preemption(setup, llm, options):
    """Prompt-lookup speculation (each verified draft row runs its sequence's adapter) and a pool so small
    that sequences are preempted and recomputed, with chunked prefills (the budget is 32 tokens): each
    request of a base + three adapters batch gets its tokens alone (from the plain LoRA engine)."""
    cfg, params, _, paths, _ = setup
    modules = ",".join(f"{n}={paths[n]}" for n in ("sql", "chat", "code"))
    rng = np.random.default_rng(9)
    # Repeats (drafts to find); 16 tokens = 2 full pages, so every decode needs a third page.
    batch = [(rng.integers(3, 97, 3).tolist() * 6)[:16] for _ in range(8)]
    loras = [None, "sql", "chat", "code"] * 2
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # 5 pages a sequence: 40 for 8

    def run(engine_llm, prompts_, loras_):
        return [list(o.outputs[0].token_ids) for o in engine_llm.generate(prompts_, sp, lora_request=loras_)]

    alone = [run(llm, [p], lora)[0] for p, lora in zip(batch, loras)]
    other = LLM(config=cfg, params=params, lora_modules=modules, **{**ENGINE, **options})
    assert run(other, batch, loras) == alone
    engine = other.engine
    if engine.part(SpecDecoder) is not None:
        assert engine.stats().spec_decode.num_accepted_tokens > 0
    else:
        assert engine.scheduler.num_preemptions > 0
    engine.block_manager.check_invariants(live_seq_ids=())
