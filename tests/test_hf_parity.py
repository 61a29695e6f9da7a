"""Logit parity with transformers' LlamaForCausalLM, through conversion and the paged forward.

Random tiny HF models are saved with `save_pretrained` (safetensors, one of them
sharded with an index file), converted by `model.convert_hf` (in process, and
once through `python -m`), restored with `model.checkpoint.load_checkpoint` and
run through `model.forward` three ways: every prompt prefilled in one call,
prefilled in chunks that straddle page boundaries, and token by token through
the cache. Several sequences share each batch, their pages are scattered
(non-contiguous block tables) and their last pages partly filled. HF runs each
sequence alone, without a cache, in fp32: max |logit diff| must stay < 1e-4.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model.cache import init_cache, pack_batch  # noqa: E402
from model.checkpoint import load_checkpoint  # noqa: E402
from model.convert_hf import convert  # noqa: E402
from model.forward import forward  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4

# One static batch shape for every call, so each config compiles once.
PAGE_SIZE, NUM_PAGES, NUM_TOKENS, MAX_SEQS, PAGES_PER_SEQ = 4, 32, 32, 4, 8
PROMPT_LENS = (14, 5, 11)  # 30 tokens; last pages hold 2, 1 and 3 of 4 slots

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

HF_CONFIGS = {
    # GQA group 1 (plain multi-head attention), untied output head.
    "mha_untied": dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False),
    # GQA group 2, tied embeddings.
    "gqa2_tied": dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    # GQA group 3, Llama-3.1 rope scaling with every frequency band in play at head_dim 16;
    # head_dim != hidden / heads, so the explicit head_dim is what counts.
    "gqa3_llama3_rope": dict(vocab_size=97, hidden_size=72, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                             rope_scaling=LLAMA3_ROPE, max_position_embeddings=512, tie_word_embeddings=False),
    # Odd sizes, group 4, saved in shards and converted through the command line.
    "odd_sizes_sharded": dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=12, rms_norm_eps=1e-6,
                              tie_word_embeddings=False),
}


def make_hf_model(seed: int = 0, dtype=None, **config_kwargs):
    """A LlamaForCausalLM with weights large enough that a layout mistake shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_kwargs)).eval()
    scale_weights_(model)
    if dtype is not None:
        model = model.to(dtype)
    return model


def scale_weights_(model, *, norm_center: float = 1.0, bias_std=None, embed_std: float = 0.5):
    """Draws `model`'s weights again (from torch's current seed), large enough to matter.

    HF's default init (std 0.02, unit norms) makes every logit nearly zero, which
    would let transposed or mis-rotated weights pass. Here norm scales are
    `norm_center` + N(0, 0.3) (Gemma scales by 1 + w: center 0), biases
    N(0, `bias_std`) (None: drawn as norm scales are), the embedding N(0,
    `embed_std`) (tied heads then give logits up to ~20, like real models) and
    every matrix N(0, 1.5 / sqrt(fan-in)) (experts stacked in front: the last dim).
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and (bias_std is None or name.endswith("norm.weight")):
                p.copy_(norm_center + 0.3 * torch.randn_like(p))
            elif p.ndim == 1:
                p.normal_(0.0, bias_std)
            elif "embed_tokens" in name:
                p.normal_(0.0, embed_std)
            else:
                p.normal_(0.0, 1.5 / math.sqrt(p.shape[-1]))


def save_and_convert(model, tmp_path_factory, name: str, edit_config=None, after_save=None):
    """(HF directory, converted directory, config, params): `model` saved by transformers, converted
    in fp32 and loaded back. `edit_config`, when given, rewrites the saved `config.json` dict before
    conversion (e.g. to drop a field older exports do not write)."""
    hf_dir = str(tmp_path_factory.mktemp(f"hf_{name}"))
    out_dir = str(tmp_path_factory.mktemp(f"ours_{name}"))
    model.save_pretrained(hf_dir)
    if after_save is not None:  # e.g. write the processor's files beside the model's
        after_save(hf_dir)
    if edit_config is not None:
        path = os.path.join(hf_dir, "config.json")
        with open(path) as f:
            hf = json.load(f)
        with open(path, "w") as f:
            json.dump(edit_config(hf), f)
    convert(hf_dir, out_dir, dtype="float32", progress=False)
    cfg, params = load_checkpoint(out_dir)
    return hf_dir, out_dir, cfg, params


def hf_greedy(model, prompt, n: int) -> list:
    """transformers' greedy continuation of `prompt` (its own KV cache), exactly `n` tokens (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def save_hf(model, directory, max_shard_size=None):
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


_forward = jax.jit(forward, static_argnames=("cfg", "backend"))


class Runner:
    """Drives model.forward over a fixed batch shape, with scattered page allocations."""

    def __init__(self, cfg, params, seed: int):
        self.cfg, self.params = cfg, params
        self.cache = init_cache(cfg, NUM_PAGES, PAGE_SIZE)
        pool = np.random.default_rng(seed).permutation(NUM_PAGES)
        self.tables = [pool[i * PAGES_PER_SEQ:(i + 1) * PAGES_PER_SEQ][:5].tolist() for i in range(3)]
        assert any(t != sorted(t) for t in self.tables)

    def step(self, chunks):
        """chunks: [(seq, token_ids, start)]; returns {seq: logits [len, vocab]} for every new token."""
        tokens, md = pack_batch([(ids, start, self.tables[s]) for s, ids, start in chunks], page_size=PAGE_SIZE,
                                num_pages=NUM_PAGES, num_tokens=NUM_TOKENS, max_seqs=MAX_SEQS,
                                pages_per_seq=PAGES_PER_SEQ, logits_rows=NUM_TOKENS, all_logits=True)
        logits, self.cache = _forward(self.params, self.cache, tokens, md, self.cfg, backend="reference")
        logits = np.asarray(logits)
        out, row = {}, 0
        for s, ids, _ in chunks:
            out[s] = logits[row:row + len(ids)]
            row += len(ids)
        return out


def run_one_call(runner, prompts):
    return runner.step([(s, p, 0) for s, p in enumerate(prompts)])


def run_chunked(runner, prompts, chunk_sizes=((5, 6, 3), (2, 3), (4, 4, 3))):
    got = {s: [] for s in range(len(prompts))}
    starts = [0] * len(prompts)
    for k in range(max(len(c) for c in chunk_sizes)):
        batch = []
        for s, sizes in enumerate(chunk_sizes):
            if k < len(sizes):
                batch.append((s, prompts[s][starts[s]:starts[s] + sizes[k]], starts[s]))
                starts[s] += sizes[k]
        for s, rows in runner.step(batch).items():
            got[s].append(rows)
    assert starts == [len(p) for p in prompts]
    return {s: np.concatenate(rows) for s, rows in got.items()}


def run_token_by_token(runner, prompts, prefill=(0, 3, 4)):
    """Sequence 0 goes one token at a time from position 0; the others prefill a few tokens
    first, so early steps mix a prefill chunk with single-token decodes."""
    got = {s: [] for s in range(len(prompts))}
    pos = [0] * len(prompts)
    while any(p < len(prompt) for p, prompt in zip(pos, prompts)):
        batch = []
        for s, prompt in enumerate(prompts):
            if pos[s] < len(prompt):
                n = prefill[s] if pos[s] == 0 and prefill[s] else 1
                batch.append((s, prompt[pos[s]:pos[s] + n], pos[s]))
                pos[s] += n
        for s, rows in runner.step(batch).items():
            got[s].append(rows)
    return {s: np.concatenate(rows) for s, rows in got.items()}


MODES = {"one_call": run_one_call, "chunked": run_chunked, "token_by_token": run_token_by_token}


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def converted(request, tmp_path_factory):
    name = request.param
    seed = sorted(HF_CONFIGS).index(name)
    model = make_hf_model(seed=seed, **HF_CONFIGS[name])
    if name == "odd_sizes_sharded":
        hf_dir = str(tmp_path_factory.mktemp(f"hf_{name}"))
        out_dir = str(tmp_path_factory.mktemp(f"ours_{name}"))
        save_hf(model, hf_dir, max_shard_size="40KB")
        assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
        assert len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]) > 2
        proc = subprocess.run([sys.executable, "-m", "model.convert_hf", f"--hf_dir={hf_dir}",
                               f"--out_dir={out_dir}", "--dtype=float32"],
                              cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 0, proc.stderr
        assert "converting" in proc.stderr  # the progress bar
        cfg, params = load_checkpoint(out_dir)
    else:
        _, _, cfg, params = save_and_convert(model, tmp_path_factory, name)
    rng = np.random.default_rng(100 + seed)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    expected = [hf_logits(model, p) for p in prompts]
    return name, cfg, params, prompts, expected, seed



@pytest.mark.parametrize("mode", sorted(MODES))
def test_logit_parity(converted, mode):
    name, cfg, params, prompts, expected, seed = converted
    got = MODES[mode](Runner(cfg, params, seed), prompts)
    diff = max(float(np.max(np.abs(got[s] - expected[s]))) for s in range(len(prompts)))
    print(f"{name} {mode}: max |logit diff| = {diff:.3g} (max |logit| {max(np.abs(e).max() for e in expected):.1f})")
    assert max(float(np.max(np.abs(e))) for e in expected) > 1.0  # the comparison is not of near-zeros
    assert diff < TOL, f"{name} {mode}: max |logit diff| {diff:.3g} >= {TOL}"


def test_config_round_trip(converted):
    name, cfg, _, _, _, _ = converted
    hf = HF_CONFIGS[name]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (hf["vocab_size"], hf["hidden_size"],
                                                                  hf["num_hidden_layers"])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (hf["num_attention_heads"],
                                                               hf["num_key_value_heads"], hf["head_dim"])
    assert cfg.tie_word_embeddings == hf["tie_word_embeddings"]
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in hf)
    assert cfg.dtype == "float32"


@pytest.mark.parametrize("converted", ["gqa3_llama3_rope"], indirect=True)
def test_rope_scaling_is_exercised(converted):
    """Ignoring the llama3 scaling must break parity, or the config above tests nothing."""
    name, cfg, params, prompts, expected, seed = converted
    assert cfg.rope_scaling is not None
    got = run_one_call(Runner(cfg.replace(rope_scaling=None), params, seed), prompts)
    diff = max(float(np.max(np.abs(got[s] - expected[s]))) for s in range(len(prompts)))
    assert diff > 1e-2
