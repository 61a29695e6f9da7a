"""`python -m sharding.plan`: layout arithmetic for a model shape on a GPU.

    python -m sharding.plan --model llama3-70b --device h100-sxm --tp 4 --context_len 8000
    python -m sharding.plan --model llama3-8b --batch 32 --format json
    python -m sharding.plan --model llama3-8b --plot roofline.png
    python -m sharding.plan --model tiny --tp 4 --measure     # compiles on the devices present

Prints weight and KV memory per device, the sequences that fit, decode and
prefill times from the roofline, TP collective costs over NVLink and PCIe,
the pipeline bubble and, for a mixture of experts (`--model mixtral-8x7b`),
total and active parameters and the bytes a decode step reads by batch; a layout that does not fit says why (exit status 1).
The model of each number is stated in `sharding/estimate.py`.
"""

from __future__ import annotations

import argparse
import json
import sys

from model.families import config_by_name
from sharding.estimate import DTYPE_BYTES, QUANTIZED_WEIGHTS, PlanInputs, plan
from sharding.hardware import GPUS, get_gpu
from sharding.mesh import MeshError
from sharding.rules import RuleError, available_rules


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sharding.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="a config name in configs/ or a JSON path")
    p.add_argument("--device", default="h100-sxm", help=f"one of {sorted(GPUS)}")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--context_len", "--context-len", type=int, default=8192,
                   help="tokens of KV per sequence (prompt + output)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--prompt_len", "--prompt-len", type=int, default=None, help="prefill length (default: context)")
    p.add_argument("--weight_dtype", "--weight-dtype", choices=sorted(DTYPE_BYTES), default=None)
    p.add_argument("--kv_dtype", "--kv-dtype", choices=sorted(DTYPE_BYTES), default=None)
    p.add_argument("--reserve_gb", "--reserve-gb", type=float, default=4.0,
                   help="per-device runtime/activation reserve in GB (1e9 B)")
    p.add_argument("--kv_offload_gb", "--kv-offload-gb", type=float, default=0.0,
                   help="host tier of the prefix cache in GB (1e9 B; serving's --kv_offload_bytes): adds its "
                        "capacity and restore vs recompute time to the memory table")
    p.add_argument("--mfu", type=float, default=0.5, help="fraction of peak FLOP/s prefill reaches")
    p.add_argument("--interconnect", choices=["nvlink", "pcie"], default=None,
                   help="link TP collectives use in the step times (default: NVLink when present)")
    p.add_argument("--rules", default="megatron", help=f"rule table: {available_rules()} or a JSON path")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw the roofline with the plan's points")
    p.add_argument("--measure", action="store_true",
                   help="also compile the decode step for this layout on the devices present")
    p.add_argument("--page_size", "--page-size", type=int, default=16, help="KV page size for --measure")
    p.add_argument("--list_devices", "--list-devices", action="store_true", help="print the GPU table and exit")
    return p


def inputs_from_args(args) -> PlanInputs:
    return PlanInputs(
        cfg=config_by_name(args.model), gpu=get_gpu(args.device), tp=args.tp, pp=args.pp,
        microbatches=args.microbatches, context_len=args.context_len, batch=args.batch,
        prompt_len=args.prompt_len, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
        reserve_bytes=args.reserve_gb * 1e9, mfu=args.mfu, interconnect=args.interconnect, rules=args.rules,
        model_name=args.model, kv_offload_bytes=args.kv_offload_gb * 1e9)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_devices:
        print(device_table())
        return 0
    try:
        inp = inputs_from_args(args)
        result = plan(inp)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.measure:
        result["measured"] = _measure(inp, args)
    if args.plot and "decode" in result:
        from sharding.roofline_plot import plot_roofline

        plot_roofline(result, args.plot)
        result["plot"] = args.plot
    print(json.dumps(result, indent=2) if args.format == "json" else format_table(result))
    return 0 if result["fits"] else 1


def _measure(inp: PlanInputs, args) -> dict:
    if inp.pp > 1:
        return {"skipped": "the forward has no pipeline stages yet; measure a pp=1 layout"}
    from sharding.measure import measure

    # The weights and cache the plan describes: float dtypes, or the real int8 / fp8 declarations.
    cfg = inp.declared_cfg() or inp.cfg
    kv = inp.kv_dt if inp.kv_dt in ("float32", "bfloat16", "float16") else QUANTIZED_WEIGHTS.get(inp.kv_dt)
    try:
        return measure(cfg, tp=inp.tp, batch=inp.batch, context_len=inp.context_len, rules=inp.rules,
                       page_size=args.page_size, kv_dtype=kv)
    except (MeshError, RuleError) as e:
        hint = " (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting)"
        return {"error": f"{e}{hint if isinstance(e, MeshError) else ''}"}


# ---------------------------------------------------------------------------- formatting

def _b(x) -> str:
    if x is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f} B"


def _t(s) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:,.3f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def device_table() -> str:
    head = f"{'key':<10} {'name':<16} {'HBM':>8} {'HBM BW':>10} {'BF16 dense':>11} {'NVLink':>10} {'PCIe':>9}"
    rows = [head, "-" * len(head)]
    for key, g in GPUS.items():
        nv = f"{g.nvlink_bandwidth / 1e9:,.0f} GB/s" if g.nvlink_bandwidth else "none"
        rows.append(f"{key:<10} {g.name:<16} {g.hbm_bytes / 1e9:>5.0f} GB {g.hbm_bandwidth / 1e12:>5.2f} TB/s "
                    f"{g.bf16_flops / 1e12:>6.0f} TF/s {nv:>10} {g.pcie_bandwidth / 1e9:>4.0f} GB/s")
    return "\n".join(rows)


def format_table(r: dict) -> str:
    i = r["inputs"]
    lines = [f"plan: {i['model']} on {i['device']}, tp={i['tp']} pp={i['pp']} microbatches={i['microbatches']}, "
             f"batch {i['batch']} x {i['context_len']} tokens, weights {i['weight_dtype']}, KV {i['kv_dtype']}"]
    if r["fits"]:
        lines.append("verdict: FITS")
    else:
        lines.append("verdict: DOES NOT FIT")
        lines += [f"  - {p}" for p in r["problems"]]
    if "memory" not in r:
        return "\n".join(lines)

    def section(title, rows):
        lines.append(f"\n{title}")
        w = max(len(k) for k, _ in rows)
        lines.extend(f"  {k:<{w}}  {v}" for k, v in rows)

    mem, dec, pre, col, lay = r["memory"], r["decode"], r["prefill"], r["collectives"], r["layout"]
    section("memory (per device)", [
        ("parameters (model)", f"{r['model']['params']:,}"),
        ("weights", _b(mem["weight_bytes_per_device"])),
        ("KV heads", f"{lay['kv_heads_per_device']}" + ("  (" + "; ".join(lay["notes"]) + ")" if lay["notes"] else "")),
        ("KV per token (model)", f"{mem['kv_bytes_per_token']:,} B"),
        ("KV per token (device)", f"{mem['kv_bytes_per_token_per_device']:,.0f} B"),
        ("KV per sequence", f"{_b(mem['kv_bytes_per_sequence'])} (device: {_b(mem['kv_bytes_per_sequence_per_device'])})"),
        ("HBM / reserve", f"{_b(mem['hbm_bytes'])} / {_b(mem['reserve_bytes'])}"),
        ("free for KV", _b(mem["kv_free_bytes_per_device"])),
        ("max concurrent sequences", f"{mem['max_concurrent_sequences']:,}"),
    ] + ([
        ("host KV tier (per host)", f"{_b(mem['host_tier_bytes'])}: {mem['host_tier_tokens']:,} tokens, "
                                    f"{mem['host_tier_sequences']:,} sequences"),
        ("restore / recompute a seq", f"{_t(mem['host_tier_restore_s_per_sequence'])} over PCIe / "
                                      f"{_t(mem['host_tier_recompute_s_per_sequence'])} prefill"),
    ] if "host_tier_bytes" in mem else []))
    roof = r["roofline"]
    section("decode step (memory roof: weights + live KV)", [
        ("batch / microbatch", f"{dec['batch']} / {dec['microbatch']}"),
        ("bytes read per device", _b(dec["bytes_per_device"])),
        ("memory / compute / comm", f"{_t(dec['memory_time_s'])} / {_t(dec['compute_time_s'])} / "
                                    f"{_t(dec['comm_time_s'])}"),
        ("step time", _t(dec["step_time_s"])),
        ("tokens/s ceiling", f"{dec['tokens_per_s']:,.1f}"),
        ("arithmetic intensity", f"{dec['intensity']:,.2f} FLOP/B vs ridge {roof['ridge_point']:,.1f} "
                                 f"-> {dec['bound']}-bound"),
    ])
    section(f"prefill ({pre['prompt_len']} tokens at {pre['mfu']:.0%} MFU)", [
        ("FLOPs per device", f"{pre['flops_per_device']:.3e}"),
        ("compute / memory / comm", f"{_t(pre['compute_time_s'])} / {_t(pre['memory_time_s'])} / "
                                    f"{_t(pre['comm_time_s'])}"),
        ("time", _t(pre["time_s"])),
        ("arithmetic intensity", f"{pre['intensity']:,.0f} FLOP/B -> {pre['bound']}-bound"),
    ])
    rows = [("all-reduces", f"{col['all_reduces_per_layer']} per layer, {col['all_reduces_per_step']} per "
                            f"step (incl. vocab-parallel embedding)"),
            ("payload per token", _b(col["payload_bytes_per_token"]))]
    for phase, key in (("decode", "decode_step"), ("prefill", "prefill")):
        for link in ("nvlink", "pcie"):
            c = col[key][link]
            rows.append((f"{phase} over {link}", "no NVLink" if c is None else
                         f"{_b(c['bytes_per_gpu'])}/GPU, wire {_t(c['wire_time_s'])}, latency floor "
                         f"{_t(c['latency_floor_s'])}, total {_t(c['time_s'])}"))
    section(f"TP collectives (step times use {col['interconnect'] or 'none'})", rows)
    if r.get("moe"):
        lines.extend(_format_moe(r))
    pl = r["pipeline"]
    section("pipeline", [("stages x microbatches", f"{pl['stages']} x {pl['microbatches']}"),
                         ("layers per stage", ", ".join(map(str, lay["layers_per_stage"]))),
                         ("bubble fraction", f"{pl['bubble_fraction']:.1%}")])
    if "measured" in r:
        lines.extend(_format_measured(r["measured"]))
    if r.get("plot"):
        lines.append(f"\nroofline plot written to {r['plot']}")
    return "\n".join(lines)


def _format_moe(r: dict) -> list[str]:
    x = r["moe"]
    out = [f"\nmixture of experts ({x['experts_per_token']} of {x['num_experts']} experts per token)",
           f"  parameters total / active  {r['model']['params']:,} / {r['model']['active_params']:,}",
           f"  experts per device         {x['experts_per_device']} (expert parallel {x['expert_parallel']}, "
           f"tensor parallel inside experts {x['expert_tensor_parallel']})",
           f"  expert weights per device  {_b(x['expert_bytes_per_device'])}",
           f"  EP collectives             {x['collectives']}",
           "  decode bytes per device by batch (expected distinct experts per layer: E(1-(1-k/E)^B)):",
           f"    {'batch':>6} {'experts':>8} {'expert bytes':>13} {'dense bytes':>12} {'KV bytes':>12} {'total':>12}"]
    for row in x["decode_bytes_by_batch"]:
        out.append(f"    {row['batch']:>6} {row['experts_touched_per_layer']:>8.2f} {_b(row['expert_bytes']):>13} "
                   f"{_b(row['dense_bytes']):>12} {_b(row['kv_bytes']):>12} {_b(row['bytes']):>12}")
    return out


def _format_measured(m: dict) -> list[str]:
    if "skipped" in m or "error" in m:
        return [f"\nmeasured: {m.get('skipped') or m.get('error')}"]
    out = [f"\nmeasured (compiled {m['step']['kind']} step, {m['step']['tokens']} tokens, {m['mesh']})"]
    mem, pred = m["memory_per_device"], m["predicted_per_device"]
    if mem:
        out.append(f"  arguments  {_b(mem['argument'])}   predicted weights + cache {_b(pred['argument_bytes'])}")
        out.append(f"  temp       {_b(mem['temp'])}   output {_b(mem['output'])}   aliased {_b(mem['alias'])}")
    c, pc = m["collectives"], m["predicted_collectives"]
    per_layer = c["per_layer"] if c["per_layer"] is not None else c["layers_differ"]
    out.append(f"  per layer  {per_layer}   predicted {pc['per_layer']}")
    out.append(f"  outside    {c['outside_layers']}   predicted {pc['outside_layers']}")
    return out


if __name__ == "__main__":
    sys.exit(main())
