"""Every feature composes with every other: the pairwise matrix, generated and run.

Features are of two kinds:

* engine features, how an engine is built: 2-way tensor parallelism, 2 pipeline stages,
  prompt-lookup (ngram) or draft-model speculation, int8 weights, an int8 or fp8 KV cache,
  overlapped scheduling, a sliding-window family (Mistral), a mixture of experts (Qwen3-MoE; a
  sliding-window Qwen3-MoE where both meet), the host KV tier with swap preemption in a pool
  the workload overflows, LoRA adapters (two PEFT-format adapters, every job but one in three
  running one of them, so each step mixes base rows and both adapters), and logprobs reported from
  the processed distribution (`logprobs_mode="processed_logprobs"`);
* request features, what a request asks for: structured outputs, sampling controls, logprobs,
  n = 2, prefix-cache hits, a cache_salt, KV export / import (disaggregated prefill), and a
  reasoning phase (a thinking budget that forces the end tag; a grammar applies after it).

The engine configurations are a covering design (`covering_configs`): every allowed pair of engine
features is in at least one of them. Each configuration serves a workload with one request per
pair of request features (and one per feature), so every engine x request pair and every request
pair is exercised too. The test of each configuration is equivalence: every request's greedy
tokens equal those of the plain engine with the same model-changing settings (family, weight and
KV dtypes; `MODEL_FEATURES`) on one device (on two where TP meets a quantized KV cache:
`TP_WITH_QUANTIZED_KV` names the physical reason), without speculation, one step at a time. Equality
alone cannot see a feature whose handling both engines lost, so each request feature is also
checked for its own effect (and the adapters for theirs: jobs change tokens when run without one): only allowed ids and no bad word, the grammar matched, logprobs
reported and equal (and, processed, only over the tokens the controls allow), two samples, pages hit
or kept apart by the salt, the shipped prefill decoded, the end tag where the budget ran out.

A pair that is not run names its physical reason in `EXCLUDED` (docs/architecture.md shows the
same matrix). Two processes, the remaining feature of the matrix, runs in tests/test_multihost.py.
"""

from __future__ import annotations

import itertools
import json
import os
import re

import jax
import numpy as np
import pytest

from conftest import run_to_completion, tiny_config
from model.params import init_params
from model.tokenizer import ByteTokenizer
from serving import LLM, SamplingParams
from serving.spec_decode import SpecDecoder
from serving.core.format_params import ReasoningParams
from serving.features.host_kv_tier import HostKVTier
from serving.features.lora import LoraManager
from test_disagg_engine import prefill, submit_import

V = 300  # a byte tokenizer's vocabulary fits (structured outputs need a tokenizer)
BASE = tiny_config(vocab_size=V, max_position_embeddings=128)
FAMILIES = {
    "dense": BASE,
    "sliding": BASE.replace(architecture="MistralForCausalLM", sliding_window=8),
    "moe": BASE.replace(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, moe_router="softmax_topk", norm_topk_prob=True),
}
FAMILIES["sliding_moe"] = FAMILIES["moe"].replace(sliding_window=8)  # Qwen3-MoE with use_sliding_window
# One step shape per engine (one token bucket, one context bucket): each configuration compiles once. The
# pool holds the whole workload, so the second run of a prompt finds its pages still cached.
SHAPES = dict(page_size=8, num_pages=240, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=32, min_context_bucket=64)

ENGINE_FEATURES = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2, num_microbatches=2),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=3),
    "draft": dict(speculative_method="draft", num_speculative_tokens=3),
    "int8_weights": dict(weight_dtype="int8"),
    "int8_kv": dict(kv_cache_dtype="int8"),
    "fp8_kv": dict(kv_cache_dtype="fp8"),
    "overlap": dict(async_scheduling=True),
    "sliding": {},  # the family: FAMILIES["sliding"]
    "moe": {},  # the family: FAMILIES["moe"]
    # The host KV tier with swap preemption, in a pool the workload overflows: sequences are swapped out and
    # back, and the second run of a prompt finds its pages on the host.
    "offload": dict(kv_offload_bytes=2**22, preemption_mode="swap", num_pages=24),
    # LoRA adapters: two, in two slots, of ranks 4 and 2 padded to 4 (`adapters`); jobs pick theirs (`LORA_OF`).
    "lora": dict(enable_lora=True, max_loras=2, max_lora_rank=4),
    # Logprobs of the distribution a token was drawn from (vLLM's --logprobs-mode processed_logprobs).
    "processed_logprobs": dict(logprobs_mode="processed_logprobs"),
}
# Features that change the model's numbers: the plain engine a configuration is compared with has them too.
MODEL_FEATURES = ("int8_weights", "int8_kv", "fp8_kv", "sliding", "moe", "lora", "processed_logprobs")
# Tensor parallelism sums partial products across devices in another order than one device does, so a
# value can move by an ulp; a quantized KV cache rounds values onto a coarse grid (fp8 keeps 3 mantissa
# bits), and a value near a grid midpoint then lands one step away. That difference, about 1e-3 in a
# logprob, parts greedy tokens wherever the top two are closer (with int8 weights, LoRA and an fp8 cache
# the first logprob moved by 4e-3 and a top-two gap of 6e-4 flipped). With a quantized cache, a
# configuration with TP is therefore compared with the plain engine on as many devices: every other
# feature is still held to identical tokens. TP against one device with a quantized cache is tested
# on a workload without such near-ties (test_quant.py).
TP_WITH_QUANTIZED_KV = ("tp2", ("int8_kv", "fp8_kv"))


def reference_features(config) -> tuple[str, ...]:
    """The features of the plain engine `config` is compared with (`MODEL_FEATURES`, `TP_WITH_QUANTIZED_KV`)."""
    key = tuple(f for f in config if f in MODEL_FEATURES)
    tp, kv_dtypes = TP_WITH_QUANTIZED_KV
    if tp in config and any(k in config for k in kv_dtypes):
        key = (tp,) + key
    return key
OVERLAP_WITH_SPECULATION = (
    "steps run one at a time: the next step's drafts, query positions and KV slots follow from how many "
    "drafts this step accepts, which only its verification decides")
EXCLUDED = {
    frozenset({"ngram", "draft"}): "one proposer per engine: a sequence's drafts come from one method",
    frozenset({"int8_kv", "fp8_kv"}): "one KV pool holds pages of one dtype",
    frozenset({"overlap", "ngram"}): OVERLAP_WITH_SPECULATION,
    frozenset({"overlap", "draft"}): OVERLAP_WITH_SPECULATION,
}
REQUEST_FEATURES = ("structured", "controls", "logprobs", "n2", "prefix", "salt", "kv_transfer", "thinking")


def covering_configs(features, excluded, required=None) -> list[tuple[str, ...]]:
    """Engine configurations (tuples of features) that together hold every allowed pair (with `required`:
    every allowed pair that holds it): greedily, each one starts from the first pair not yet covered and
    takes the feature that covers most uncovered pairs with those already in, while no excluded pair forms."""
    left = {frozenset(p) for p in itertools.combinations(features, 2)} - set(excluded)
    if required is not None:
        left = {p for p in left if required in p}
    configs = []
    while left:
        config = list(min(left, key=lambda p: sorted(features.index(f) for f in p)))
        while True:
            gains = {f: sum(frozenset({f, g}) in left for g in config) for f in features
                     if f not in config and not any(frozenset({f, g}) in excluded for g in config)}
            best = max(gains, key=lambda f: (gains[f], -features.index(f)), default=None)
            if best is None or gains[best] == 0:
                break
            config.append(best)
        configs.append(tuple(sorted(config, key=features.index)))
        left -= {frozenset(p) for p in itertools.combinations(config, 2)}
    return configs


# Features that switch how an engine reports rather than what it computes: their default is as much a
# setting to cover as they are, so the other features are covered without them (where their default
# holds), and each mode is then paired with every other feature in configurations of its own.
MODES = ("processed_logprobs",)
CONFIGS = covering_configs([f for f in ENGINE_FEATURES if f not in MODES], EXCLUDED) + [
    config for mode in MODES for config in covering_configs(list(ENGINE_FEATURES), EXCLUDED, required=mode)]


def test_the_configurations_cover_every_allowed_pair_and_no_excluded_one():
    pairs = set()
    for config in CONFIGS:
        for p in itertools.combinations(config, 2):
            assert frozenset(p) not in EXCLUDED, config
            pairs.add(frozenset(p))
    allowed = {frozenset(p) for p in itertools.combinations(ENGINE_FEATURES, 2)} - set(EXCLUDED)
    assert pairs == allowed
    assert len(CONFIGS) < len(allowed) // 3  # a covering design, not one engine per pair


def test_the_architecture_docs_show_each_excluded_pair_and_its_reason():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                           "architecture.md")) as f:
        doc = " ".join(f.read().split())
    for pair, reason in EXCLUDED.items():
        assert reason in doc, sorted(pair)


# --- the workload --------------------------------------------------------------------------------------

TOKENIZER = ByteTokenizer(V)
ALLOWED = sorted(set(TOKENIZER.encode("abcdefgh.", add_special_tokens=False)))
GRAMMAR = r"[a-h]{3,6}\."
# The reasoning phase: think tags of plain bytes the sampling controls allow, and a budget of 2 tokens.
THINK_END, THINK_BUDGET = "hh", 2
THINKING = ReasoningParams(TOKENIZER.encode("g", add_special_tokens=False),
                           TOKENIZER.encode(THINK_END, add_special_tokens=False), "thinking", THINK_BUDGET)


def job_params(features) -> SamplingParams:
    """A greedy request with the request features among `features` that act on sampling."""
    kw = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    if "structured" in features:
        kw.update(structured_outputs={"regex": GRAMMAR}, ignore_eos=False)
    if "controls" in features:
        kw.update(allowed_token_ids=ALLOWED, bad_words=["ab"], frequency_penalty=0.4, repetition_penalty=1.1,
                  min_tokens=3)
    if "logprobs" in features:
        kw.update(logprobs=2)
    if "n2" in features:
        kw.update(n=2)
    if "thinking" in features:
        kw.update(reasoning=THINKING, max_tokens=16)
    return SamplingParams(**kw)


def workload() -> list[tuple[str, tuple, list[int]]]:
    """(name, request features, prompt): one job per pair of request features and one per feature.
    Prompts are ragged, and every other one repeats a pattern (prompt lookup finds drafts there)."""
    rng = np.random.default_rng(0)
    combos = [(f,) for f in REQUEST_FEATURES] + list(itertools.combinations(REQUEST_FEATURES, 2))
    jobs = []
    for i, features in enumerate(combos):
        n = int(rng.integers(12, 40))
        if i % 2:
            body = (list(rng.integers(97, 105, int(rng.integers(2, 5)))) * n)[:n]
        else:
            body = list(rng.integers(3, 256, n))
        jobs.append(("+".join(features), features, [TOKENIZER.BOS] + [int(t) for t in body]))
    return jobs


JOBS = workload()
# The LoRA adapter each job runs with where the engine serves adapters (None: the base model); the cycle
# gives every request feature jobs under each adapter and under the base.
LORA_OF = {name: (None, "a", "b")[i % 3] for i, (name, _, _) in enumerate(JOBS)}


def salt_of(features, wave: int):
    return None if "salt" not in features else f"tenant-{wave}"


def lora_of(engine, name: str):
    """The job's adapter on `engine` (None where it serves none)."""
    return None if engine.part(LoraManager) is None else LORA_OF[name]


def run_jobs(engine, jobs, wave: int, without_lora: bool = False) -> dict:
    """Runs the jobs at once on `engine`; {name: RequestOutput}. A job with kv_transfer is left out here."""
    for name, features, prompt in jobs:
        engine.add_request(f"{name}#{wave}", prompt, job_params(features), cache_salt=salt_of(features, wave),
                           part_args={"lora_name": None if without_lora else lora_of(engine, name)})
    return {rid.split("#")[0]: out for rid, out in run_to_completion(engine).items()}


def import_and_decode(engine, name, features, prompt, payload: bytes):
    """The job resumed on `engine` from a shipped prefill (one sample: a prefill continues one)."""
    params = job_params(features)
    params.n = 1
    submit_import(engine, f"{name}#import", prompt, params, payload, cache_salt=salt_of(features, 1),
                  lora_name=lora_of(engine, name))
    (out,) = run_to_completion(engine).values()
    return out


def export_prefill(engine, name, features, prompt) -> bytes:
    return prefill(engine, f"{name}#export", prompt, job_params(features), cache_salt=salt_of(features, 1),
                   lora_name=lora_of(engine, name))


# --- engines ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def weights():
    return {name: init_params(cfg, jax.random.key(5)) for name, cfg in FAMILIES.items()}


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_adapter(path, cfg, targets, rank: int, seed: int) -> None:
    """A random adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`, tensors named
    as `peft` names them), its delta about as large as the base product (scaling 1)."""
    from safetensors.numpy import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size), "v_proj": (kv, cfg.hidden_size),
              "o_proj": (cfg.hidden_size, q), "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "up_proj": (cfg.intermediate_size, cfg.hidden_size), "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for t in targets:
            out_dim, in_dim = shapes[t]
            module = f"base_model.model.model.layers.{layer}.{'self_attn' if t in ATTENTION else 'mlp'}.{t}"
            tensors[module + ".lora_A.weight"] = rng.normal(0, in_dim ** -0.5, (rank, in_dim)).astype(np.float32)
            tensors[module + ".lora_B.weight"] = rng.normal(0, rank ** -0.5, (out_dim, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets)}, f)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """{family: the `lora_modules` of its two adapters}: "a" (rank 4: q, v and, where the layers are dense,
    the MLP's gate and down) and "b" (rank 2: every projection adapters reach; a mixture's experts take
    none)."""
    out = {}
    for family, cfg in FAMILIES.items():
        mlp = () if cfg.num_experts else MLP
        root = tmp_path_factory.mktemp(f"adapters_{family}")
        specs = {"a": (("q_proj", "v_proj") + mlp[::2], 4), "b": (ATTENTION + mlp, 2)}
        for i, (name, (targets, rank)) in enumerate(specs.items()):
            write_adapter(str(root / name), cfg, targets, rank, seed=40 + i)
        out[family] = ",".join(f"{name}={root / name}" for name in specs)
    return out


def family_of(config) -> str:
    if "moe" in config:
        return "sliding_moe" if "sliding" in config else "moe"
    return "sliding" if "sliding" in config else "dense"


def build(weights, adapters, config, **extra) -> LLM:
    family = family_of(config)
    options = dict(SHAPES, async_scheduling=False)
    for f in config:
        options.update(ENGINE_FEATURES[f])
    if "lora" in config:
        extra["lora_modules"] = adapters[family]
    if "draft" in config:  # the target itself drafts: most drafts are accepted, some are not (controls, grammar)
        extra["speculative_draft"] = (FAMILIES[family], weights[family])
    return LLM(config=FAMILIES[family], params=weights[family], tokenizer=TOKENIZER, **options, **extra)


_REFERENCES: dict = {}


def reference(weights, adapters, config):
    """The plain engine with `config`'s model-changing features, and its outputs of the workload (cached).
    With adapters, the jobs run again on the base model: some of those that use an adapter must change."""
    key = reference_features(config)
    if key not in _REFERENCES:
        llm = build(weights, adapters, key)
        outs = run_jobs(llm.engine, JOBS, wave=1)
        if llm.engine.part(LoraManager) is not None:
            plain = [j for j in JOBS if "kv_transfer" not in j[1]]
            base = run_jobs(llm.engine, plain, wave=3, without_lora=True)
            for adapter in ("a", "b"):
                names = [name for name, _, _ in plain if LORA_OF[name] == adapter]
                changed = [n for n in names if base[n].outputs[0].token_ids != outs[n].outputs[0].token_ids]
                assert len(changed) > len(names) // 2, (adapter, changed)
            assert all(base[n].outputs[0].token_ids == outs[n].outputs[0].token_ids
                       for n, _, _ in plain if LORA_OF[n] is None)
        _REFERENCES[key] = llm, outs
    return _REFERENCES[key]


def check_effects(name, features, out, want, samples=None, processed=False) -> None:
    """What each request feature does, seen in the output itself (`want`: the plain engine's; `samples`:
    how many it has, by default what its n asks; `processed`: the engine reports processed logprobs)."""
    assert len(out.outputs) == (samples or (2 if "n2" in features else 1)), name
    for o in out.outputs:
        text = TOKENIZER.decode(o.token_ids)
        if "thinking" in features:  # the end tag by the budget's end; what follows is the answer
            end = text.find(THINK_END)
            assert 0 <= end <= THINK_BUDGET, (name, text)
            text = text[end + len(THINK_END):]
        if "structured" in features:
            assert re.fullmatch(GRAMMAR, text), (name, text)
        if "controls" in features:
            assert set(o.token_ids) <= set(ALLOWED) and "ab" not in text and len(o.token_ids) >= 3, (name, text)
        if "logprobs" in features:
            assert len(o.logprobs) == len(o.token_ids), name
            for got_entry, want_entry in zip(o.logprobs, want.outputs[0].logprobs):
                assert sorted(got_entry) == sorted(want_entry), name
                for tid, lp in want_entry.items():  # (processed, a token the grammar bans is -inf in both)
                    got_lp = got_entry[tid].logprob
                    assert got_lp == lp.logprob or abs(got_lp - lp.logprob) < 2e-3, (name, tid)
                if processed and "controls" in features:  # drawn after the controls: banned ids have no mass
                    assert set(got_entry) <= set(ALLOWED), (name, sorted(got_entry))


@pytest.mark.parametrize("config", CONFIGS, ids=["+".join(c) for c in CONFIGS])
def test_every_pair_gives_the_plain_engines_tokens(weights, adapters, config):
    ref_llm, want = reference(weights, adapters, config)
    llm = build(weights, adapters, config)
    engine = llm.engine
    plain = [j for j in JOBS if "kv_transfer" not in j[1]]
    got = run_jobs(engine, plain, wave=1)
    processed = "processed_logprobs" in config
    for name, features, _ in plain:
        assert [o.token_ids for o in got[name].outputs] == [o.token_ids for o in want[name].outputs], name
        check_effects(name, features, got[name], want[name], processed=processed)

    # Prefix hits: the same prompts again, under the same salt (pages shared) or another (kept apart).
    again = [j for j in plain if "prefix" in j[1] or "salt" in j[1]]
    for name, features, prompt in again:
        wave = 2 if "salt" in features and "prefix" not in features else 1
        engine.add_request(f"{name}#again", prompt, job_params(features), cache_salt=salt_of(features, wave),
                           part_args={"lora_name": lora_of(engine, name)})
    second = {rid.split("#")[0]: out for rid, out in run_to_completion(engine).items()}
    for name, features, _ in again:
        assert [o.token_ids for o in second[name].outputs] == [o.token_ids for o in want[name].outputs], name
        if "prefix" in features:
            assert second[name].num_cached_tokens > 0, name
        else:  # another tenant's salt: no page of the first run is reused
            assert second[name].num_cached_tokens == 0, name

    # KV export / import: prefilled here and decoded by the plain engine, and the other way round.
    for name, features, prompt in [j for j in JOBS if "kv_transfer" in j[1]]:
        expected = want[name].outputs[0].token_ids
        shipped = import_and_decode(ref_llm.engine, name, features, prompt,
                                    export_prefill(engine, name, features, prompt))
        assert shipped.outputs[0].token_ids == expected, (name, "exported by this engine")
        check_effects(name, features, shipped, want[name], samples=1)
        received = import_and_decode(engine, name, features, prompt,
                                     export_prefill(ref_llm.engine, name, features, prompt))
        assert received.outputs[0].token_ids == expected, (name, "imported by this engine")

    if engine.part(SpecDecoder) is not None:
        st = engine.stats().spec_decode
        assert st.num_accepted_tokens > 0, st
    tier = engine.part(HostKVTier)
    if tier is not None:  # the tier was used: pages restored, each preemption counted by mode
        st = engine.stats().host_kv
        assert st.pages_restored > 0, st
        assert st.preemptions_swap + st.preemptions_recompute == engine.scheduler.num_preemptions, st
        tier.check_invariants()
    engine.block_manager.check_invariants(live_seq_ids=())
    ref_llm.engine.block_manager.check_invariants(live_seq_ids=())
