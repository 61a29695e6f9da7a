"""The decoder families beyond Llama against transformers: Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3.

For each family a tiny random HF model (fp32) is saved with `save_pretrained`, converted by
`model.convert_hf` and run two ways:

* through `model.forward` directly (the parity harness of `test_hf_parity`: ragged
  sequences with scattered pages, prefilled in one call, in chunks, and token by token),
  max |logit diff| < 1e-4 against HF running each sequence alone;
* through the engine (`LLM`): greedy tokens identical to `transformers`' `generate` over
  16 tokens, with prefix caching on (a prompt that extends another hits the cache) and
  prefills chunked by a small token budget; TP=2 gives the tokens TP=1 gives, and int8
  weights run with prompt logprobs close to transformers' (on two families each: an
  engine compile is the costly part of these tests).

The configs turn on what each family adds (biases, q/k norms, sliding windows shorter than
the prompts, soft-caps low enough to bite, local/global layers with their own RoPE bases),
and `test_family_features_are_exercised` checks that switching a feature off breaks parity,
so the parity is not of a feature nobody ran.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_parity import MODES, Runner, hf_greedy, run_one_call, save_and_convert, scale_weights_  # noqa: E402

TOL = 1e-4
BASE = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=None,
            pad_token_id=0)

# name: (HF config class, HF model class, config overrides, a feature switch that must break parity, or None
# where the checkpoint itself proves the feature: its bias / q-k norm / fused tensors are random and read)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False), None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True), None),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=False),
                dict(sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=7, tie_word_embeddings=False), None),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                    final_logit_softcapping=8.0, hidden_activation="gelu_pytorch_tanh"),
               dict(attn_logit_softcap=None)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=20,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
               dict(rope_local_theta=None)),
}
NAMES = sorted(FAMILIES)


def make_hf_model(name: str, seed: int):
    """The family's tiny model with weights large enough that a layout mistake shows in the logits."""
    config_cls, model_cls, overrides, _ = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**BASE, **overrides})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    gemma = name.startswith("gemma")  # Gemma scales norms by (1 + w) and its embedding by sqrt(hidden)
    scale_weights_(model, norm_center=0.0 if gemma else 1.0, bias_std=0.5,
                   embed_std=0.5 / (math.sqrt(cfg.hidden_size) if gemma else 1.0))
    return model


@pytest.fixture(scope="module", params=NAMES)
def converted(request, tmp_path_factory):
    name = request.param
    seed = NAMES.index(name)
    model = make_hf_model(name, seed)
    _, out_dir, cfg, params = save_and_convert(model, tmp_path_factory, name)
    rng = np.random.default_rng(200 + seed)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (14, 5, 11)]
    with torch.no_grad():
        expected = [model(torch.tensor([p])).logits[0].numpy() for p in prompts]
    return dict(name=name, model=model, out_dir=out_dir, cfg=cfg, params=params, prompts=prompts,
                expected=expected, seed=seed)


def _max_diff(got, expected):
    return max(float(np.max(np.abs(got[s] - expected[s]))) for s in range(len(expected)))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_logit_parity(converted, mode):
    c = converted
    assert c["cfg"].architecture == FAMILIES[c["name"]][1]
    got = MODES[mode](Runner(c["cfg"], c["params"], c["seed"]), c["prompts"])
    diff = _max_diff(got, c["expected"])
    print(f"{c['name']} {mode}: max |logit diff| = {diff:.3g}")
    assert max(float(np.max(np.abs(e))) for e in c["expected"]) > 1.0  # not a comparison of near-zeros
    assert diff < TOL, f"{c['name']} {mode}: max |logit diff| {diff:.3g} >= {TOL}"


@pytest.mark.parametrize("converted", [n for n in NAMES if FAMILIES[n][3]], indirect=True)
def test_family_features_are_exercised(converted):
    """Turning the family's window / soft-cap / local RoPE off must break parity: the prompts are longer
    than the windows, the caps low enough to bite, so the parity above is of features that ran."""
    c = converted
    off = FAMILIES[c["name"]][3]
    got = run_one_call(Runner(c["cfg"].replace(**off), c["params"], c["seed"]), c["prompts"])
    assert _max_diff(got, c["expected"]) > 1e-2, off


# --- through the engine ---------------------------------------------------------------------------------------

ENGINE = dict(page_size=4, max_model_len=64, num_pages=64, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, min_context_bucket=64)
NEW_TOKENS = 16


def _engine_prompts(c):
    """The parity prompts, and one that extends the first (its first pages then come from the prefix cache)."""
    rng = np.random.default_rng(300 + c["seed"])
    return c["prompts"], c["prompts"][0] + rng.integers(3, c["cfg"].vocab_size, 9).tolist()


def _greedy(llm, prompts, extended):
    """Greedy tokens of `prompts`, then of `extended`, whose prefix the first call left cached;
    and the prefix-cache hits of the second call."""
    from serving import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
    hits = llm.engine.stats().prefix_cache_hit_tokens
    tokens.append(list(llm.generate([extended], sp)[0].outputs[0].token_ids))
    return tokens, llm.engine.stats().prefix_cache_hit_tokens - hits


@pytest.fixture(scope="module")
def engine_run(converted):
    """TP=1 engine tokens of the family (prefix caching on, prefills chunked) and transformers' own."""
    from serving import LLM

    c = converted
    prompts, extended = _engine_prompts(c)
    tokens, hits = _greedy(LLM(c["out_dir"], **ENGINE), prompts, extended)
    return c, prompts, extended, tokens, hits, [hf_greedy(c["model"], p, NEW_TOKENS) for p in prompts + [extended]]


def test_engine_greedy_matches_transformers(engine_run):
    """Every prompt's 16 greedy tokens are transformers', with the extended prompt's prefill chunked by the
    token budget and its first pages taken from the prefix cache."""
    c, prompts, extended, tokens, hits, want = engine_run
    assert hits >= 8  # the extended prompt reused the first one's full pages
    assert len(extended) > ENGINE["max_num_batched_tokens"]  # so its prefill is chunked
    assert tokens == want


# TP=2 and int8 each cost an engine compile per family, so each runs on the families whose new weights or
# attention features they touch most: q/k/v biases split with their heads (Qwen2), q/k norms and mixed
# local/global windows through the sharded attention (Gemma 3); soft-capped attention and logits and the
# extra norms over int8 weights (Gemma 2).
@pytest.mark.parametrize("converted", ["qwen2", "gemma3"], indirect=True)
def test_engine_tp2_identical_to_tp1(engine_run):
    from serving import LLM

    c, prompts, extended, tokens, _, _ = engine_run
    llm = LLM(c["out_dir"], tensor_parallel_size=2, **ENGINE)
    assert len(llm.engine.runner.params.layers[0].wq.sharding.device_set) == 2
    assert _greedy(llm, prompts, extended)[0] == tokens


@pytest.mark.parametrize("converted", ["gemma2"], indirect=True)
def test_engine_int8_weights(converted):
    from serving import LLM, SamplingParams

    c = converted
    llm = LLM(c["out_dir"], weight_dtype="int8", **ENGINE)
    assert llm.config.weight_dtype == "int8"
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    diffs = []
    for out, p, logits in zip(llm.generate(c["prompts"], sp), c["prompts"], c["expected"]):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        want = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        got = np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], p[1:])])
        diffs.append(np.abs(got - want[np.arange(len(p) - 1), p[1:]]))
    # Per-channel int8 moves a prompt logprob by a few hundredths here, not by the units a wrong layout would.
    diff = float(np.mean(np.concatenate(diffs)))
    print(f"{c['name']}: int8 mean |prompt logprob diff| = {diff:.3g}")
    assert 0 < diff < 0.2
