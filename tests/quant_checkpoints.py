"""Tiny Hugging Face checkpoints in the published quantized formats, written from a float transformers model
following each format's layout (the tensors and `quantization_config` that the quantizers write).

`compressed_tensors_checkpoint`: written by compressed-tensors itself (llm-compressor's format), its reference
transformers' own loading of it.

`fp8_block_checkpoint`: fine-grained FP8 (`quant_method` "fp8"): each linear weight `float8_e4m3fn`
[out, in] beside `weight_scale_inv` [ceil(out / 128), ceil(in / 128)], block max scaled to 448.
The float model is also returned with its linear weights replaced by the dequantized ones: the exact
reference of what the checkpoint stands for.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def block_quantize_fp8(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data, fp32 scale_inv) of a [out, in] weight in blocks (partial edge blocks included)."""
    out, inp = w.shape
    bo, bi = block
    go, gi = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(go * bo, gi * bi, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    blocks = padded.reshape(go, bo, gi, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(go * bo, gi * bi)[:out, :inp].contiguous(), scale.contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    rows = scale.repeat_interleave(block[0], 0)[: q.shape[0]].repeat_interleave(block[1], 1)[:, : q.shape[1]]
    return q.float() * rows


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES


def fp8_block_checkpoint(model, directory: str, block=(128, 128)):
    """Writes `model` (a float transformers model) as a fine-grained FP8 checkpoint in `directory`; returns
    `model` with its linear weights set to the dequantized values (in place)."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)  # config, generation config
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(directory, name))
    tensors = {}
    state = model.state_dict()
    with torch.no_grad():
        for name, w in state.items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if _is_linear(name):
                q, s = block_quantize_fp8(w, block)
                tensors[name], tensors[name + "_scale_inv"] = q, s
                w.copy_(dequantize_block_fp8(q, s, block).to(w.dtype))
            else:
                tensors[name] = w.contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    untouched = [] if model.config.tie_word_embeddings else ["lm_head"]
    _set_quantization_config(directory, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": list(block), "modules_to_not_convert": untouched})
    return model


def pack_int4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint 4-bit codes (0..15) -> int32 words, eight consecutive codes along `dim` per word, code j in
    bits 4j..4j+3 (GPTQ's qweight along the input, its qzeros along the output)."""
    codes = codes.to(torch.int64).movedim(dim, -1)
    codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
    words = sum(codes[..., j] << (4 * j) for j in range(8))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the bits, as int32
    return words.movedim(-1, dim).contiguous()


def gptq_quantize(w: torch.Tensor, group: int, g_idx: torch.Tensor | None = None):
    """GPTQ-style symmetric 4-bit (round to nearest; the zero point is 8): (qweight, qzeros, scales, g_idx,
    the dequantized weight) of a [out, in] weight, packed as the gptq v1 format stores them."""
    out, inp = w.shape
    if g_idx is None:
        g_idx = torch.arange(inp, dtype=torch.int32) // group
    w = w.float()
    groups = inp // group
    amax = torch.stack([w[:, g_idx == g].abs().amax(dim=1) for g in range(groups)])  # [G, out]
    scales = (torch.where(amax > 0, amax, torch.ones_like(amax)) * 2 / 15).to(torch.float16)
    s = scales.float()[g_idx.long()].T  # [out, in]
    q = torch.clamp(torch.round(w / s) + 8, 0, 15).to(torch.int64)  # [out, in]
    zeros = torch.full((groups, out), 8, dtype=torch.int64)
    qweight = pack_int4(q.T, 0)  # [in / 8, out]
    qzeros = pack_int4(zeros - 1, 1)  # v1: zero - 1, [G, out / 8]
    return qweight, qzeros, scales, g_idx.to(torch.int32), (q - 8).float() * s


def gptq_checkpoint(model, directory: str, group: int = 128, desc_act: bool = False, seed: int = 0):
    """Writes `model` as a 4-bit GPTQ checkpoint (AutoGPTQ's tensors and `quantization_config`); returns
    `model` with its linear weights set to the dequantized values (in place). desc_act True writes a
    g_idx that assigns columns to groups in a shuffled order, as act-order quantization does."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(directory, name))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, w in model.state_dict().items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if _is_linear(name):
                g_idx = None
                if desc_act:
                    g_idx = (torch.arange(w.shape[1]) // group)[torch.randperm(w.shape[1], generator=gen)]
                qw, qz, sc, gi, deq = gptq_quantize(w, group, g_idx)
                base = name[: -len(".weight")]
                tensors.update({base + ".qweight": qw, base + ".qzeros": qz, base + ".scales": sc,
                                base + ".g_idx": gi})
                w.copy_(deq.to(w.dtype))
            else:
                tensors[name] = w.contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    _set_quantization_config(directory, {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                                         "sym": True, "damp_percent": 0.01, "true_sequential": True,
                                         "checkpoint_format": "gptq", "lm_head": False})
    return model


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ gemm: nibble p of a word holds column 8k + AWQ_ORDER[p]


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit codes -> int32 [rows, cols / 8] in AWQ's interleaved nibble order."""
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return pack_int4(c.reshape(codes.shape), 1)


def awq_checkpoint(model, directory: str, group: int = 128):
    """Writes `model` as a 4-bit AWQ gemm checkpoint (asymmetric, zero points 0..15): qweight int32
    [in, out / 8], qzeros int32 [in / group, out / 8], scales fp16 [in / group, out]; returns `model` with
    its linear weights set to the dequantized values (in place)."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(directory, name))
    tensors = {}
    with torch.no_grad():
        for name, w in model.state_dict().items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if not _is_linear(name):
                tensors[name] = w.contiguous()
                continue
            out, inp = w.shape
            g = w.float().T.reshape(inp // group, group, out)  # [G, group, out]
            lo, hi = g.amin(dim=1), g.amax(dim=1)
            scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
            s = scales.float()
            zeros = torch.clamp(torch.round(-lo / s), 0, 15)
            q = torch.clamp(torch.round(g / s[:, None]) + zeros[:, None], 0, 15)  # [G, group, out]
            deq = ((q - zeros[:, None]) * s[:, None]).reshape(inp, out).T
            base = name[: -len(".weight")]
            tensors.update({base + ".qweight": pack_awq(q.reshape(inp, out)), base + ".qzeros": pack_awq(zeros),
                            base + ".scales": scales.contiguous()})
            w.copy_(deq.to(w.dtype))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    _set_quantization_config(directory, {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                                         "zero_point": True})
    return model


# compressed-tensors weight schemes (llm-compressor's presets, weight side): name -> QuantizationArgs fields.
COMPRESSED_SCHEMES = {
    "w4a16": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    "fp8-channel": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
    "fp8-tensor": dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
    "w8a8-channel": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
}
# Their activation side, as the presets have it (dynamic per-token; nothing for w4a16).
COMPRESSED_ACTIVATIONS = {"w4a16": None, "fp8-channel": dict(num_bits=8, type="float", strategy="token", dynamic=True),
                          "fp8-tensor": dict(num_bits=8, type="float", strategy="token", dynamic=True),
                          "w8a8-channel": dict(num_bits=8, type="int", strategy="token", dynamic=True)}


def compressed_tensors_checkpoint(model, directory: str, scheme: str):
    """Writes `model` as a compressed-tensors checkpoint with the format's own library, as llm-compressor does:
    the scheme applied to every Linear but lm_head, each weight's scale from its min / max
    (`calculate_qparams`, round to nearest), compressed (`ModelCompressor.compress_model`) and saved with its
    `quantization_config` (`update_config`). Returns the reference: transformers loading the saved checkpoint
    with compressed-tensors' own decompression, its activation quantization off (the weights as the
    checkpoint stands for them; what Ridgeline serves is weight-only)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config, disable_quantization,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    weights = QuantizationArgs(**COMPRESSED_SCHEMES[scheme])
    acts = COMPRESSED_ACTIVATIONS[scheme]
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=None if acts is None else QuantizationArgs(**acts))},
        ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for _, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight.float()
            if weights.strategy == "group":
                w = w.reshape(w.shape[0], -1, weights.group_size)
                lo, hi = w.amin(-1), w.amax(-1)
            elif weights.strategy == "channel":
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            else:
                lo, hi = w.amin(), w.amax()
            scale, _ = calculate_qparams(lo, hi, weights)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    ref = AutoModelForCausalLM.from_pretrained(directory, quantization_config=CompressedTensorsConfig(dequantize=True),
                                               dtype=torch.float32).eval()
    ref.apply(disable_quantization)
    return ref


def _set_quantization_config(directory: str, quantization_config: dict) -> None:
    """Writes `quantization_config` into the checkpoint's config.json, as the quantizers do."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def edited_quantization_config(hf_dir: str, directory: str, **changes) -> str:
    """A copy of `hf_dir` in `directory` with `changes` made to its quantization_config (a variant to refuse)."""
    shutil.copytree(hf_dir, directory)
    with open(os.path.join(directory, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    _set_quantization_config(directory, {**qc, **changes})
    return directory


def logprob_differences(params_cfg, ref, prompts) -> list:
    """Max |Δ logprob| of each prompt's positions between the converted model (`params_cfg`: (config, params),
    run by the engine's step through `test_hf_parity.Runner`) and transformers' `ref`."""
    import numpy as np

    from test_hf_parity import Runner, hf_logits, run_one_call

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    cfg, params = params_cfg
    ours = run_one_call(Runner(cfg, params, seed=0), prompts)
    return [float(np.abs(log_softmax(ours[s]) - log_softmax(hf_logits(ref, ids))).max()) for s, ids in enumerate(prompts)]


def assert_serves_greedy_tokens(hf_dir: str, ref, prompts, cache_dir: str, weight_dtype: str | None = None) -> None:
    """`LLM` on the checkpoint draws, for 16 greedy tokens, what transformers' `ref` (the float model with the
    dequantized weights) generates."""
    from serving import LLM, SamplingParams

    llm = LLM(model=hf_dir, compilation_cache_dir=cache_dir, max_num_seqs=2, max_num_batched_tokens=32,
              num_pages=16, max_model_len=64, dtype="float32")
    if weight_dtype is not None:
        assert llm.config.weight_dtype == weight_dtype
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert list(out.outputs[0].token_ids) == want
