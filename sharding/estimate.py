"""Layout arithmetic: memory, roofline times and communication of one layout, on paper.

Everything here is a pure function of a model shape, a GPU from
`sharding.hardware` and a layout. Per-device bytes come from the same weight
and cache declarations and rule table that shard the real arrays, so the plan
describes exactly what `param_shardings` / `cache_shardings` would place.

Model of a step (stated once, used throughout):
  * Decode streams every weight a device holds except an untied embedding
    table (a lookup reads B rows of it, not the table), plus each sequence's
    live KV cache at `context_len` tokens (the worst case: every sequence full).
  * FLOPs are 2 per matmul parameter per token plus attention (QK^T and PV:
    4 * q_heads * head_dim per token per cached position per layer; causal in
    prefill).
  * A phase's time on one device is max(bytes / HBM bandwidth, FLOPs / peak)
    (prefill divides the peak by the stated MFU), plus its collectives, each
    costing a latency floor plus ring traffic 2(p-1)/p * payload over the link.
  * Tensor parallelism issues two all-reduces per layer (after wo and after
    w_down) and one for the vocab-parallel embedding lookup, each carrying
    tokens * hidden activations.
  * A mixture of experts (`sharding.moe_plan`) streams only the experts a step's tokens
    touch, 1 - (1 - k/E)^tokens of every device's expert bytes, and computes with the
    active parameters (k/E of the experts per token). Its MLP all-reduce (the expert- or
    tensor-parallel psum, `sharding.experts`) carries fp32 activations.
  * Pipeline stages take contiguous runs of layers; stage 0 also holds the
    embedding, the last stage the final norm and lm_head (the embedding again
    when tied). With p stages and m microbatches a step lasts (m + p - 1) stage
    slots of the slowest stage; the idle fraction is (p - 1) / (m + p - 1).
    Decode bytes / FLOPs / times are one device's share of one such slot;
    prefill sums its stages (one prompt passes through them in turn).
"""

from __future__ import annotations

import dataclasses
import math

from model.config import ModelConfig
from model.families import is_expert_weight, kv_bytes_per_token
from sharding.hardware import GPU
from sharding.moe_plan import decode_bytes_by_batch, touched_fraction
from sharding.rules import RuleError, load_rules, shard_count
from sharding.shardings import cache_resolutions, check_rules, param_resolutions

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "fp8": 1, "int8": 1, "int4": 0.5}
# Weight dtypes the stack implements (model.quant): the plan then counts the bytes of the real
# declarations (int8 / fp8 linear layers, their fp32 per-channel scales, float norms and embedding).
# Other names (int4) stay nominal: every weight at that many bytes. The same holds for the KV cache
# (an int8 / fp8 cache with its per-token scales, as `model.cache.KVCache` declares it).
QUANTIZED_WEIGHTS = {"int8": "int8", "fp8": "fp8", "float8": "fp8"}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def dtype_bytes(name: str) -> float:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    cfg: ModelConfig
    gpu: GPU
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    context_len: int = 8192
    batch: int = 1
    prompt_len: int | None = None  # default: context_len
    weight_dtype: str | None = None  # default: the model's dtype
    kv_dtype: str | None = None  # default: the weight dtype
    reserve_bytes: float = 4e9  # runtime, activations, allocator slack per device
    mfu: float = 0.5  # fraction of peak that prefill reaches
    interconnect: str | None = None  # "nvlink" or "pcie"; default NVLink when the GPU has it
    rules: str = "megatron"
    model_name: str = ""
    kv_offload_bytes: float = 0  # the host tier of the prefix cache (serving's --kv_offload_bytes), per host

    @property
    def w_dtype(self) -> str:
        return self.weight_dtype or self.cfg.dtype

    @property
    def kv_dt(self) -> str:
        """Default: the weights' dtype, or the model's compute dtype when the weights are quantized
        (as the engine's kv_cache_dtype="auto" does)."""
        if self.kv_dtype:
            return self.kv_dtype
        return self.w_dtype if self.w_dtype in FLOAT_DTYPES else self.cfg.dtype

    def declared_cfg(self) -> ModelConfig | None:
        """The config whose declarations hold exactly the weights this plan stores (None: nominal)."""
        if self.w_dtype in FLOAT_DTYPES:
            return self.cfg.replace(dtype=self.w_dtype, weight_dtype=None)
        if self.w_dtype in QUANTIZED_WEIGHTS:
            return self.cfg.replace(weight_dtype=QUANTIZED_WEIGHTS[self.w_dtype])
        return None

    @property
    def link(self) -> str:
        return self.interconnect or ("nvlink" if self.gpu.nvlink_bandwidth else "pcie")


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per stage, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _stage_of(name: str, stages: list[range], tied: bool) -> list[int]:
    """Which stages hold a weight, by its flat name."""
    last = len(stages) - 1
    if name.startswith("layers."):
        i = int(name.split(".")[1])
        return [s for s, r in enumerate(stages) if i in r]
    if name == "embed":
        return sorted({0, last}) if tied else [0]
    return [last]  # final_norm, lm_head


def _collective(payload_bytes: float, tp: int, bandwidth: float, latency: float) -> float:
    """Seconds for one ring all-reduce of `payload_bytes` over `tp` devices."""
    if tp == 1:
        return 0.0
    return latency + 2 * (tp - 1) / tp * payload_bytes / bandwidth


def _host_tier(inp: PlanInputs, kv_token_total: float, flops_per_token: float) -> dict:
    """The host tier's row of the memory table: what it holds (whole pages of every layer and KV head) and
    what restoring one sequence's KV from it takes over PCIe, against recomputing its prefill (at `mfu`)."""
    if not inp.kv_offload_bytes:
        return {}
    seq_bytes = kv_token_total * inp.context_len
    flops = flops_per_token * inp.context_len
    return {"host_tier_bytes": inp.kv_offload_bytes,
            "host_tier_tokens": int(inp.kv_offload_bytes // kv_token_total),
            "host_tier_sequences": int(inp.kv_offload_bytes // seq_bytes),
            "host_tier_restore_s_per_sequence": seq_bytes / inp.gpu.pcie_bandwidth,
            "host_tier_recompute_s_per_sequence": flops / (inp.gpu.bf16_flops * inp.tp * inp.mfu)}


def plan(inp: PlanInputs) -> dict:
    """The whole plan as a JSON-ready dict; `fits` and `problems` say whether it works."""
    cfg, gpu, tp, pp, m = inp.cfg, inp.gpu, inp.tp, inp.pp, inp.microbatches
    problems: list[str] = []
    for name, v in (("tp", tp), ("pp", pp), ("microbatches", m), ("batch", inp.batch),
                    ("context_len", inp.context_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if pp > cfg.num_layers:
        raise ValueError(f"pp={pp} exceeds the model's {cfg.num_layers} layers")
    wb = dtype_bytes(inp.w_dtype)
    dtype_bytes(inp.kv_dt)  # an unknown KV dtype name is refused before anything else
    act_b = 2 if wb < 4 else 4  # activations travel in bf16 unless the model runs in fp32
    sizes = {"data": 1, "pipeline": pp, "tensor": tp}
    rules = load_rules(inp.rules)
    prompt_len = inp.prompt_len or inp.context_len
    tied = cfg.tie_word_embeddings

    try:
        notes = check_rules(rules, cfg, sizes)
    except RuleError as e:
        return {"inputs": _inputs(inp), "fits": False, "problems": [f"layout is invalid: {e}"]}

    stages = stage_layers(cfg.num_layers, pp)
    st_bytes = [0.0] * pp  # weight bytes per device, per stage
    st_stream = [0.0] * pp  # bytes decode streams per device
    st_mm = [0.0] * pp  # matmul params per device
    st_x_stream = [0.0] * pp  # expert bytes per device (a step reads the touched fraction)
    st_x_mm = [0.0] * pp  # expert matmul params per device (a token uses k/E of them)
    num_experts, top_k = getattr(cfg, "num_experts", 0), getattr(cfg, "num_experts_per_tok", 0)
    expert_total = 0
    total_params = 0
    embed_params = 0  # the input table: looked up, not multiplied (unless tied to the head)
    total_bytes = 0.0
    declared = inp.declared_cfg()
    for name, (info, dims) in param_resolutions(declared or cfg, sizes, rules).items():
        n = math.prod(info.shape)
        is_scale = name.endswith(".scale")  # per-channel scales of a quantized weight: bytes, not parameters
        elem = wb if declared is None else _itemsize(info.dtype)
        total_params += 0 if is_scale else n
        embed_params += n if name == "embed" else 0
        total_bytes += n * elem
        per_dev = n / shard_count(dims, sizes)
        lookup_only = name == "embed" and not tied
        expert = is_expert_weight(info)
        expert_total += n if expert and not is_scale else 0
        for s in _stage_of(name, stages, tied):
            st_bytes[s] += per_dev * elem
            if expert:
                st_x_stream[s] += per_dev * elem
                st_x_mm[s] += 0 if is_scale else per_dev
            elif not lookup_only and not (name == "embed" and tied and s == 0 and pp > 1):
                st_stream[s] += per_dev * elem
                st_mm[s] += 0 if is_scale else per_dev

    # KV: one cache array per layer and K/V; per-device share from the cache rules.
    _, kv_dims = next(iter(cache_resolutions(cfg, sizes, rules, 1, 1).values()))
    kv_ways = shard_count(kv_dims, sizes)
    # Bytes per token from the cache declaration (an int8 / fp8 cache's scales included); a nominal
    # dtype (int4) prices the declared elements at its width.
    kv_token_total = _kv_bytes_per_token(cfg, inp.kv_dt)
    kv_layer_token = kv_token_total / cfg.num_layers  # every layer caches the same per token
    st_kv_token = [kv_layer_token * len(r) / kv_ways for r in stages]
    resolved = param_resolutions(cfg, sizes, rules)
    q_ways = shard_count(resolved.get("layers.0.wq", resolved.get("layers.0.wq.data"))[1], sizes)  # (quantized: .data)
    attn_flops_layer = 4 * cfg.num_heads * cfg.head_dim / q_ways  # per token per cached position per device

    free = [gpu.hbm_bytes - inp.reserve_bytes - b for b in st_bytes]
    worst = max(range(pp), key=lambda s: st_bytes[s])
    if free[worst] <= 0:
        problems.append(
            f"weights need {_gb(st_bytes[worst])} per device{_stage_txt(worst, pp)}, more than "
            f"{_gb(gpu.hbm_bytes)} of HBM minus the {_gb(inp.reserve_bytes)} runtime reserve "
            f"({gpu.name}, tp={tp}, pp={pp})")
    seq_dev = [t * inp.context_len for t in st_kv_token]
    max_seqs = min(int(max(f, 0) // s) if s > 0 else 0 for f, s in zip(free, seq_dev))
    if free[worst] > 0 and max_seqs == 0:
        s = min(range(pp), key=lambda i: free[i] / seq_dev[i])
        problems.append(f"no room for one sequence of {inp.context_len} tokens: its KV needs "
                        f"{_gb(seq_dev[s])} per device, only {_gb(free[s])} is free after weights and reserve")
    elif max_seqs and inp.batch > max_seqs:
        problems.append(f"batch {inp.batch} exceeds the {max_seqs} sequences of {inp.context_len} tokens "
                        "whose KV fits")
    if m > inp.batch:
        problems.append(f"cannot cut a batch of {inp.batch} sequences into {m} microbatches")

    link_bw, link_lat = gpu.link(inp.link) if (tp > 1 or pp > 1) else (float("inf"), 0.0)
    hidden_bytes = cfg.hidden_size * act_b
    mlp_bytes = cfg.hidden_size * 4 if num_experts else hidden_bytes  # the expert psum is fp32

    def stage_time(s, tokens, kv_positions, flops_peak, causal):
        """(time, memory time, compute time, comm time, flops, bytes) of stage s on `tokens` tokens."""
        layers = len(stages[s])
        if causal:  # prefill of one sequence: position j attends to j + 1 keys
            attn = attn_flops_layer * layers * tokens * (tokens + 1) / 2
        else:
            attn = attn_flops_layer * layers * tokens * kv_positions
        active = top_k / num_experts if num_experts else 1.0
        flops = 2 * (st_mm[s] + st_x_mm[s] * active) * tokens + attn
        kv_bytes = st_kv_token[s] * (tokens if causal else tokens * kv_positions)
        byts = st_stream[s] + st_x_stream[s] * touched_fraction(num_experts, top_k, tokens) + kv_bytes
        mem, comp = byts / gpu.hbm_bandwidth, flops / flops_peak
        comm = (layers + (1 if s == 0 else 0)) * _collective(tokens * hidden_bytes, tp, link_bw, link_lat)
        comm += layers * _collective(tokens * mlp_bytes, tp, link_bw, link_lat)
        if pp > 1 and s < pp - 1:
            comm += link_lat + tokens * hidden_bytes / link_bw  # activation handoff to the next stage
        return max(mem, comp) + comm, mem, comp, comm, flops, byts

    # Decode: B sequences, one token each, cut into m microbatches.
    mb = math.ceil(inp.batch / m)
    dec = [stage_time(s, mb, inp.context_len, gpu.bf16_flops, False) for s in range(pp)]
    slow = max(range(pp), key=lambda s: dec[s][0])
    step = (m + pp - 1) * dec[slow][0]
    d_int = dec[slow][4] / dec[slow][5]
    # Prefill: one prompt through every stage in turn.
    pre = [stage_time(s, prompt_len, prompt_len, gpu.bf16_flops * inp.mfu, True) for s in range(pp)]
    p_time = sum(p[0] for p in pre)
    p_int = pre[0][4] / pre[0][5]

    def comm_table(tokens, repeats=1):
        """TP all-reduces one GPU of the busiest stage (stage 0: most layers, and the embedding)
        takes part in during a step of `repeats` microbatches of `tokens` tokens."""
        out = {}
        for link in ("nvlink", "pcie"):
            if link == "nvlink" and gpu.nvlink_bandwidth is None:
                out[link] = None
                continue
            bw, lat = gpu.link(link)
            layers = len(stages[0])
            n = (2 * layers + 1) * repeats if tp > 1 else 0
            ring = 2 * (tp - 1) / tp * tokens if tp > 1 else 0.0
            wire = ring * ((layers + 1) * hidden_bytes + layers * mlp_bytes) * repeats
            out[link] = {"bytes_per_gpu": wire, "wire_time_s": wire / bw,
                         "latency_floor_s": n * lat, "time_s": wire / bw + n * lat}
        return out

    active_params = total_params - expert_total + (expert_total * top_k // num_experts if num_experts else 0)
    moe = None
    if num_experts:
        from sharding.experts import expert_axes

        e_axes, f_axes = expert_axes(rules, cfg, sizes)
        ep = math.prod(sizes[a] for a in e_axes)
        moe = {
            "num_experts": num_experts, "experts_per_token": top_k, "expert_params": expert_total,
            "expert_parallel": ep, "experts_per_device": num_experts // ep,
            "expert_tensor_parallel": math.prod(sizes[a] for a in f_axes),
            "expert_bytes_per_device": st_x_stream[0] if pp == 1 else max(st_x_stream),
            "decode_bytes_by_batch": decode_bytes_by_batch(
                max(st_stream), max(st_x_stream), max(st_kv_token), inp.context_len, num_experts, top_k),
            "collectives": ("none: one device" if tp == 1 else
                            f"one fp32 all-reduce of tokens x hidden per layer over the {tp} devices that "
                            f"split the experts ({cfg.hidden_size * 4:,} B per token), besides attention's"),
        }
    return {
        "inputs": _inputs(inp),
        "model": {"params": total_params, "active_params": active_params, "weight_bytes_total": total_bytes,
                  "matmul_flops_per_token": 2 * (active_params - (0 if tied else embed_params))},
        "layout": {"devices": tp * pp, "tp": tp, "pp": pp, "rules": rules.name, "notes": notes,
                   "layers_per_stage": [len(r) for r in stages], "kv_heads_per_device":
                   cfg.num_kv_heads // kv_ways},
        "memory": {
            "hbm_bytes": gpu.hbm_bytes, "reserve_bytes": inp.reserve_bytes,
            "weight_bytes_per_device": max(st_bytes),
            "kv_bytes_per_token": kv_token_total, "kv_bytes_per_token_per_device": max(st_kv_token),
            "kv_bytes_per_sequence": kv_token_total * inp.context_len,
            "kv_bytes_per_sequence_per_device": max(seq_dev),
            "kv_free_bytes_per_device": min(free), "max_concurrent_sequences": max_seqs,
            **_host_tier(inp, kv_token_total, 2 * (active_params - (0 if tied else embed_params))),
        },
        "roofline": {"peak_flops": gpu.bf16_flops, "hbm_bandwidth": gpu.hbm_bandwidth,
                     "ridge_point": gpu.ridge_point},
        "decode": {
            "batch": inp.batch, "microbatch": mb, "context_len": inp.context_len,
            "bytes_per_device": dec[slow][5], "flops_per_device": dec[slow][4],
            "memory_time_s": dec[slow][1], "compute_time_s": dec[slow][2], "comm_time_s": dec[slow][3],
            "step_time_s": step, "tokens_per_s": inp.batch / step, "intensity": d_int,
            "bound": "memory" if d_int < gpu.ridge_point else "compute",
        },
        "prefill": {
            "prompt_len": prompt_len, "mfu": inp.mfu, "flops_per_device": sum(p[4] for p in pre),
            "compute_time_s": sum(p[2] for p in pre), "memory_time_s": sum(p[1] for p in pre),
            "comm_time_s": sum(p[3] for p in pre), "time_s": p_time, "intensity": p_int,
            "bound": "memory" if p_int < gpu.ridge_point else "compute",
        },
        "collectives": {
            "interconnect": inp.link if (tp > 1 or pp > 1) else None,
            "all_reduces_per_layer": 2 if tp > 1 else 0,
            "all_reduces_per_step": 2 * cfg.num_layers + 1 if tp > 1 else 0,
            "payload_bytes_per_token": hidden_bytes,
            "decode_step": comm_table(mb, m), "prefill": comm_table(prompt_len),
        },
        "pipeline": {"stages": pp, "microbatches": m, "bubble_fraction": (pp - 1) / (m + pp - 1)},
        "moe": moe,
        "fits": not problems,
        "problems": problems,
    }


# The sampler's working set per logit row, in fp32 [vocab] arrays: the model's logits, the parts'
# adjusted logits, the probabilities, the sorted values of top-k / top-p and the raw logprobs.
SAMPLER_VOCAB_ROWS = 5


def step_memory(inp: PlanInputs, *, tokens: int, sequences: int, kv_pool_tokens: int) -> dict:
    """Per-device bytes of one engine step of `tokens` rows over `sequences` sequences with a KV pool of
    `kv_pool_tokens` tokens, as this module models them (compared with XLA's memory analysis of the same
    compiled step by `serving.aot`):

      * weights and the KV pool: `plan`'s per-device accounting (the first pipeline stage's share);
      * activations: the larger of the sampler's `SAMPLER_VOCAB_ROWS` fp32 vocabulary rows per sequence
        and one layer's widest activations per token (residual, normed input, the MLP's gate and up
        halves on this device), since XLA reuses the layer body's buffers before the sampler runs."""
    p = plan(inp)
    if "memory" not in p:
        raise ValueError("; ".join(p["problems"]))
    cfg, tp = inp.cfg, inp.tp
    act_b = 2 if dtype_bytes(inp.w_dtype) < 4 else 4
    intermediate = getattr(cfg, "moe_intermediate_size", 0) or cfg.intermediate_size
    layer = tokens * (2 * cfg.hidden_size + 2 * intermediate / tp) * act_b
    sampler = sequences * cfg.vocab_size * 4 * SAMPLER_VOCAB_ROWS
    weights = p["memory"]["weight_bytes_per_device"]
    kv = p["memory"]["kv_bytes_per_token_per_device"] * kv_pool_tokens
    activations = max(layer, sampler)
    return {"weights_bytes": int(weights), "kv_pool_bytes": int(kv), "activation_bytes": int(activations),
            "total_bytes": int(weights + kv + activations)}


def _inputs(inp: PlanInputs) -> dict:
    return {"model": inp.model_name, "device": inp.gpu.name, "tp": inp.tp, "pp": inp.pp,
            "microbatches": inp.microbatches, "context_len": inp.context_len, "batch": inp.batch,
            "prompt_len": inp.prompt_len or inp.context_len, "weight_dtype": inp.w_dtype,
            "kv_dtype": inp.kv_dt, "reserve_bytes": inp.reserve_bytes, "mfu": inp.mfu, "rules": inp.rules}


def _kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str):
    """`model.families.kv_bytes_per_token` for a planner dtype name: the real declaration for
    the dtypes the stack stores, the declared elements at the nominal width for the others."""
    if kv_dtype in FLOAT_DTYPES:
        return kv_bytes_per_token(cfg, kv_dtype)
    if kv_dtype in QUANTIZED_WEIGHTS:
        return kv_bytes_per_token(cfg, QUANTIZED_WEIGHTS[kv_dtype])
    return kv_bytes_per_token(cfg, bytes_per_element=dtype_bytes(kv_dtype))


def _itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def _stage_txt(s: int, pp: int) -> str:
    return f" (stage {s})" if pp > 1 else ""

