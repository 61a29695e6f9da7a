"""Where a decode step's time goes on XLA CPU: its matrix products, attention, and the rest.

    python benchmarks/decode_step_parts.py [--rows 1,4,16,32] [--contexts 16,256] [--rounds 12]
        [--baseline_rev GIT_REV] [--out benchmarks/results/decode_step_parts_cpu.json]

Why: decode steps of 16-32 rows are most of the mixed workload's time in
`offline_throughput.py`, at a fifth to a third of their roof. That breakdown
says which step kinds fall short; this one takes one decode step of the
125M Llama shape (fp32, random weights) apart, to say what inside it does.

For each number of rows M and context length, in one process, timed in
alternation (`--rounds` times, best of each; each round starts with the next
contender, since the first program of a round was measured to run faster):

  * `matmuls`: `products_ceiling.products` on M tokens: every projection
    of every layer, the norms and the LM head with its argmax, jitted, with no
    attention over a cache and no K/V write: the step's weight-bound part;
  * `forward, no attention`: `model.forward` with the step's real inputs
    (one new token per row at position context - 1, pages of 16), its cache
    donated as the engine donates it, through a backend whose attention returns
    its queries and whose K/V write is the real one: everything of the step
    but attention;
  * `forward`: the same with the `xla` attention backend (the CPU default):
    the model's whole step, unrolled over layers;
  * `forward, scanned`: the same as one `lax.scan` over layers with a stacked
    cache and each layer's matrices picked by `lax.switch`
    (`model.layer_select`): what the engine runs on CPU (`layer_loop="auto"`).

With `--baseline_rev REV`, `forward, xla at REV` is the same unrolled step with
the `xla` attention as it was at that git revision, in the same rounds: a
before/after of an attention change inside the whole step.

Attention's part is `forward` - `forward, no attention`; the part beyond the
products is `forward, no attention` - `matmuls` (the K/V write, RoPE, the
residual adds, the layer outputs' copies). Sampling and the host are not
here: `offline_throughput.py` times them with the engine. The JSON records the
load average before and after (the machine is shared).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from attention_cpu_bench import baseline_attention, best_of_rotating_rounds  # noqa: E402
from kernels_pallas import AttentionBackend, register_backend  # noqa: E402
from kernels_pallas.reference import write_kv_reference  # noqa: E402
from model.cache import init_cache, pack_batch  # noqa: E402
from model.config import LlamaConfig  # noqa: E402
from model.forward import forward  # noqa: E402
from model.params import init_params  # noqa: E402
from offline_throughput import SHAPE_125M  # noqa: E402
from products_ceiling import products_jit  # noqa: E402

PAGE_SIZE = 16
MAX_ROWS = 32  # the step's S, as in offline_throughput's mixed engine (max_num_seqs 32)


def _queries_as_output(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **kwargs):
    """Attention that returns its queries: the shapes of attention's output, none of its work."""
    return q


register_backend("no_attention", lambda: AttentionBackend("no_attention", _queries_as_output, write_kv_reference,
                                                          quantized_kv=True))


def step_inputs(rows: int, context: int, pages_per_seq: int):
    """One decode step: `rows` sequences, each bringing one token at position context - 1."""
    num_pages = rows * pages_per_seq + 1
    chunks = [([7 + i], context - 1, list(range(i * pages_per_seq, (i + 1) * pages_per_seq))) for i in range(rows)]
    tokens, md = pack_batch(chunks, page_size=PAGE_SIZE, num_pages=num_pages, num_tokens=rows, max_seqs=MAX_ROWS,
                            pages_per_seq=pages_per_seq)
    return tokens, md, num_pages


def register_baseline(rev: str) -> str:
    """Registers the `xla` attention of git revision `rev` as a backend; returns its contender's name."""
    register_backend("xla_baseline", lambda: AttentionBackend("xla_baseline", baseline_attention(rev),
                                                              write_kv_reference, quantized_kv=True))
    return f"forward, xla at {rev}"


def contenders(cfg: LlamaConfig, params, rows: int, context: int, baseline: str | None = None):
    """name -> a function running the program once (inputs bound, cache threaded through); `baseline`:
    the name of a registered baseline's contender (`register_baseline`)."""
    pages_per_seq = max(1, -(-context // PAGE_SIZE))
    tokens, md, num_pages = step_inputs(rows, context, pages_per_seq)
    chain = products_jit
    chain_tokens = jnp.arange(7, 7 + rows, dtype=jnp.int32)
    runs = {"matmuls": lambda: chain(params, chain_tokens, eps=cfg.rms_norm_eps).block_until_ready()}

    def step(p, cache, t, m, backend):
        logits, cache = forward(p, cache, t, m, cfg, backend)
        return jnp.argmax(logits, axis=-1), cache

    jitted = jax.jit(step, static_argnames="backend", donate_argnums=1)
    programs = [("forward, no attention", "no_attention", False), ("forward", "xla", False),
                ("forward, scanned", "xla", True)]
    if baseline:
        programs.append((baseline, "xla_baseline", False))
    for name, backend, stacked in programs:
        state = {"cache": init_cache(cfg, num_pages, PAGE_SIZE, stacked=stacked)}

        def run(backend=backend, state=state):
            out, state["cache"] = jitted(params, state["cache"], tokens, md, backend=backend)
            out.block_until_ready()

        runs[name] = run
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--contexts", default="16,256")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--num_layers", type=int, default=None, help="fewer layers (a quick check of the script)")
    ap.add_argument("--baseline_rev", default=None,
                    help="also time the unrolled step with the xla attention of this git revision, same rounds")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode_step_parts_cpu.json"))
    args = ap.parse_args()
    shape = dict(SHAPE_125M)
    if args.num_layers:
        shape["num_layers"] = args.num_layers
    cfg = LlamaConfig(**shape)
    params = init_params(cfg, jax.random.key(0))
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "python benchmarks/decode_step_parts.py " + " ".join(sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                          "loadavg_before": os.getloadavg()},
              "shape": {k: v for k, v in shape.items() if k != "eos_token_ids"}, "rows": []}
    baseline = register_baseline(args.baseline_rev) if args.baseline_rev else None
    result["baseline_rev"] = args.baseline_rev
    names = ("matmuls", "forward, no attention", "forward", "forward, scanned") + ((baseline,) if baseline else ())
    print(f"{'rows':>4} {'context':>7} " + " ".join(f"{n:>21}" for n in names) + "   attention   beyond products"
          + ("   baseline's attention" if baseline else ""))
    for context in [int(c) for c in args.contexts.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            runs = contenders(cfg, params, rows, context, baseline)
            for run in runs.values():  # compile, then one warm run each
                run()
                run()
            best = best_of_rotating_rounds(runs, args.rounds)
            ms = {name: best[name] * 1e3 for name in names}
            attention = ms["forward"] - ms["forward, no attention"]
            beyond = ms["forward, no attention"] - ms["matmuls"]
            row = {"rows": rows, "context": context, "ms": ms, "attention_ms": attention, "beyond_products_ms": beyond}
            line = (f"{rows:>4} {context:>7} " + " ".join(f"{ms[n]:>18.1f} ms" for n in names)
                    + f" {attention:>8.1f} ms {beyond:>12.1f} ms")
            if baseline:
                row["baseline_attention_ms"] = ms[baseline] - ms["forward, no attention"]
                row["forward_vs_baseline"] = ms[baseline] / ms["forward"]
                line += f" {row['baseline_attention_ms']:>15.1f} ms (step x{row['forward_vs_baseline']:.3f})"
            result["rows"].append(row)
            print(line, flush=True)
    result["machine"]["loadavg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
