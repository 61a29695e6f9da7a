"""PEFT LoRA adapters against PEFT + transformers: logits, greedy tokens, and the adapters we refuse.

Tiny random Llama and Qwen3 checkpoints are written by transformers and converted; adapters are made
by `peft` itself (`get_peft_model` with `init_lora_weights=False`, so B is random and the delta real,
then `save_pretrained`), for each target-module set and two ranks (one with rsLoRA). Our forward runs
the adapter in a slot of a 3-slot stack (its neighbours hold other adapters), one token batch mixing
rows of the adapter and of the base model: the adapter rows must match PEFT's logits within 1e-4 and
the base rows the plain model's.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from model import lora  # noqa: E402
from model.cache import init_cache, pack_batch  # noqa: E402
from model.forward import forward  # noqa: E402
from tests.test_hf_parity import hf_greedy, save_and_convert, scale_weights_  # noqa: E402

TOL = 1e-4
PAGE, PAGES, TOKENS, SEQS, PER_SEQ = 4, 16, 32, 2, 8
SLOTS, RANK = 3, 8

BASES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
              dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config,
              dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
}
TARGET_SETS = {"qv": ["q_proj", "v_proj"], "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
               "mlp": ["gate_proj", "up_proj", "down_proj"]}
RANKS = ((4, False), (8, True))  # (rank, use_rslora)


@pytest.fixture(scope="module", params=sorted(BASES))
def base(request, tmp_path_factory):
    model_cls, config_cls, kwargs = BASES[request.param]
    torch.manual_seed(3)
    model = model_cls(config_cls(**kwargs)).eval()
    scale_weights_(model)
    hf_dir, _, cfg, params = save_and_convert(model, tmp_path_factory, f"lora_{request.param}")
    return request.param, hf_dir, cfg, params


def make_adapter(hf_dir, out_dir, targets, rank, rslora, seed, alpha=16):
    """An adapter written by peft over a fresh copy of the base model; returns the PEFT model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(seed)
    conf = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                           init_lora_weights=False, lora_dropout=0.0)
    pm = peft.get_peft_model(model, conf).eval()
    with torch.no_grad():  # peft's random init is tiny next to these weights: make the delta matter
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.5 / np.sqrt(p.shape[-1]))
    pm.save_pretrained(out_dir)
    return pm


_forward = jax.jit(forward, static_argnames=("cfg", "backend"))


@jax.jit
def _write(slots, slot, contents):
    return lora.write_slot(slots, slot, contents)


@jax.jit
def _attached_forward_inputs(params, slots, token_slot):
    return lora.attach(params, slots, token_slot, RANK)


def run(cfg, params, slots, prompts, slot_of_prompt):
    """Logits of every prompt token, the prompts in one batch, each token tagged with its prompt's slot."""
    tables = [list(range(i * PER_SEQ, (i + 1) * PER_SEQ)) for i in range(len(prompts))]
    tokens, md = pack_batch([(p, 0, t) for p, t in zip(prompts, tables)], page_size=PAGE, num_pages=PAGES,
                            num_tokens=TOKENS, max_seqs=SEQS, pages_per_seq=PER_SEQ, logits_rows=TOKENS,
                            all_logits=True)
    token_slot = np.full(TOKENS, -1, np.int32)
    o = 0
    for p, s in zip(prompts, slot_of_prompt):
        token_slot[o:o + len(p)] = s
        o += len(p)
    attached = _attached_forward_inputs(params, slots, jnp.asarray(token_slot))
    logits, _ = _forward(attached, init_cache(cfg, PAGES, PAGE), tokens, md, cfg, backend="reference")
    logits = np.asarray(logits)
    out, o = [], 0
    for p in prompts:
        out.append(logits[o:o + len(p)])
        o += len(p)
    return out


def empty_slots(cfg):
    decl = lora.declare_slots(cfg, SLOTS, RANK, jnp.float32)
    return lora.zeros_like_tree(decl, None)


@pytest.fixture(scope="module")
def neighbour(base, tmp_path_factory):
    """Slots with another adapter in slot 0 (the adapter under test goes into slot 2)."""
    _, hf_dir, cfg, _ = base
    other = str(tmp_path_factory.mktemp("neighbour"))
    make_adapter(hf_dir, other, ["q_proj", "down_proj"], 8, False, seed=99)
    return _write(empty_slots(cfg), 0, lora.slot_arrays(lora.load_adapter(other, cfg, RANK), cfg, RANK, np.float32))


@pytest.mark.parametrize("rank,rslora", RANKS)
@pytest.mark.parametrize("targets", sorted(TARGET_SETS))
def test_logits_match_peft(base, neighbour, targets, rank, rslora, tmp_path):
    family, hf_dir, cfg, params = base
    pm = make_adapter(hf_dir, str(tmp_path / "a"), TARGET_SETS[targets], rank, rslora, seed=rank)
    adapter = lora.load_adapter(str(tmp_path / "a"), cfg, max_rank=RANK, name="a")
    assert adapter.rank == rank and adapter.target_modules == tuple(sorted(TARGET_SETS[targets]))
    slots = _write(neighbour, 2, lora.slot_arrays(adapter, cfg, RANK, np.float32))
    rng = np.random.default_rng(rank)
    prompts = [rng.integers(0, cfg.vocab_size, 13).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()]
    got = run(cfg, params, slots, prompts, [2, -1])
    with torch.no_grad():
        want = pm(torch.tensor([prompts[0]])).logits[0].numpy()
        with pm.disable_adapter():
            want_base = pm(torch.tensor([prompts[1]])).logits[0].numpy()
            plain = pm(torch.tensor([prompts[0]])).logits[0].numpy()
    assert np.abs(want - plain).max() > 0.1, "the adapter must change the logits, or the test proves nothing"
    diff = np.abs(got[0] - want).max()
    print(f"{family} {targets} r={rank} rslora={rslora}: max |logit diff| {diff:.2g}")
    assert diff < TOL
    assert np.abs(got[1] - want_base).max() < TOL


def test_greedy_tokens_match_peft(base, tmp_path):
    family, hf_dir, cfg, params = base
    pm = make_adapter(hf_dir, str(tmp_path / "a"), TARGET_SETS["attn"] + TARGET_SETS["mlp"], 8, False, seed=5)
    adapter = lora.load_adapter(str(tmp_path / "a"), cfg, max_rank=RANK)
    slots = _write(empty_slots(cfg), 1, lora.slot_arrays(adapter, cfg, RANK, np.float32))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 6).tolist()
    want = hf_greedy(pm, prompt, 8)
    ids = list(prompt)
    for _ in range(8):  # greedy by full recompute: each step's last row
        ids.append(int(np.argmax(run(cfg, params, slots, [ids], [1])[0][-1])))
    assert ids[len(prompt):] == want


# --- adapters that do not fit are refused, the problem named -------------------------------------------


@pytest.fixture(scope="module")
def good_adapter(base, tmp_path_factory):
    _, hf_dir, cfg, _ = base
    path = str(tmp_path_factory.mktemp("good"))
    make_adapter(hf_dir, path, ["q_proj", "v_proj"], 8, False, seed=1)
    return path


def _copy_with(src, dst, config_edit=None, tensors_edit=None):
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, lora.CONFIG_FILE)) as f:
        conf = json.load(f)
    tensors = load_file(os.path.join(src, lora.WEIGHTS_FILE))
    if config_edit:
        config_edit(conf)
    if tensors_edit:
        tensors = tensors_edit(tensors)
    with open(os.path.join(dst, lora.CONFIG_FILE), "w") as f:
        json.dump(conf, f)
    save_file(tensors, os.path.join(dst, lora.WEIGHTS_FILE))
    return dst


def _rename(tensors, old, new):
    return {k.replace(old, new): v for k, v in tensors.items()}


def _shrink_b(tensors):
    return {k: (v[:-1] if "lora_B" in k else v) for k, v in tensors.items()}


BAD = {
    "missing path": (lambda src, dst: dst + "/nope", "does not exist"),
    "missing weights": (lambda src, dst: (_copy_with(src, dst), os.remove(os.path.join(dst, lora.WEIGHTS_FILE)),
                                          dst)[-1], "no adapter_model.safetensors"),
    "dora": (lambda src, dst: _copy_with(src, dst, lambda c: c.update(use_dora=True)), "use_dora"),
    "bias": (lambda src, dst: _copy_with(src, dst, lambda c: c.update(bias="all")), "bias"),
    "not lora": (lambda src, dst: _copy_with(src, dst, lambda c: c.update(peft_type="IA3")), "peft_type"),
    "unknown module": (lambda src, dst: _copy_with(src, dst, tensors_edit=lambda t: _rename(t, "q_proj", "qq_proj")),
                       "qq_proj is not a module of this model"),
    "output head": (lambda src, dst: _copy_with(src, dst, tensors_edit=lambda t: {
        **t, "base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32),
        "base_model.model.lm_head.lora_B.weight": np.zeros((97, 8), np.float32)}), "lm_head is not a (module of this model|linear layer)"),
    "shape": (lambda src, dst: _copy_with(src, dst, tensors_edit=_shrink_b), "but the base weight is"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapters_are_refused(base, good_adapter, tmp_path, case):
    _, _, cfg, _ = base
    make, words = BAD[case]
    path = make(good_adapter, str(tmp_path / "bad"))
    with pytest.raises(lora.LoraError, match=words):
        lora.load_adapter(path, cfg, max_rank=RANK)


def test_rank_above_max_is_refused(base, good_adapter):
    _, _, cfg, _ = base
    with pytest.raises(lora.LoraError, match="rank 8 of .* exceeds max_lora_rank=4"):
        lora.load_adapter(good_adapter, cfg, max_rank=4)


@pytest.mark.parametrize("base", ["llama"], indirect=True)
def test_scanned_layers_and_quantized_base(base, good_adapter):
    """The scanned forward (per-layer matrices picked by switch, as on XLA CPU, and stacked weights, as on
    GPUs) gives the unrolled logits; an int8 base adds the same delta on its dequantized product."""
    from model.params import stack_layers
    from model.quantize import quantize_params

    _, _, cfg, params = base
    adapter = lora.load_adapter(good_adapter, cfg, max_rank=RANK)
    slots = _write(empty_slots(cfg), 1, lora.slot_arrays(adapter, cfg, RANK, np.float32))
    prompts = [list(range(3, 14)), list(range(20, 27))]
    tables = [list(range(i * PER_SEQ, (i + 1) * PER_SEQ)) for i in range(2)]
    tokens, md = pack_batch([(p, 0, t) for p, t in zip(prompts, tables)], page_size=PAGE, num_pages=PAGES,
                            num_tokens=TOKENS, max_seqs=SEQS, pages_per_seq=PER_SEQ, logits_rows=TOKENS,
                            all_logits=True)
    token_slot = jnp.asarray(np.r_[np.full(11, 1), np.full(TOKENS - 11, -1)].astype(np.int32))

    def logits(p, stacked):
        attached = _attached_forward_inputs(p, slots, token_slot)
        cache = init_cache(cfg, PAGES, PAGE, stacked=stacked)
        return np.asarray(_forward(attached, cache, tokens, md, cfg, backend="reference")[0])[:18]

    unrolled = logits(params, False)
    np.testing.assert_allclose(logits(params, True), unrolled, atol=TOL)  # list layers, scanned: switch
    np.testing.assert_allclose(logits(stack_layers(params), True), unrolled, atol=TOL)  # stacked scan
    qcfg, qparams = quantize_params(params, cfg, "int8")
    plain = _forward(qparams, init_cache(qcfg, PAGES, PAGE), tokens, md, qcfg, backend="reference")[0]
    attached = _attached_forward_inputs(qparams, slots, token_slot)
    got = np.asarray(_forward(attached, init_cache(qcfg, PAGES, PAGE), tokens, md, qcfg, backend="reference")[0])
    assert np.abs(got[:11] - np.asarray(plain)[:11]).max() > 0.1  # the adapter acts on the quantized base
    np.testing.assert_allclose(got[11:18], np.asarray(plain)[11:18], atol=TOL)  # base rows untouched
    # int8 noise aside, the quantized model with the adapter tracks the float one with it
    assert np.abs(got[:11] - unrolled[:11]).max() < 0.5


def test_mixture_of_experts_attention_adapter_and_expert_weights_refused(tmp_path, tmp_path_factory):
    """A Qwen3-MoE base: an adapter on its attention projections matches PEFT, its experts (named w_gate /
    w_up / w_down like a dense MLP) left alone; adapters on the experts' or the router's weights are
    refused, the reason named."""
    from safetensors.numpy import load_file

    from tests.test_moe_hf import make_hf_moe

    hf = make_hf_moe("qwen3_moe", seed=4)
    hf_dir, _, cfg, params = save_and_convert(hf, tmp_path_factory, "lora_moe")
    path = str(tmp_path / "attn")
    pm = make_adapter(hf_dir, path, ["q_proj", "k_proj", "v_proj", "o_proj"], 8, False, seed=3)
    adapter = lora.load_adapter(path, cfg, max_rank=RANK)
    assert sorted({t for _, t in adapter.weights}) == ["wk", "wo", "wq", "wv"]
    slots = _write(empty_slots(cfg), 0, lora.slot_arrays(adapter, cfg, RANK, np.float32))
    prompt = np.random.default_rng(1).integers(3, cfg.vocab_size, 12).tolist()
    got = run(cfg, params, slots, [prompt], [0])[0]
    with torch.no_grad():
        want = pm(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(got - want).max() < TOL
    tensors = load_file(os.path.join(path, lora.WEIGHTS_FILE))
    for module, shape in (("mlp.experts.0.gate_proj", (24, 32)), ("mlp.gate", (6, 32))):
        bad = str(tmp_path / module.replace(".", "_"))
        _copy_with(path, bad, tensors_edit=lambda t: {
            **t, f"base_model.model.model.layers.0.{module}.lora_A.weight": np.zeros((8, shape[1]), np.float32),
            f"base_model.model.model.layers.0.{module}.lora_B.weight": np.zeros((shape[0], 8), np.float32)})
        with pytest.raises(lora.LoraError, match=f"{module} is not (a module of this model|a linear layer)"):
            lora.load_adapter(bad, cfg, max_rank=RANK)
