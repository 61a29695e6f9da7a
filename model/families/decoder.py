"""What the decoder families beyond Llama share: their HF tensor names and their registry entry.

Qwen2/3, Mistral, Phi-3 and Gemma 2/3 checkpoints name their tensors as Llama's
do (`model.layers.N.self_attn.q_proj.weight`, ...), plus biases, q/k norms and
Gemma's extra norms where the config turns them on; Phi-3 fuses q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj`, which conversion splits (each
of our weights reads its rows of the fused tensor, a view). The entry every
family builds (`family_entry`) shares `LlamaConfig`, its declarations and the
decoder blocks of `model.blocks`, so each family module is only its config
translation and its refusals.
"""

from __future__ import annotations

from typing import Any, Callable

from model import blocks
from model.cache import KVCache
from model.config import LlamaConfig, UnsupportedModelError
from model.declarations import Weights
from model.families.base import ForwardBlocks, ModelFamily, TensorPlan
from model.layers import rms_norm, rope_frequencies


def _identity(w):
    return w


def _split_out_heads(n: int, d: int, start: int = 0):
    """Rows start:start+n*d of [rows, embed] -> [n, d, embed], grouped by head (a view)."""
    return lambda w: w[start:start + n * d].reshape(n, d, w.shape[1])


def _split_in_heads(n: int, d: int):
    """[embed, n*d] -> [embed, n, d]: the input columns grouped by head (a view)."""
    return lambda w: w.reshape(w.shape[0], n, d)


def _rows(start: int, stop: int):
    return lambda w: w[start:stop]


def _bias_heads(n: int, d: int):
    return lambda b: b.reshape(n, d)


def attention_extra_tensors(cfg: LlamaConfig, ours: str, attn: str) -> list[TensorPlan]:
    """The HF tensors of `model.declarations.attention_extras`: q/k/v biases and q/k norms of the layer
    whose weights are named `ours` + ... and whose HF attention module is `attn` (`...self_attn.`)."""
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    plan = []
    if cfg.attention_bias:
        plan += [TensorPlan(ours + f"{x}_bias", attn + f"{x}_proj.bias", (n * d,), _bias_heads(n, d))
                 for x, n in (("q", nq), ("k", nkv), ("v", nkv))]
    if cfg.qk_norm:
        plan += [TensorPlan(ours + "q_norm", attn + "q_norm.weight", (d,), _identity),
                 TensorPlan(ours + "k_norm", attn + "k_norm.weight", (d,), _identity)]
    return plan


def checkpoint_tensors(cfg: LlamaConfig, *, fused: bool = False) -> list[TensorPlan]:
    """Every HF tensor of a checkpoint of `cfg`, in our declaration order (`model.declarations.Layer`).

    `fused`: Phi-3's `qkv_proj` ([q rows; k rows; v rows]) and `gate_up_proj` ([gate; up])."""
    h, f, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    nq, nkv = cfg.num_heads, cfg.num_kv_heads
    plan = [TensorPlan("embed", "model.embed_tokens.weight", (v, h), _identity)]
    for i in range(cfg.num_layers):
        p, a, m, n = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
        mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
        if fused:
            qkv, rows = a + "qkv_proj.weight", (nq + 2 * nkv) * d
            attn = [TensorPlan(p + "wq", qkv, (rows, h), _split_out_heads(nq, d)),
                    TensorPlan(p + "wk", qkv, (rows, h), _split_out_heads(nkv, d, nq * d)),
                    TensorPlan(p + "wv", qkv, (rows, h), _split_out_heads(nkv, d, (nq + nkv) * d))]
            gate_up = m + "gate_up_proj.weight"
            mlp = [TensorPlan(p + "w_gate", gate_up, (2 * f, h), _rows(0, f)),
                   TensorPlan(p + "w_up", gate_up, (2 * f, h), _rows(f, 2 * f))]
        else:
            attn = [TensorPlan(p + "wq", a + "q_proj.weight", (nq * d, h), _split_out_heads(nq, d)),
                    TensorPlan(p + "wk", a + "k_proj.weight", (nkv * d, h), _split_out_heads(nkv, d)),
                    TensorPlan(p + "wv", a + "v_proj.weight", (nkv * d, h), _split_out_heads(nkv, d))]
            mlp = [TensorPlan(p + "w_gate", m + "gate_proj.weight", (f, h), _identity),
                   TensorPlan(p + "w_up", m + "up_proj.weight", (f, h), _identity)]
        plan += [TensorPlan(p + "attn_norm", n + "input_layernorm.weight", (h,), _identity), *attn,
                 TensorPlan(p + "wo", a + "o_proj.weight", (h, nq * d), _split_in_heads(nq, d)),
                 TensorPlan(p + "mlp_norm", n + mlp_norm + ".weight", (h,), _identity), *mlp,
                 TensorPlan(p + "w_down", m + "down_proj.weight", (h, f), _identity)]
        plan += attention_extra_tensors(cfg, p, a)
        if cfg.sandwich_norms:
            plan += [TensorPlan(p + "post_attn_norm", n + "post_attention_layernorm.weight", (h,), _identity),
                     TensorPlan(p + "post_mlp_norm", n + "post_feedforward_layernorm.weight", (h,), _identity)]
    plan.append(TensorPlan("final_norm", "model.norm.weight", (h,), _identity))
    if not cfg.tie_word_embeddings:
        plan.append(TensorPlan("lm_head", "lm_head.weight", (v, h), _identity))
    return plan


def refuse(hf: dict[str, Any], arch: str, **allowed) -> None:
    """Refuses the config fields of `hf` set to something other than `allowed[field]`
    (a value, or a tuple of accepted values), naming the architecture and the field."""
    for field, ok in allowed.items():
        value = hf.get(field)
        accepted = ok if isinstance(ok, tuple) else (ok,)
        if value not in accepted:
            raise UnsupportedModelError(f"unsupported {arch}: {field}={value!r} is not implemented "
                                        f"(supported: {', '.join(map(repr, accepted))})")


def sliding_fields(hf: dict[str, Any], window: int | None, arch: str) -> dict[str, Any]:
    """`sliding_window` and `layer_types` from an HF config whose window is `window` (None: off)."""
    if window is None:
        return {}
    types = hf.get("layer_types")
    if types is not None:
        if len(types) != hf["num_hidden_layers"]:
            raise UnsupportedModelError(f"{arch}: layer_types has {len(types)} entries for "
                                        f"{hf['num_hidden_layers']} layers")
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad:
            raise UnsupportedModelError(f"unsupported {arch}: layer_types {bad} (supported: full_attention, "
                                        "sliding_attention)")
        types = tuple(types)
    return dict(sliding_window=int(window), layer_types=types)


def family_entry(name: str, architectures: tuple[str, ...], model_types: tuple[str, ...],
                 config_from_hf: Callable, *, fused: bool = False, norm: Callable = rms_norm) -> ModelFamily:
    return ModelFamily(
        name=name,
        architectures=architectures,
        model_types=model_types,
        config_class=LlamaConfig,
        config_from_hf=config_from_hf,
        declare_weights=Weights.declare,
        declare_cache=KVCache.declare,
        checkpoint_tensors=(lambda cfg: checkpoint_tensors(cfg, fused=True)) if fused else checkpoint_tensors,
        blocks=ForwardBlocks(norm=norm, rope=rope_frequencies, attention=blocks.attention_block,
                             mlp=blocks.mlp_block, logits=blocks.output_logits,
                             embed=blocks.embed_tokens, layer_inputs=blocks.layer_inputs),
    )
