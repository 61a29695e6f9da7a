"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers, through conversion, the paged forward and the engine.

Tiny random `MixtralForCausalLM` / `Qwen2MoeForCausalLM` / `Qwen3MoeForCausalLM` models (fp32, weights large enough
that routing differs token to token) are saved with `save_pretrained`, converted by
`model.convert_hf` and run: prompt log-probabilities in one call, in page-straddling
chunks and token by token (test_hf_parity's runner) within 1e-4 of HF's; the engine's
greedy tokens (through the paged forward for both; through the engine, with chunked
prefill and prefix caching, for Qwen3-MoE) identical to HF's greedy loop over 16 tokens,
and a second round of requests compiles nothing.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model.convert_hf import ConversionError, convert  # noqa: E402
from model.families import num_params  # noqa: E402
from test_hf_parity import MODES, TOL, Runner, hf_greedy, hf_logits, save_and_convert, scale_weights_  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, tie_word_embeddings=False, max_position_embeddings=256)
HF_MODELS = {
    # 8 experts, top 2; routing: softmax over the top-2 logits.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0)),
    # 4 experts, top 2, renormalised; q/k/v biases and a gated shared expert beside the routed ones.
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=40,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6)),
    # 6 experts, top 3, no renormalisation (so the weights do not sum to 1); q/k head norms.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=64, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3,
                       norm_topk_prob=False, rms_norm_eps=1e-6)),
}
GREEDY_TOKENS = 16


def make_hf_moe(name: str, seed: int):
    config_class, model_class, extra = HF_MODELS[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**COMMON, **extra)).eval()
    scale_weights_(model)  # large enough that routing differs token to token
    return model


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def converted(request, tmp_path_factory):
    name = request.param
    seed = sorted(HF_MODELS).index(name)
    model = make_hf_moe(name, seed)
    hf_dir, out_dir, cfg, params = save_and_convert(model, tmp_path_factory, name)
    rng = np.random.default_rng(200 + seed)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (14, 5, 11)]
    return name, model, hf_dir, out_dir, cfg, params, prompts


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_config_is_the_families(converted):
    name, model, _, _, cfg, _, _ = converted
    hf = model.config
    assert cfg.num_experts == (hf.num_local_experts if name == "mixtral" else hf.num_experts)
    assert cfg.num_experts_per_tok == hf.num_experts_per_tok
    assert cfg.moe_router == ("topk_softmax" if name == "mixtral" else "softmax_topk")
    assert cfg.qk_norm == (name == "qwen3_moe")
    assert cfg.attention_bias == (name == "qwen2_moe")
    assert cfg.shared_expert_intermediate_size == (40 if name == "qwen2_moe" else 0)
    assert cfg.norm_topk_prob == (name != "qwen3_moe")
    assert cfg.moe_intermediate_size == (hf.intermediate_size if name == "mixtral" else hf.moe_intermediate_size)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prompt_logprob_parity(converted, mode):
    name, model, _, _, cfg, params, prompts = converted
    expected = [_log_softmax(hf_logits(model, p)) for p in prompts]
    got = MODES[mode](Runner(cfg, params, seed=3), prompts)
    diff = max(float(np.max(np.abs(_log_softmax(got[s]) - expected[s]))) for s in range(len(prompts)))
    assert max(float(np.max(np.abs(e))) for e in expected) > 1.0
    assert diff < TOL, f"{name} {mode}: max |logprob diff| {diff:.3g}"


def _runner_greedy(cfg, params, prompts, n):
    """Greedy continuation of every prompt through the paged forward, all sequences in one
    batch: the prompts prefilled together, then `n - 1` steps of one decode each."""
    runner = Runner(cfg, params, seed=5)
    pool = np.random.default_rng(5).permutation(32)  # 8 scattered pages (32 tokens) per sequence
    runner.tables = [pool[8 * s:8 * (s + 1)].tolist() for s in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    last = runner.step([(s, p, 0) for s, p in enumerate(prompts)])
    for _ in range(n):
        for s in range(len(seqs)):
            seqs[s].append(int(np.argmax(last[s][-1])))
        last = runner.step([(s, seqs[s][-1:], len(seqs[s]) - 1) for s in range(len(seqs))])
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def test_greedy_matches_hf(converted):
    name, model, _, _, cfg, params, prompts = converted
    expected = [hf_greedy(model, p, GREEDY_TOKENS) for p in prompts]
    assert _runner_greedy(cfg, params, prompts, GREEDY_TOKENS) == expected


def test_engine_greedy_with_chunks_and_prefix_cache(converted):
    """Greedy tokens through the engine equal HF's: a 16-token budget chunks the prompts, the
    second round reuses the first's cached prefixes, and compiles nothing new."""
    from serving import LLM, SamplingParams
    from serving.core.model_runner import compilation_count

    name, model, _, out_dir, cfg, _, prompts = converted
    if name != "qwen3_moe":  # one family through the engine (its blocks are the other's plus q/k norms)
        pytest.skip("the engine path is the same for both families")
    llm = LLM(out_dir, page_size=4, max_model_len=32, num_pages=48, max_num_batched_tokens=16, max_num_seqs=4,
              min_token_bucket=16, min_context_bucket=32, attention_backend="reference")
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
    compiled = compilation_count()
    hits = llm.engine.stats().prefix_cache_hit_tokens
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[::-1], sp)]
    assert llm.engine.stats().prefix_cache_hit_tokens > hits
    assert compilation_count() == compiled, "the MoE step compiled again for new requests"
    expected = [hf_greedy(model, p, GREEDY_TOKENS) for p in prompts]
    assert first == expected
    assert again == expected[::-1]


def test_mixed_dense_and_sparse_layers_are_refused(tmp_path):
    """Every layer must declare the same weights: Qwen3-MoE's dense-layer options are refused by name."""
    model = make_hf_moe("qwen3_moe", 0)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    base = json.loads(path.read_text())
    for field, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2)):
        path.write_text(json.dumps({**base, field: value}))
        with pytest.raises(ConversionError, match=field):
            convert(str(tmp_path), str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")
