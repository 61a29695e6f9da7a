"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers, through conversion, the paged forward and the engine.

Tiny random `MixtralForCausalLM` / `Qwen2MoeForCausalLM` / `Qwen3MoeForCausalLM` models (fp32, weights large enough
that routing differs token to token) are saved with `save_pretrained`, converted by
`model.convert_hf` and run: prompt log-probabilities in one call, in page-straddling
chunks and token by token (test_hf_parity's runner) within 1e-4 of HF's; the engine's
greedy tokens (through the paged forward for both; through the engine, with chunked
prefill and prefix caching, for Qwen3-MoE and a sliding Mixtral) identical to HF's greedy
loop over 16 tokens, and a second round of requests compiles nothing.

Three of the models slide their attention windows, shorter than the prompts: a Mixtral (every
layer), a Qwen2-MoE whose `use_sliding_window` and `max_window_layers` leave some layers full
(its `config.json` without `layer_types`, so conversion applies the family's rule) and a Qwen3-MoE
(every layer); `test_windows_are_exercised` checks that other windows break parity.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model.convert_hf import ConversionError, convert  # noqa: E402
from model.config import LlamaConfig  # noqa: E402
from model.families import from_hf_config, num_params  # noqa: E402
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
    # Sliding windows shorter than the prompts (14, 5 and 11 tokens); 5 is no multiple of the page size (4).
    # Mixtral slides every layer.
    "mixtral_sliding": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=5)),
    # Qwen2-MoE with use_sliding_window slides its even layers below max_window_layers: of 4 layers, 0 and 2
    # (Qwen2's rule, the layers from max_window_layers on, would slide layer 3 alone).
    "qwen2_moe_sliding": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                          dict(num_hidden_layers=4, intermediate_size=64, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                               use_sliding_window=True, sliding_window=4, max_window_layers=3)),
    # Qwen3-MoE with use_sliding_window slides every layer (max_window_layers is not read).
    "qwen3_moe_sliding": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                          dict(intermediate_size=64, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                               norm_topk_prob=True, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
}
SEEDS = {name: i for i, name in enumerate(HF_MODELS)}
# Each sliding model's per-layer windows, and other windows that must break its parity (`test_windows_are_exercised`).
WINDOWS = {
    "mixtral_sliding": ((5, 5), [dict(sliding_window=None)]),
    # Qwen2's rule, which slides other layers (3 alone) and most of them not (0 and 2).
    "qwen2_moe_sliding": ((4, None, 4, None), [dict(layer_types=("full_attention",) * 3 + ("sliding_attention",))]),
    "qwen3_moe_sliding": ((6, 6), [dict(sliding_window=None)]),
}


def _drop_layer_types(hf: dict) -> dict:
    """A `config.json` as exports before transformers 5 wrote it: the family's rule then says which layers slide."""
    return {k: v for k, v in hf.items() if k != "layer_types"}


GREEDY_TOKENS = 16


def make_hf_moe(name: str, seed: int):
    config_class, model_class, extra = HF_MODELS[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**COMMON, **extra})).eval()
    scale_weights_(model)  # large enough that routing differs token to token
    return model


@pytest.fixture(scope="module", params=list(HF_MODELS))
def converted(request, tmp_path_factory):
    name = request.param
    seed = SEEDS[name]
    model = make_hf_moe(name, seed)
    edit = _drop_layer_types if name == "qwen2_moe_sliding" else None
    hf_dir, out_dir, cfg, params = save_and_convert(model, tmp_path_factory, name, edit_config=edit)
    rng = np.random.default_rng(200 + seed)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (14, 5, 11)]
    return name, model, hf_dir, out_dir, cfg, params, prompts


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _hf_windows(hf) -> tuple:
    """Each layer's window as transformers runs the model: Qwen2-MoE's by its `layer_types`, the others'
    the config's window on every layer (None: full attention)."""
    if hf.model_type == "qwen2_moe":
        return tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    return (hf.sliding_window,) * hf.num_hidden_layers


def test_config_is_the_families(converted):
    name, model, _, out_dir, cfg, _, _ = converted
    family = name.removesuffix("_sliding")
    hf = model.config
    assert cfg.num_experts == (hf.num_local_experts if family == "mixtral" else hf.num_experts)
    assert cfg.num_experts_per_tok == hf.num_experts_per_tok
    assert cfg.moe_router == ("topk_softmax" if family == "mixtral" else "softmax_topk")
    assert cfg.qk_norm == (family == "qwen3_moe")
    assert cfg.attention_bias == (family == "qwen2_moe")
    assert cfg.shared_expert_intermediate_size == hf.to_dict().get("shared_expert_intermediate_size", 0)
    assert cfg.norm_topk_prob == (family == "mixtral" or hf.norm_topk_prob)  # Mixtral's routing renormalises
    assert cfg.moe_intermediate_size == (hf.intermediate_size if family == "mixtral" else hf.moe_intermediate_size)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    # The windows transformers runs, read from config.json and kept by the converted checkpoint's config.
    windows = WINDOWS[name][0] if name in WINDOWS else (None,) * hf.num_hidden_layers
    assert cfg.layer_windows() == _hf_windows(hf) == windows
    with open(os.path.join(out_dir, "model_config.json")) as f:
        assert LlamaConfig.from_dict(json.load(f)) == cfg


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prompt_logprob_parity(converted, mode):
    name, model, _, _, cfg, params, prompts = converted
    expected = [_log_softmax(hf_logits(model, p)) for p in prompts]
    got = MODES[mode](Runner(cfg, params, seed=3), prompts)
    diff = max(float(np.max(np.abs(_log_softmax(got[s]) - expected[s]))) for s in range(len(prompts)))
    assert max(float(np.max(np.abs(e))) for e in expected) > 1.0
    assert diff < TOL, f"{name} {mode}: max |logprob diff| {diff:.3g}"


def test_sliding_settings_follow_transformers():
    """Each layer's window as the installed transformers derives it from the config's fields (sliding_window,
    use_sliding_window, max_window_layers, layer_types), for configs with and without `layer_types`."""
    sizes = dict(COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_local_experts=4,
                 num_experts_per_tok=2)
    checked = 0
    for config_class, model_class, _ in (HF_MODELS["mixtral"], HF_MODELS["qwen2_moe"], HF_MODELS["qwen3_moe"]):
        for layers, below, on, window in ((5, 3, True, 7), (6, 28, True, 7), (3, 0, True, 7), (4, 2, False, 7),
                                          (2, 1, True, None)):
            fields = dict(sizes, num_hidden_layers=layers, sliding_window=window, max_window_layers=below)
            if config_class is not transformers.MixtralConfig:
                fields["use_sliding_window"] = on
            hf = config_class(**fields)
            d = {**hf.to_dict(), "architectures": [model_class.__name__]}
            for written in (d, _drop_layer_types(d)):
                assert from_hf_config(written).layer_windows() == _hf_windows(hf), (model_class.__name__, fields)
                checked += 1
    assert checked == 30


@pytest.mark.parametrize("converted", list(WINDOWS), indirect=True)
def test_windows_are_exercised(converted):
    """Other windows than transformers' break parity (the prompts are longer than the windows), so the parity
    above is of windows that ran, on the layers the family's rule picks."""
    name, model, _, _, cfg, params, prompts = converted
    expected = [_log_softmax(hf_logits(model, p)) for p in prompts]
    for other in WINDOWS[name][1]:
        got = MODES["one_call"](Runner(cfg.replace(**other), params, seed=3), prompts)
        diff = max(float(np.max(np.abs(_log_softmax(got[s]) - expected[s]))) for s in range(len(prompts)))
        assert diff > 1e-2, (name, other, diff)


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
    # One family through the engine (their blocks differ only in what the paged forward tests cover), and a
    # sliding one: every layer slides, so the engine releases the pages behind the window.
    if name not in ("qwen3_moe", "mixtral_sliding"):
        pytest.skip("the engine path is the same for every family")
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
    if name == "mixtral_sliding":
        assert llm.engine.block_manager.window == 5
        assert llm.engine.block_manager.num_released_pages > 0


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
