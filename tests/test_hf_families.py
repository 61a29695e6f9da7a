"""The decoder families beyond Llama against transformers: Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3.

For each family a tiny random HF model (fp32) is saved with `save_pretrained`, converted by
`model.convert_hf` and run two ways:

* through `model.forward` directly (the parity harness of `test_hf_parity`: ragged
  sequences with scattered pages, prefilled in one call, in chunks, and token by token),
  max |logit diff| < 1e-4 against HF running each sequence alone;
* through the engine (`LLM`): greedy tokens identical to `transformers`' `generate` over
  16+ tokens with prompt logprobs within 1e-4, with prefix caching on (a prompt that
  extends another hits the cache) and prefills chunked by a small token budget; TP=2
  gives the tokens TP=1 gives; int8 weights run and stay close.

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

from model.checkpoint import load_checkpoint  # noqa: E402
from model.convert_hf import convert  # noqa: E402
from test_hf_parity import MODES, Runner, run_one_call  # noqa: E402

TOL = 1e-4
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)

# name: (HF config class, HF model class, config overrides, a feature switch that must break parity)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False), dict(attention_bias=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True), dict(qk_norm=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=False),
                dict(sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=7, tie_word_embeddings=False),
             dict(sliding_window=None)),
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
    """The family's tiny model with weights large enough that a layout mistake shows in the logits
    (HF's std-0.02 init would leave every logit near zero)."""
    config_cls, model_cls, overrides, _ = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**BASE, **overrides})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 and pname.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))  # Gemma scales by (1 + w)
            elif p.ndim == 1:  # biases
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in pname:
                p.normal_(0.0, 0.5 / (math.sqrt(cfg.hidden_size) if gemma else 1.0))
            else:
                p.normal_(0.0, 1.5 / math.sqrt(p.shape[1]))
    return model


@pytest.fixture(scope="module", params=NAMES)
def converted(request, tmp_path_factory):
    name = request.param
    seed = NAMES.index(name)
    model = make_hf_model(name, seed)
    hf_dir = str(tmp_path_factory.mktemp(f"hf_{name}"))
    out_dir = str(tmp_path_factory.mktemp(f"ours_{name}"))
    model.save_pretrained(hf_dir)
    convert(hf_dir, out_dir, dtype="float32", progress=False)
    cfg, params = load_checkpoint(out_dir)
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


def test_family_features_are_exercised(converted):
    """Turning the family's distinctive feature off must break parity, or the config tests nothing."""
    c = converted
    off = FAMILIES[c["name"]][3]
    got = run_one_call(Runner(c["cfg"].replace(**off), c["params"], c["seed"]), c["prompts"])
    assert _max_diff(got, c["expected"]) > 1e-2, off
