"""Batch-1 decode's weight streaming on XLA CPU: the 125M shape's matvecs against the read bandwidth.

How close the matrix-vector products of the 125M Llama shape come to the
machine's read bandwidth, by formulation, compiler option and XLA flags.

    python benchmarks/matvec_cpu_bench.py [--rounds 5] [--out benchmarks/results/matvec_cpu.json]
    python benchmarks/matvec_cpu_bench.py --flag_variant= --flag_variant=--xla_cpu_multi_thread_eigen=false ...

Why: batch-1 decode reads every weight once per token (~400 MB fp32) and does
almost nothing else, so its ceiling is the read bandwidth. `offline_throughput.py`
measures the plain jitted chain of the model's matvecs at ~0.63 of that
bandwidth; this script takes the chain apart to see where the rest goes.

Everything runs in one process per XLA flag set (flags are read once, at
backend start, so each variant is a child process; the variants alternate
`--rounds` times). Inside a child, each round times, back to back:

  * the read-bandwidth references `offline_throughput.read_bandwidth` uses: a
    jitted sum over a 512 MiB fp32 array and a matvec over it as [N, 1024];
  * the whole chain (every layer's seven projections, norms, SiLU, the logits
    head and the argmax; no attention, as `products_ceiling.products`)
    in each formulation of the projections (`FORMS`: the current einsum, the
    weight as the dot's left operand, multiply-and-reduce, the output dim split
    in two independent dots, a zero second row, the halves stored as two arrays
    beforehand), and the current formulation
    compiled with XLA CPU's experimental library fusions for dots (`OPTIONS`:
    XNNPACK, YNNPACK; per-program `compiler_options`);
  * its parts in the current formulation: the layers alone and the logits head
    alone (32000 x 768, a quarter of the bytes);
  * with `--out_sizes`, one shape at a time: chains of distinct [out, 768]
    weights (~100 MB each), e.g. the layers' 256 and 2048 rows against a fused
    q/k/v's 1280 and a fused gate/up's 4096.

Each figure is the best (minimum) wall time of the round's repeats, turned
into GB/s of weights read, and reported as a ratio to the same round's best
reference; the JSON keeps every round. Two figures that depend less on the
machine's load: GB read per CPU-second of the process (how efficiently a core
streams), and the share of samples (every ~0.3 ms, from /proc, during a second
pass over the same calls) in which two or more of XLA's threads were running:
whether both cores stream the weights or one does. The machine is shared: the
JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE_125M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                  num_kv_heads=4, head_dim=64, rope_theta=10000.0, dtype="float32", max_position_embeddings=2048,
                  bos_token_id=1, eos_token_ids=(2,))


def thread_ticks() -> dict[str, int]:
    """CPU ticks (user + system) of each thread of this process, from /proc (Linux)."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def running_threads_sampler(stop, hist):
    """Counts, every ~0.3 ms until `stop` is set, how many of this process's threads other than the
    main thread and itself are running or runnable (state R): XLA's compute threads at work."""
    skip = {str(threading.get_native_id()), str(os.getpid())}
    while not stop.is_set():
        n = 0
        for tid in os.listdir("/proc/self/task"):
            if tid in skip:
                continue
            try:
                n += open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0] == "R"
            except OSError:
                continue
        hist[n] = hist.get(n, 0) + 1
        time.sleep(0.0003)


def child(args) -> dict:
    import jax
    import jax.numpy as jnp

    from model.config import LlamaConfig
    from model.layers import rms_norm
    from model.params import init_params

    # The projections' formulations, all with [out, in] weights and x [1, in]:
    FORMS = {
        # what model.linear runs today
        "einsum": lambda x, w: jnp.einsum("te,fe->tf", x, w),
        # the weight as the dot's left operand: [out, in] x [1, in]^T -> [out, 1] (a free transpose at T=1)
        "weight_lhs": lambda x, w: jnp.einsum("fe,te->ft", w, x).T,
        # an elementwise product and a row reduction: a loop fusion instead of a library dot
        "mul_sum": lambda x, w: jnp.sum(w * x, axis=-1)[None, :],
        # the output dim in two halves, two independent dots the runtime could run on both cores
        "split_out": lambda x, w: jnp.concatenate([jnp.einsum("te,fe->tf", x, h)
                                                   for h in jnp.split(w, 2, axis=0)], axis=-1),
        # a second (zero) row: a 2-row product, which XLA hands to a matrix-matrix kernel
        "two_rows": lambda x, w: jnp.einsum("te,fe->tf", jnp.concatenate([x, jnp.zeros_like(x)]), w)[:1],
        # the output dim in two halves stored as two arrays before the call (`presplit` below), so neither
        # dot reads a slice: whether XLA CPU's runtime runs two independent matvecs on both cores
        "presplit_out": lambda x, w: jnp.concatenate([jnp.einsum("te,fe->tf", x, h) for h in w], axis=-1),
    }
    # Per-program XLA CPU options (`jax.jit(..., compiler_options=...)`): the dots handed to XNNPACK /
    # YNNPACK instead of XLA's Eigen dot thunk (the experimental library fusions of jax 0.10's XLA).
    OPTIONS = {"xnn_dot": {"xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
               "ynn_dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}}

    cfg = LlamaConfig(**SHAPE_125M)
    eps = cfg.rms_norm_eps

    def projections(params):
        """Each layer's seven [out, in] weights and two norms, the model's linear layers as `FORMS` take them."""
        return [dict(wq=L.wq.reshape(-1, L.wq.shape[-1]), wk=L.wk.reshape(-1, L.wk.shape[-1]),
                     wv=L.wv.reshape(-1, L.wv.shape[-1]), wo=L.wo.reshape(L.wo.shape[0], -1), w_gate=L.w_gate,
                     w_up=L.w_up, w_down=L.w_down, attn_norm=L.attn_norm, mlp_norm=L.mlp_norm)
                for L in params.layers]

    def layers_chain(form, params, x):
        lin = FORMS[form]
        for L in params["layers"]:
            h = rms_norm(x, L["attn_norm"], eps)
            q, k, v = lin(h, L["wq"]), lin(h, L["wk"]), lin(h, L["wv"])
            o = q + jnp.tile(k + v, (1, q.shape[1] // k.shape[1]))  # stands in for attention
            x = x + lin(o, L["wo"])
            h = rms_norm(x, L["mlp_norm"], eps)
            x = x + lin(jax.nn.silu(lin(h, L["w_gate"])) * lin(h, L["w_up"]), L["w_down"])
        return x

    def head(form, params, x):
        return jnp.argmax(FORMS[form](rms_norm(x, params["final_norm"], eps), params["lm_head"]), axis=-1)

    def whole(form, params, token):
        return head(form, params, layers_chain(form, params, params["embed"][token]))

    model_params = init_params(cfg, jax.random.key(0))
    params = dict(layers=projections(model_params), final_norm=model_params.final_norm,
                  lm_head=model_params.lm_head, embed=model_params.embed)
    def halves(w):
        """The weight's two output halves as arrays of their own (copied once, here)."""
        return tuple(jnp.array(h) for h in jnp.split(w, 2, axis=0))

    presplit = dict(params, layers=[{k: (halves(w) if k.startswith("w") else w) for k, w in L.items()}
                                    for L in params["layers"]], lm_head=halves(params["lm_head"]))
    form_params = {form: presplit if form == "presplit_out" else params for form in FORMS}

    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(params)) - params["embed"].nbytes + cfg.hidden_size * 4
    layer_bytes = weight_bytes - params["lm_head"].nbytes - cfg.hidden_size * 4
    n = 512 * 2**20 // 4
    big = jnp.ones((n,), jnp.float32)
    vec = jnp.ones((1024,), jnp.float32)
    token = jnp.array([5], jnp.int32)
    x0 = params["embed"][token]
    cases = {"ref_sum_512MiB": (jax.jit(jnp.sum), (big,), big.nbytes),
             "ref_matvec_512MiB": (jax.jit(lambda a, b: a.reshape(-1, 1024) @ b), (big, vec), big.nbytes)}
    for form in FORMS:
        cases[f"chain_{form}"] = (jax.jit(lambda p, t, f=form: whole(f, p, t)), (form_params[form], token),
                                  weight_bytes)
    for name, opts in OPTIONS.items():
        cases[f"chain_einsum_{name}"] = (jax.jit(lambda p, t: whole("einsum", p, t), compiler_options=opts),
                                         (params, token), weight_bytes)
    cases["layers_einsum"] = (jax.jit(lambda p, x: layers_chain("einsum", p, x)), (params, x0), layer_bytes)
    for form in FORMS:
        cases[f"head_{form}"] = (jax.jit(lambda p, x, f=form: head(f, p, x)), (form_params[form], x0),
                                 params["lm_head"].nbytes)
    # One matvec shape at a time: a chain of distinct [out, 768] weights, ~100 MB in all (past the L3
    # cache), at the layers' output sizes and at those of fused q/k/v (1280) and gate/up (4096):
    # whether a bigger product per call gets the second core.
    def shape_chain(ws, x):
        for w in ws:
            x = x + 1e-3 * jnp.tanh(jnp.sum(jnp.einsum("te,fe->tf", x, w)))
        return x
    for out in args.out_sizes:
        ws = [jax.random.normal(jax.random.key(i), (out, cfg.hidden_size), jnp.float32)
              for i in range(max(1, 100 * 2**20 // (out * cfg.hidden_size * 4)))]
        cases[f"shape_{out}x{cfg.hidden_size}"] = (jax.jit(shape_chain), (ws, x0), sum(w.nbytes for w in ws))
    ref, skipped = None, {}
    for name, (f, a, _) in list(cases.items()):
        try:
            out = jax.block_until_ready(f(*a))
        except Exception as e:  # an experimental option another jax / XLA version names differently
            if not any(name.endswith(o) for o in OPTIONS):
                raise
            skipped[name] = str(e).splitlines()[0]
            del cases[name]
            continue
        if name.startswith("chain_"):
            ref = out if ref is None else ref
            assert int(out[0]) == int(ref[0]), f"{name} picks token {int(out[0])}, einsum {int(ref[0])}"
    rounds = []
    for _ in range(args.rounds):
        r = {}
        for name, (f, a, nbytes) in cases.items():
            walls = []
            t0, c0 = thread_ticks(), time.process_time()
            for _ in range(args.repeats):
                t = time.perf_counter()
                jax.block_until_ready(f(*a))
                walls.append(time.perf_counter() - t)
            cpu = time.process_time() - c0
            t1 = thread_ticks()
            # Then the same calls again with the sampler watching (its own CPU time kept out of the above).
            hist, stop = {}, threading.Event()
            sampler = threading.Thread(target=running_threads_sampler, args=(stop, hist))
            sampler.start()
            for _ in range(args.repeats):
                jax.block_until_ready(f(*a))
            stop.set()
            sampler.join()
            busy = sorted((t1[k] - t0.get(k, 0) for k in t1), reverse=True)
            r[name] = {"best_ms": min(walls) * 1e3, "median_ms": statistics.median(walls) * 1e3,
                       "GBps": nbytes / min(walls) / 1e9, "cpu_over_wall": cpu / sum(walls),
                       "GB_per_cpu_second": nbytes * len(walls) / cpu / 1e9,
                       "busiest_thread_share": busy[0] / max(1, sum(busy)),
                       "two_threads_running_share": sum(v for k, v in hist.items() if k >= 2) / max(1, sum(
                           hist.values()))}
        ref_bw = max(r["ref_sum_512MiB"]["GBps"], r["ref_matvec_512MiB"]["GBps"])
        for v in r.values():
            v["of_read_bandwidth"] = v["GBps"] / ref_bw
        rounds.append(r)
    return {"xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__, "rounds": rounds,
            "skipped": skipped}


def summarize(variant: dict) -> dict:
    """Per case: the median over rounds of its ratio to the round's read bandwidth, and its best GB/s."""
    names = variant["rounds"][0].keys()
    return {n: {"of_read_bandwidth_median": statistics.median(r[n]["of_read_bandwidth"] for r in variant["rounds"]),
                "GBps_best": max(r[n]["GBps"] for r in variant["rounds"]),
                "cpu_over_wall_median": statistics.median(r[n]["cpu_over_wall"] for r in variant["rounds"]),
                "GB_per_cpu_second_median": statistics.median(r[n]["GB_per_cpu_second"] for r in variant["rounds"]),
                "two_threads_running_share_median": statistics.median(r[n]["two_threads_running_share"]
                                                                      for r in variant["rounds"])}
            for n in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the flag variants (one child each)")
    ap.add_argument("--child_rounds", type=int, default=2, help="rounds of every case inside one child")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per case and round (the best counts)")
    ap.add_argument("--flag_variant", action="append", default=None,
                    help="an XLA_FLAGS value to compare, in its own child process ('' = the defaults); repeat it, "
                         "written with '=' (--flag_variant=--xla_cpu_use_onednn=true)")
    ap.add_argument("--out_sizes", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="comma-separated output sizes of [out, hidden] matvec chains to time one shape at a time "
                         "(e.g. 256,2048,4096; default none)")
    ap.add_argument("--out", default=None, help="JSON results (default: print only)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.rounds = args.child_rounds
        print(json.dumps(child(args)))
        return

    args.flag_variants = args.flag_variant or [""]
    load_before = os.getloadavg()
    results = {v: [] for v in args.flag_variants}
    for rnd in range(args.rounds):
        for v in args.flag_variants:
            env = dict(os.environ, XLA_FLAGS=v)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--child_rounds",
                                  str(args.child_rounds), "--repeats", str(args.repeats),
                                  "--out_sizes", ",".join(map(str, args.out_sizes))],
                                 env=env, capture_output=True, text=True, check=True)
            record = json.loads(out.stdout.strip().splitlines()[-1])
            results[v].extend(record["rounds"])
            for name, why in record["skipped"].items():
                print(f"  {name} skipped: {why}")
            print(f"round {rnd} {v or '(default flags)'}: done, load {os.getloadavg()[0]:.1f}", flush=True)
    summary = {v: summarize({"rounds": rs}) for v, rs in results.items()}
    for v, s in summary.items():
        print(f"\nXLA_FLAGS={v!r}")
        print(f"  {'case':24s} {'of read bw (median)':>20s} {'best GB/s':>10s} {'GB/cpu-s':>9s} {'cpu/wall':>9s} {'2 threads':>10s}")
        for n, c in s.items():
            print(f"  {n:24s} {c['of_read_bandwidth_median']:20.2f} {c['GBps_best']:10.1f} "
                  f"{c['GB_per_cpu_second_median']:9.1f} {c['cpu_over_wall_median']:9.2f} {c['two_threads_running_share_median']:10.2f}")
    if args.out:
        import jax
        record = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                              "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
                  "summary": summary, "rounds": results}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
