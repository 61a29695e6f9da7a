"""Attention-kernel benchmark: achieved bandwidth of the Pallas kernels vs the XLA reference.

Measures, in one process on one device:
  1. the device's copy bandwidth (x + 1 over a large bf16 array: read + write
     bytes over time) and bf16 matmul rate, the ceilings to compare against;
  2. parity of the Pallas kernels with the references on small ragged mixes
     (the first thing to look at after a change: a fast wrong kernel is worthless);
  3. decode batches (1..256 sequences x 1K..32K context) and mixed batches
     (prefill chunks + decodes) with Llama-3-8B attention shapes (32 query
     heads, 8 KV heads, head_dim 128, bf16, page 16), for the kernel (default
     split-K heuristic, and unsplit when that differs) and the reference
     compiled by XLA on the same device;
  4. a small sweep of kernel tuning knobs at batch 64 / 4K context (KV splits x
     KV block, then Triton stages / warps and query-tile rows one at a time).

Achieved bandwidth counts the bytes an ideal kernel must move: every live
sequence's K and V once, plus q read and the output written; reported in GB/s
and as a fraction of the measured copy bandwidth. On GPU, times are device
times from CUPTI (all kernels of one call, including the wrapper's small XLA
ops), falling back to wall clock. Results go to `<out>/kernel_bench.json`.

`--smoke` runs the same code on CPU with tiny shapes, the interpret-mode
kernels and a short budget, to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError:  # pragma: no cover
    sys.exit("jax is required")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels_pallas import get_backend  # noqa: E402
from kernels_pallas.ragged_paged_attention import kernel_config  # noqa: E402
from kernels_pallas.reference import ragged_paged_attention_reference, write_kv_reference  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"


@dataclasses.dataclass
class Plan:
    """What one run measures; --smoke swaps in a tiny plan."""

    shape: Shape
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    mixed: dict  # name -> list of (q_len, kv_len)
    max_kv_tokens: int  # skip decode cases whose batch x context exceeds this (memory bound)
    copy_bytes: int
    matmul_n: int
    iters: int
    sweep: tuple[dict, ...]
    kernel_backend: str


def gpu_plan() -> Plan:
    mixed = {
        "1x512-prefill+63-decode@4K": [(512, 4096)] + [(1, 4096)] * 63,
        "4x256-chunks@2K+124-decode@2K": [(256, 2048)] * 4 + [(1, 2048)] * 124,
        "1x2048-prefill@2K": [(2048, 2048)],
    }
    sweep = tuple(dict(num_kv_splits=s, block_kv=b) for s in (1, 2, 4) for b in (32, 64, 128))
    sweep += (dict(num_stages=3), dict(num_warps=8), dict(rows=64))
    return Plan(Shape(), (1, 8, 64, 256), (1024, 4096, 16384, 32768), mixed, max_kv_tokens=2**21,
                copy_bytes=2**31, matmul_n=8192, iters=20, sweep=sweep, kernel_backend="pallas")


def smoke_plan() -> Plan:
    mixed = {"1x24-prefill+3-decode@64": [(24, 64)] + [(1, 64)] * 3}
    sweep = (dict(num_kv_splits=2, block_kv=32),)  # one knob set: the sweep's code path, not its search
    return Plan(Shape(q_heads=8, kv_heads=2, head_dim=64, page_size=16), (1, 4), (256,), mixed,
                max_kv_tokens=2**10, copy_bytes=2**25, matmul_n=256, iters=3, sweep=sweep,
                kernel_backend="pallas_interpret")


# ----------------------------------------------------------------------------- timing


def device_seconds(fn, args, iters: int) -> tuple[float, str]:
    """Median seconds per call of jitted `fn(*args)`: CUPTI device time on GPU, else wall clock."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    if jax.default_backend() == "gpu":
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, ms = profiler.measure(fn, iterations=iters)(*args)
            ms = ms if isinstance(ms, list) else [ms]
            return statistics.median(ms) / 1e3, "cupti"
        except Exception as e:  # no CUPTI in this install: fall back
            print(f"  (CUPTI unavailable: {type(e).__name__}: {e}; using wall clock)", flush=True)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return min(samples), "wall"


def copy_bandwidth(nbytes: int, iters: int) -> dict:
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.ones((), x.dtype))
    sec, how = device_seconds(f, (x,), iters)
    return dict(bytes=2 * nbytes, seconds=sec, GBps=2 * nbytes / sec / 1e9, timer=how)


def matmul_rate(n: int, iters: int) -> dict:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    sec, how = device_seconds(f, (a, b), iters)
    return dict(n=n, seconds=sec, TFLOPs=2 * n**3 / sec / 1e12, timer=how)


# ----------------------------------------------------------------------------- batches


def build_batch(seqs, shape: Shape, seed: int = 0):
    """Device arrays for a ragged batch of (q_len, kv_len) with scattered pages and random data."""
    dtype = jnp.dtype(shape.dtype)
    ps = shape.page_size
    pages_per_seq = max(1, max(-(-kv // ps) for _, kv in seqs))
    num_pages = len(seqs) * pages_per_seq + 1
    rng = np.random.RandomState(seed)
    tables = rng.permutation(num_pages)[:len(seqs) * pages_per_seq].reshape(len(seqs), pages_per_seq)
    q_lens = np.array([q for q, _ in seqs], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    keys = jax.random.split(jax.random.key(seed), 3)
    page_shape = (num_pages, ps, shape.kv_heads, shape.head_dim)

    @jax.jit
    def draw(keys):
        return (jax.random.normal(keys[0], (int(cu[-1]), shape.q_heads, shape.head_dim), dtype),
                jax.random.normal(keys[1], page_shape, dtype), jax.random.normal(keys[2], page_shape, dtype))

    q, k, v = draw(keys)
    return (q, k, v, jnp.asarray(kv_lens), jnp.asarray(tables.astype(np.int32)), jnp.asarray(cu),
            jnp.int32(len(seqs)))


def useful_bytes(seqs, shape: Shape) -> int:
    item = jnp.dtype(shape.dtype).itemsize
    kv = sum(kv for _, kv in seqs) * shape.kv_heads * shape.head_dim * 2 * item
    tokens = sum(q for q, _ in seqs)
    return kv + 2 * tokens * shape.q_heads * shape.head_dim * item


def attention_flops(seqs, shape: Shape) -> int:
    visible = sum(sum(kv - q + j + 1 for j in range(q)) for q, kv in seqs)
    return 4 * visible * shape.q_heads * shape.head_dim


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


class Runner:
    def __init__(self, plan: Plan, budget_s: float):
        self.plan = plan
        self.deadline = time.monotonic() + budget_s
        self.kernel = get_backend(plan.kernel_backend).attention
        self.reference = jax.jit(ragged_paged_attention_reference, static_argnames="sm_scale")

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def kernel_fn(self, **knobs):
        scale = self.plan.shape.head_dim**-0.5
        return jax.jit(lambda *a: self.kernel(*a, sm_scale=scale, **knobs))

    def measure_case(self, name: str, seqs, copy_gbps: float) -> dict:
        shape, plan = self.plan.shape, self.plan
        row = dict(case=name, seqs=len(seqs), tokens=sum(q for q, _ in seqs),
                   kv_tokens=sum(kv for _, kv in seqs), bytes=useful_bytes(seqs, shape),
                   flops=attention_flops(seqs, shape))
        args = build_batch(seqs, shape)
        q, k, _, _, tables = args[:5]
        cfg = kernel_config(q.shape[0], tables.shape[0], tables.shape[1], shape.page_size, shape.q_heads,
                            shape.kv_heads, k.dtype)
        row["config"] = dataclasses.asdict(cfg)
        ref_fn = jax.jit(lambda *a: self.reference(*a, sm_scale=shape.head_dim**-0.5))
        ref_s, timer = device_seconds(ref_fn, args, plan.iters)
        row.update(timer=timer, ref_us=ref_s * 1e6, ref_GBps=row["bytes"] / ref_s / 1e9)
        want = ref_fn(*args)
        # The default configuration, and the same without split-K where the default splits.
        variants = [("kernel", {})] + ([("kernel_unsplit", dict(num_kv_splits=1))] if cfg.num_kv_splits > 1 else [])
        for label, knobs in variants:
            fn = self.kernel_fn(**knobs)
            sec, _ = device_seconds(fn, args, plan.iters)
            row[f"{label}_us"] = sec * 1e6
            row[f"{label}_GBps"] = row["bytes"] / sec / 1e9
            row[f"{label}_frac_copy"] = row[f"{label}_GBps"] / copy_gbps
            row[f"{label}_TFLOPs"] = row["flops"] / sec / 1e12
            row[f"{label}_max_err"] = max_err(fn(*args), want)
        row["speedup_vs_ref"] = row["ref_us"] / row["kernel_us"]
        del args
        return row


# ----------------------------------------------------------------------------- sections


def parity_cases():
    """Small ragged mixes with edge lengths (0, 1, ps-1, ps, ps+1, several pages) per page size."""
    for ps, hq, hkv, d, dtype in [(16, 32, 8, 128, "bfloat16"), (8, 8, 1, 64, "float32"),
                                  (64, 24, 8, 64, "bfloat16"), (32, 4, 4, 128, "float32")]:
        seqs = [(1, 1), (1, ps - 1), (1, ps), (1, ps + 1), (5, 3 * ps + 2), (ps + 1, ps + 1), (3, 3)]
        yield f"ps{ps}-g{hq // hkv}-d{d}-{dtype}", Shape(hq, hkv, d, ps, dtype), seqs


def run_parity(runner: Runner, smoke: bool) -> list[dict]:
    rows = []
    backend = get_backend(runner.plan.kernel_backend)
    cases = list(parity_cases())[:2] if smoke else list(parity_cases())
    for name, shape, seqs in cases:
        try:
            # Two padding sequences and padding tokens at the end, as the engine packs them.
            q, k, v, kv_lens, tables, cu, _ = build_batch(seqs, shape, seed=1)
            q = jnp.pad(q, ((0, 5), (0, 0), (0, 0)))
            kv_lens = jnp.pad(kv_lens, (0, 2))
            tables = jnp.pad(tables, ((0, 2), (0, 0)))
            cu = jnp.pad(cu, (0, 2), mode="edge")
            args = (q, k, v, kv_lens, tables, cu, jnp.int32(len(seqs)))
            scale = shape.head_dim**-0.5
            got = jax.jit(lambda *a: backend.attention(*a, sm_scale=scale))(*args)
            want = runner.reference(*args, sm_scale=scale)
            # Same criterion as the tests: |got - want| <= tol * (1 + |want|).
            tol = 1e-5 if shape.dtype == "float32" else 1e-2
            g32, w32 = got.astype(jnp.float32), want.astype(jnp.float32)
            err = float(jnp.max(jnp.abs(g32 - w32) / (1 + jnp.abs(w32))))
            finite = bool(jnp.isfinite(got.astype(jnp.float32)).all())
            num_slots = k.shape[0] * shape.page_size
            slots = np.random.RandomState(2).permutation(num_slots)[:q.shape[0]].astype(np.int32)
            slots[-5:] = num_slots  # padding tokens: dropped
            slots = jnp.asarray(slots)
            new = q[:, :shape.kv_heads]
            got_kv = jax.jit(backend.write_kv)(k, v, new, new, slots)
            want_kv = write_kv_reference(k, v, new, new, slots)
            write_ok = all(bool((a == b).all()) for a, b in zip(got_kv, want_kv))
            rows.append(dict(case=name, attention_scaled_err=err, tol=tol, finite=finite, write_exact=write_ok,
                             ok=bool(err <= tol and finite and write_ok)))
        except Exception as e:
            rows.append(dict(case=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
            traceback.print_exc()
        print(f"  parity {rows[-1]}", flush=True)
    return rows


def run_cases(runner: Runner, cases, copy_gbps: float, label: str) -> list[dict]:
    rows = []
    for name, seqs in cases:
        if runner.out_of_time():
            rows.append(dict(case=name, skipped="time budget"))
            continue
        try:
            rows.append(runner.measure_case(name, seqs, copy_gbps))
        except Exception as e:
            rows.append(dict(case=name, error=f"{type(e).__name__}: {e}"[:2000]))
            traceback.print_exc()
        print(f"  {label} {short(rows[-1])}", flush=True)
    return rows


def run_sweep(runner: Runner, copy_gbps: float) -> list[dict]:
    plan = runner.plan
    batch = 64 if 64 in plan.batches else plan.batches[-1]
    ctx = 4096 if 4096 in plan.contexts else plan.contexts[-1]
    seqs = [(1, ctx)] * batch
    args = build_batch(seqs, plan.shape)
    nbytes = useful_bytes(seqs, plan.shape)
    rows = []
    for knobs in plan.sweep:
        if runner.out_of_time():
            rows.append(dict(knobs=knobs, skipped="time budget"))
            continue
        try:
            sec, _ = device_seconds(runner.kernel_fn(**knobs), args, plan.iters)
            rows.append(dict(batch=batch, context=ctx, knobs=knobs, us=sec * 1e6, GBps=nbytes / sec / 1e9,
                             frac_copy=nbytes / sec / 1e9 / copy_gbps))
        except Exception as e:
            rows.append(dict(knobs=knobs, error=f"{type(e).__name__}: {e}"[:2000]))
        print(f"  sweep {rows[-1]}", flush=True)
    return rows


def short(row: dict) -> str:
    keys = ("case", "kernel_us", "ref_us", "kernel_GBps", "kernel_frac_copy", "speedup_vs_ref", "kernel_max_err",
            "error", "skipped")
    return ", ".join(f"{k}={_fmt(row[k])}" for k in keys if k in row)


def _fmt(x):
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    head = f"{'case':<34}{'kern us':>10}{'ref us':>10}{'kern GB/s':>11}{'ref GB/s':>10}{'frac copy':>10}" \
           f"{'unsplit':>9}{'speedup':>9}{'max err':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "kernel_us" not in r:
            print(f"{r['case']:<34}  {r.get('error') or r.get('skipped')}"[:160])
            continue
        unsplit = r.get("kernel_unsplit_frac_copy", float("nan"))
        print(f"{r['case']:<34}{r['kernel_us']:>10.1f}{r['ref_us']:>10.1f}{r['kernel_GBps']:>11.1f}"
              f"{r['ref_GBps']:>10.1f}{r['kernel_frac_copy']:>10.2f}{unsplit:>9.2f}{r['speedup_vs_ref']:>9.2f}"
              f"{r['kernel_max_err']:>9.1e}")


def decode_cases(plan: Plan):
    for batch in plan.batches:
        for ctx in plan.contexts:
            if batch * ctx <= plan.max_kv_tokens:
                yield f"decode b={batch} ctx={ctx}", [(1, ctx)] * batch


def goal_summary(decode_rows: list[dict]) -> dict:
    """The issue's goal: >= 80% of copy bandwidth at batch >= 64 / 4K context, and faster than XLA everywhere."""
    at_goal = [r for r in decode_rows if "kernel_us" in r and r["seqs"] >= 64 and r["kv_tokens"] // r["seqs"] == 4096]
    measured = [r for r in decode_rows if "kernel_us" in r]
    return dict(
        frac_copy_at_b64plus_4k=[round(r["kernel_frac_copy"], 3) for r in at_goal],
        bandwidth_goal_met=bool(at_goal) and all(r["kernel_frac_copy"] >= 0.8 for r in at_goal),
        slower_than_reference=[r["case"] for r in measured if r["speedup_vs_ref"] < 1.0],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret-mode kernels, CPU is fine")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this long")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-parity", action="store_true")
    args = p.parse_args(argv)
    plan = smoke_plan() if args.smoke else gpu_plan()
    budget = args.budget_s or (240.0 if args.smoke else 390.0)
    if not args.smoke and jax.default_backend() != "gpu":
        print("no GPU backend: run with --smoke on CPU", file=sys.stderr)
        return 2
    started = time.monotonic()
    runner = Runner(plan, budget)
    dev = jax.devices()[0]
    meta = dict(when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                jax=jax.__version__, backend=jax.default_backend(), device=getattr(dev, "device_kind", str(dev)),
                python=platform.python_version(), smoke=args.smoke, kernel_backend=plan.kernel_backend,
                shape=dataclasses.asdict(plan.shape))
    print(f"kernel_bench: {meta}", flush=True)

    copy = copy_bandwidth(plan.copy_bytes, plan.iters)
    mm = matmul_rate(plan.matmul_n, plan.iters)
    print(f"copy bandwidth {copy['GBps']:.0f} GB/s ({copy['timer']}); bf16 matmul {mm['TFLOPs']:.1f} TFLOP/s "
          f"(n={mm['n']})", flush=True)
    result = dict(meta=meta, copy=copy, matmul=mm)
    result["parity"] = [] if args.no_parity else run_parity(runner, args.smoke)
    result["decode"] = run_cases(runner, list(decode_cases(plan)), copy["GBps"], "decode")
    result["mixed"] = run_cases(runner, list(plan.mixed.items()), copy["GBps"], "mixed")
    result["sweep"] = [] if args.no_sweep else run_sweep(runner, copy["GBps"])
    result["goal"] = goal_summary(result["decode"])
    result["wall_s"] = time.monotonic() - started

    print_table(f"Decode attention ({plan.kernel_backend} vs XLA reference; copy bandwidth "
                f"{copy['GBps']:.0f} GB/s)", result["decode"])
    print_table("Mixed batches", result["mixed"])
    print(f"\nparity: {sum(r.get('ok', False) for r in result['parity'])}/{len(result['parity'])} ok; "
          f"goal: {result['goal']}; wall {result['wall_s']:.0f}s")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernel_bench_smoke.json" if args.smoke else "kernel_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")
    failed = [r for r in result["parity"] if not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
