"""Offline throughput of `LLM.generate` against transformers' `generate`, same weights, same run.

    python benchmarks/offline_throughput.py [--out benchmarks/results/offline_throughput.json] [--quick]

Model: a Llama shape of ~125M parameters (vocab 32000, hidden 768, 12 layers,
12 heads, 4 KV heads, intermediate 2048) with random fp32 weights; the
transformers model is built from the very same arrays (and checked against
ours on one prompt).

Sections, all in one process:
  1. read bandwidth of this machine (a jitted sum over a 512 MiB fp32 array) and
     its fp32 matmul rate (the best of jitted products of the model's own
     projection shapes at 512 rows);
  2. mixed workload: 32 requests, prompt lengths uniform in 16-256 and output
     lengths uniform in 16-256 (seeded), greedy with ignore_eos. Ridgeline runs
     them through continuous batching (after one untimed run that compiles the
     shapes the workload uses); transformers runs its best static setup,
     trying one batch of 32 and batches of 8 sorted by length. Only the tokens
     each request needed count. The contenders alternate for `--rounds`
     rounds and each keeps its best time. Prints both and the ratio;
  3. batch-1 decode: tokens/s and bandwidth utilization = weight bytes read
     per step x steps/s / the measured read bandwidth (ridgeline, transformers,
     and a plain jitted chain of the same weights' matrix-vector products with
     no attention, KV cache or sampling: the ceiling jitted JAX reaches here);
     Then a breakdown of where the time went (`step_breakdown`, from the
     steps of the one-step-at-a-time engine, whose step times are their own):
     per step kind (prefill, mixed, decode by token bucket) its time against
     its own roof (useful FLOPs at the same-run matmul rate or the bytes it
     must read at the read bandwidth), padded tokens, masked-off attention
     positions, attention's share of the FLOPs, host time, and the tail
     (steps with at most a quarter of the requests running);
  4. host time per step (scheduling, packing, output processing: everything
     but waiting for the jitted step) at 1, 32, 64 and 256 running sequences
     in steady decode, as a fraction of the whole step, with overlapped
     scheduling on (the default: the host prepares step t+1 while step t
     runs) and off (one step at a time), and the step time of each.

`--peer_decode_bucket_step` / `--peer_attention_rev` add a second ridgeline
engine to the mixed section (another decode bucket step, or the xla attention
backend of an earlier git revision), alternating with the default one, with
the same-run ratios: a before/after of an engine change on one machine state.

`--quick` (2 layers, vocab 4096, 8 requests of 16-64 tokens, one round) checks
that every section runs, in a few minutes on a quiet machine.

CPU numbers on a shared machine are noisy: the JSON records the load average
before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model.cache import init_cache, pack_batch  # noqa: E402
from model.config import LlamaConfig  # noqa: E402
from model.families import num_params  # noqa: E402
from model.forward import forward_jit  # noqa: E402
from kernels_pallas import AttentionBackend, get_backend, register_backend  # noqa: E402
from kernels_pallas.reference import write_kv_reference  # noqa: E402
from model.params import init_params, param_bytes  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from kernels_pallas.xla_attention import ITEM_BLOCK_PAGES, PAIR_PAGES, rows_per_item  # noqa: E402
from products_ceiling import products_jit, schedule_products  # noqa: E402
from step_breakdown import ModelCosts, breakdown, format_table  # noqa: E402

SHAPE_125M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                  num_kv_heads=4, head_dim=64, rope_theta=10000.0, dtype="float32", max_position_embeddings=2048,
                  bos_token_id=1, eos_token_ids=(2,))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_bandwidth(mib: int = 512, repeats: int = 20) -> float:
    """Bytes/s this machine reads from memory under jitted JAX: the best of a full
    reduction and a matrix-vector product (a decode step's access pattern) over a
    large fp32 array, best of several runs each."""
    n = mib * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    m = x.reshape(-1, 1024)
    v = jnp.ones((1024,), jnp.float32)
    best = float("inf")
    for f, args in ((jax.jit(jnp.sum), (x,)), (jax.jit(lambda a, b: a @ b), (m, v))):
        f(*args).block_until_ready()
        for _ in range(repeats):
            t = time.perf_counter()
            f(*args).block_until_ready()
            best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def matmul_rate(cfg: LlamaConfig, rows: int = 512, repeats: int = 10) -> float:
    """FLOP/s of this machine's fp32 matrix products under jitted JAX: the best over the model's own
    projection shapes (hidden -> intermediate, intermediate -> hidden, hidden -> hidden) at `rows`
    rows, best of several runs each: the compute roof the steps are held against."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    mm = jax.jit(lambda a, b: jnp.einsum("te,fe->tf", a, b))
    best = 0.0
    for k, n in ((e, f), (f, e), (e, e)):
        a, b = jnp.ones((rows, k), jnp.float32), jnp.ones((n, k), jnp.float32)
        mm(a, b).block_until_ready()
        t_best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            mm(a, b).block_until_ready()
            t_best = min(t_best, time.perf_counter() - t)
        best = max(best, 2 * rows * k * n / t_best)
    return best


def decode_weight_bytes(cfg: LlamaConfig, params) -> int:
    """Weight bytes one decode step reads: everything but the embedding table (one row of it)."""
    row = cfg.hidden_size * params.embed.dtype.itemsize
    return param_bytes(params) - params.embed.nbytes + row


def workload(n: int, seed: int, vocab: int, lo: int = 16, hi: int = 256):
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        plen, olen = rng.randint(lo, hi), rng.randint(lo, hi)
        jobs.append(([1] + [rng.randrange(3, vocab) for _ in range(plen - 1)], olen))
    return jobs


def plain_decode_step_seconds(cfg, params, steps: int) -> float:
    f = products_jit
    token = jnp.array([5], jnp.int32)
    np.asarray(f(params, token, eps=cfg.rms_norm_eps))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        token = jnp.asarray(np.asarray(f(params, token, eps=cfg.rms_norm_eps)))  # one host sync per token
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# --- transformers ---------------------------------------------------------------------------------

def hf_model_from(cfg: LlamaConfig, params):
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=cfg.bos_token_id, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    e = cfg.hidden_size
    t = lambda a: torch.from_numpy(np.array(a, np.float32, order="C"))  # a writable copy for torch
    # Both store linear weights [out, in]: only the head dims are merged back.
    sd = {"model.embed_tokens.weight": t(params.embed), "model.norm.weight": t(params.final_norm),
          "lm_head.weight": t(params.lm_head)}
    for i, L in enumerate(params.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(L.attn_norm)
        sd[p + "post_attention_layernorm.weight"] = t(L.mlp_norm)
        sd[p + "self_attn.q_proj.weight"] = t(np.asarray(L.wq).reshape(-1, e))
        sd[p + "self_attn.k_proj.weight"] = t(np.asarray(L.wk).reshape(-1, e))
        sd[p + "self_attn.v_proj.weight"] = t(np.asarray(L.wv).reshape(-1, e))
        sd[p + "self_attn.o_proj.weight"] = t(np.asarray(L.wo).reshape(e, -1))
        sd[p + "mlp.gate_proj.weight"] = t(L.w_gate)
        sd[p + "mlp.up_proj.weight"] = t(L.w_up)
        sd[p + "mlp.down_proj.weight"] = t(L.w_down)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def logits_gap(cfg, params, hf, prompt) -> float:
    """Max |ours - transformers| over the prompt's logits: proof both run the same weights."""
    import torch

    n, ps = len(prompt), 16
    pages = -(-n // ps)
    toks, md = pack_batch([(prompt, 0, list(range(pages)))], page_size=ps, num_pages=pages, num_tokens=n,
                          max_seqs=1, pages_per_seq=pages, all_logits=True)
    ours, _ = forward_jit(params, init_cache(cfg, pages, ps), toks, md, cfg=cfg, backend="reference")
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].numpy()
    return float(np.abs(np.asarray(ours) - theirs).max())


def hf_generate(hf, batch):
    """Greedy, left-padded static batch; every row runs to the batch's longest output."""
    import torch

    width = max(len(p) for p, _ in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    new = max(o for _, o in batch)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False)
    assert out.shape[1] == width + new
    return out[:, width:]


def hf_run(hf, jobs, batch_size, sort):
    order = sorted(jobs, key=lambda j: len(j[0]) + j[1]) if sort else list(jobs)
    t = time.perf_counter()
    for i in range(0, len(order), batch_size):
        hf_generate(hf, order[i:i + batch_size])
    return time.perf_counter() - t


# --- ridgeline ------------------------------------------------------------------------------------

def ridgeline_run(llm, jobs, cpu_seconds=None):
    """Runs `jobs` through `llm`; (wall seconds, outputs, the steps' stats). `cpu_seconds`: a list the
    process's CPU time over the call is appended to (steadier than wall time on a loaded machine)."""
    sps = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in jobs]
    llm.engine.stats_log.drain()
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in jobs], sps)
    wall = time.perf_counter() - t
    if cpu_seconds is not None:
        cpu_seconds.append(time.process_time() - c)
    assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in jobs]
    return wall, outs, llm.engine.stats_log.drain()


def decode_padding(steps) -> dict:
    """Padding of the decode-only steps (one token per scheduled sequence): the share of their computed
    tokens (the bucket's T) that were padding, and how many steps ran in each token bucket."""
    dec = [s for s in steps if s.bucket is not None and s.num_tokens == s.num_seqs]
    computed = sum(s.bucket[0] for s in dec)
    per_bucket = {}
    for s in dec:
        per_bucket[s.bucket[0]] = per_bucket.get(s.bucket[0], 0) + 1
    return {"decode_steps": len(dec), "pad_token_share": 1 - sum(s.num_tokens for s in dec) / max(1, computed),
            "steps_per_token_bucket": dict(sorted(per_bucket.items()))}


def steady_decode(llm, n, prompt_len=16, max_tokens=24, seed=0):
    """Host and device time of decode steps with exactly n running sequences."""
    jobs = [(p, max_tokens) for p, _ in workload(n, seed, llm.config.vocab_size, prompt_len, prompt_len)]
    ridgeline_run(llm, jobs)  # compile what this batch size uses
    _, _, steps = ridgeline_run(llm, jobs)
    dec = [s for s in steps if s.num_seqs == n and s.num_tokens == n]
    host = statistics.median(s.host_seconds for s in dec)
    step = statistics.median(s.host_seconds + s.device_seconds for s in dec)
    return {"running_sequences": n, "decode_steps": len(dec), "host_ms_per_step": host * 1e3,
            "step_ms": step * 1e3, "host_fraction": host / step}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "offline_throughput.json"))
    ap.add_argument("--quick", action="store_true",
                    help="8 requests of 16-64 tokens, 2 layers, vocab 4096, one round: checks every section runs")
    ap.add_argument("--num_requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="alternating timed runs per contender; best counts")
    ap.add_argument("--skip_transformers", action="store_true",
                    help="ridgeline alone in the mixed and batch-1 sections (no ratios): the breakdown on a busy machine")
    ap.add_argument("--peer_decode_bucket_step", type=int, default=None,
                    help="mixed section: also time an engine with this decode_bucket_step (0: powers of two "
                         "only), alternating with the default one every round, and print the same-run ratios")
    ap.add_argument("--peer_attention_rev", default=None,
                    help="mixed section: the peer engine (as --peer_decode_bucket_step; both may be given) runs the "
                         "xla attention backend as it was at this git revision: a before/after of a change to it")
    ap.add_argument("--sections", default="mixed,batch1,host",
                    help="comma-separated subset of mixed, batch1, host (the JSON marks the others skipped)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))

    shape = dict(SHAPE_125M)
    n_req = args.num_requests
    lengths = (16, 256)
    if args.quick:
        shape.update(num_layers=2, vocab_size=4096)
        n_req = min(n_req, 8)
        lengths = (16, 64)
        args.rounds = 1
    cfg = LlamaConfig(**shape)
    load_before = os.getloadavg()
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "python benchmarks/offline_throughput.py " + " ".join(sys.argv[1:]), "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
        "device": str(jax.devices()[0]), "loadavg_before": load_before,
        "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "attention_backend": get_backend("auto").name}
    import torch
    import transformers
    result["machine"].update(torch=torch.__version__, transformers=transformers.__version__,
                             torch_threads=torch.get_num_threads())

    log(f"model: {num_params(cfg) / 1e6:.1f}M params, fp32")
    params = init_params(cfg, jax.random.key(0))
    result["model"] = {"shape": {k: v for k, v in shape.items() if k not in ("eos_token_ids",)},
                       "params_millions": num_params(cfg) / 1e6, "param_bytes": param_bytes(params)}

    bw_mib = 128 if args.quick else 512
    bw = read_bandwidth(bw_mib)
    log(f"measured read bandwidth: {bw / 1e9:.2f} GB/s (measured again before the batch-1 section; the max is used)")
    mm_rate = matmul_rate(cfg)
    result["matmul_GFLOPs"] = mm_rate / 1e9
    log(f"measured fp32 matmul rate: {mm_rate / 1e9:.1f} GFLOP/s (512-row products of the model's projections)")

    hf = None
    if not args.skip_transformers:
        hf = hf_model_from(cfg, params)
        gap = logits_gap(cfg, params, hf, [1] + list(range(100, 131)))
        log(f"same weights: max |logit difference| ours vs transformers = {gap:.2e}")
        result["logits_max_abs_diff_vs_transformers"] = gap

    # --- 2. mixed workload -------------------------------------------------------------------
    jobs = workload(n_req, 1234, cfg.vocab_size, *lengths)
    useful = sum(o for _, o in jobs)
    # Every engine of this section: every shape the workload reaches compiles exactly (in the untimed run).
    mixed_engine = dict(config=cfg, params=params, max_num_seqs=n_req, max_num_batched_tokens=512, page_size=16,
                        num_pages=n_req * 512 // 16, max_model_len=512, enable_prefix_caching=False, warmup=False)
    llm = LLM(**mixed_engine)
    if "mixed" in sections:
        t = time.perf_counter()
        _, ours_outs, _ = ridgeline_run(llm, jobs)
        log(f"ridgeline: untimed first run (compiles the shapes it uses) {time.perf_counter() - t:.1f}s")
        # Contenders alternate, `--rounds` times, and each keeps its best time: on a shared machine
        # that is the fairest estimate of what each can do (load comes and goes during a run).
        configs = (("one_batch_of_%d" % n_req, n_req, False), ("batches_of_8_sorted", 8, True))
        if args.skip_transformers:
            configs = ()
        ours_times, hf_times, steps = [], {name: [] for name, _, _ in configs}, None
        one_at_a_time = LLM(**mixed_engine, async_scheduling=False)
        sync_times, sync_steps = [], None
        ours_cpu, peer, peer_times, peer_cpu, peer_steps = [], None, [], [], None
        peer_options, described = {}, []
        if args.peer_decode_bucket_step is not None:
            peer_options["decode_bucket_step"] = args.peer_decode_bucket_step
            described.append(f"decode_bucket_step={args.peer_decode_bucket_step}")
        if args.peer_attention_rev:
            from attention_cpu_bench import baseline_attention

            backend = f"xla@{args.peer_attention_rev}"
            fn = baseline_attention(args.peer_attention_rev)
            register_backend(backend, lambda: AttentionBackend(backend, fn, write_kv_reference, quantized_kv=True))
            peer_options["attention_backend"] = backend
            described.append(f"xla attention at {args.peer_attention_rev}")
        peer_name = f"peer ({', '.join(described)})"
        if peer_options:
            peer = LLM(**mixed_engine, **peer_options)
            t = time.perf_counter()
            _, peer_outs, _ = ridgeline_run(peer, jobs)
            same = [o.outputs[0].token_ids for o in peer_outs] == [o.outputs[0].token_ids for o in ours_outs]
            log(f"{peer_name}: untimed first run {time.perf_counter() - t:.1f}s; same greedy tokens as ours: {same}")
        for r in range(args.rounds):
            # With a peer, the order within a round alternates, so neither always runs first.
            order = [("ours", llm), ("peer", peer)] if peer is not None else [("ours", llm)]
            for who, engine in (order if r % 2 == 0 else order[::-1]):
                times, cpus = (ours_times, ours_cpu) if who == "ours" else (peer_times, peer_cpu)
                wall, _, round_steps = ridgeline_run(engine, jobs, cpus)
                if who == "ours" and (not ours_times or wall < min(ours_times)):
                    steps = round_steps
                if who == "peer" and (not peer_times or wall < min(peer_times)):
                    peer_steps = round_steps
                times.append(wall)
                name = "ridgeline" if who == "ours" else peer_name
                log(f"round {r}: {name} {useful} tokens in {wall:.1f}s (CPU {cpus[-1]:.1f}s) = "
                    f"{useful / wall:.1f} output tok/s over {len(round_steps)} steps")
            sync_wall, _, round_sync_steps = ridgeline_run(one_at_a_time, jobs)
            if not sync_times or sync_wall < min(sync_times):
                sync_steps = round_sync_steps
            sync_times.append(sync_wall)
            log(f"round {r}: ridgeline one step at a time: {sync_times[-1]:.1f}s = "
                f"{useful / sync_times[-1]:.1f} output tok/s")
            for name, bs, sort in configs:
                w = hf_run(hf, jobs, bs, sort)
                hf_times[name].append(w)
                log(f"round {r}: transformers {name}: {w:.1f}s = {useful / w:.1f} useful tok/s")
        wall = min(ours_times)
        ours_tps = useful / wall
        hf_runs = {name: {"seconds": min(ts), "seconds_all_rounds": ts, "useful_output_tok_per_s": useful / min(ts)}
                   for name, ts in hf_times.items()}
        best = max(hf_runs, key=lambda k: hf_runs[k]["useful_output_tok_per_s"]) if hf_runs else None
        ratio = ours_tps / hf_runs[best]["useful_output_tok_per_s"] if hf_runs else None
        if hf_runs:
            log(f"mixed workload (best of {args.rounds}): ridgeline {ours_tps:.1f} vs transformers ({best}) "
                f"{hf_runs[best]['useful_output_tok_per_s']:.1f} useful tok/s -> ratio {ratio:.2f}x (target >= 2.5x)")
        else:
            log(f"mixed workload (best of {args.rounds}): ridgeline {ours_tps:.1f} useful tok/s (transformers skipped)")
        host = sum(s.host_seconds for s in steps)
        result["mixed_workload"] = {
            "requests": n_req, "prompt_tokens": sum(len(p) for p, _ in jobs), "useful_output_tokens": useful,
            "rounds": args.rounds,
            "ridgeline": {"seconds": wall, "seconds_all_rounds": ours_times, "output_tok_per_s": ours_tps,
                          "steps": len(steps), "host_seconds": host, "host_fraction_of_wall": host / wall,
                          "max_num_batched_tokens": 512, "page_size": 16},
            "ridgeline_one_step_at_a_time": {"seconds": min(sync_times), "seconds_all_rounds": sync_times,
                                             "output_tok_per_s": useful / min(sync_times)},
            "transformers": hf_runs, "transformers_best": best, "ratio_vs_best_transformers": ratio}
        ours_pad = decode_padding(steps)
        result["mixed_workload"]["ridgeline"].update(
            cpu_seconds_all_rounds=ours_cpu, decode_bucket_step=llm.engine.config.decode_bucket_step,
            decode_padding=ours_pad)
        log(f"decode-only steps (decode_bucket_step={llm.engine.config.decode_bucket_step}): "
            f"{100 * ours_pad['pad_token_share']:.1f}% of their tokens padding")
        if peer is not None:
            pad = decode_padding(peer_steps)
            result["mixed_workload"]["peer"] = {
                **peer_options, "same_greedy_tokens": same, "seconds": min(peer_times),
                "seconds_all_rounds": peer_times, "cpu_seconds_all_rounds": peer_cpu,
                "output_tok_per_s": useful / min(peer_times), "steps": len(peer_steps), "decode_padding": pad,
                "ours_vs_peer_best_wall": min(peer_times) / wall,
                "ours_vs_peer_median_cpu": statistics.median(peer_cpu) / statistics.median(ours_cpu)}
            log(f"{peer_name}: {100 * pad['pad_token_share']:.1f}% of "
                f"decode tokens padding; ours vs peer: best wall x{min(peer_times) / wall:.3f}, median CPU "
                f"x{statistics.median(peer_cpu) / statistics.median(ours_cpu):.3f} (>1: ours faster)")

        # Where the time went: the one-step-at-a-time engine's steps, whose device times are their own.
        costs = ModelCosts.of(cfg, params)
        table = breakdown(sync_steps, costs, page_size=16, matmul_rate=mm_rate, read_bw=bw,
                          rows_per_item=rows_per_item, tail_seqs=max(1, n_req // 4),
                          item_block_pages=ITEM_BLOCK_PAGES, pair_pages=PAIR_PAGES)
        log("breakdown of the one-step-at-a-time run (roof: useful FLOPs at the matmul rate or bytes at the "
            "read bandwidth, whichever is longer; pad tok: padded share of computed tokens; pad kv: masked-off "
            "share of attention's computed query-key positions; attn: attention's share of computed FLOPs; "
            f"tail: steps with <= {max(1, n_req // 4)} running):\n" + format_table(table))
        frac = table["total"]["useful_flop_rate_fraction_of_matmul_rate"]
        overlapped_frac = frac * table["total"]["seconds"] / wall
        log(f"useful FLOPs over the run: {frac:.2f} of the matmul rate one step at a time, {overlapped_frac:.2f} "
            "overlapped (target >= 0.5)")
        result["mixed_workload"]["breakdown_one_step_at_a_time"] = {"model_costs": dataclasses.asdict(costs), **table}
        result["mixed_workload"]["useful_flops_fraction_of_matmul_rate"] = {
            "overlapped": overlapped_frac, "one_step_at_a_time": frac}

        # The same steps as nothing but their products: the most a run of this schedule could gain
        # from attention, sampling and the host, with XLA's products and with torch's.
        ceiling = schedule_products(sync_steps, params, cfg.rms_norm_eps, hf, rounds=args.rounds + 1)
        useful_flops = table["total"]["useful_GFLOP"] * 1e9
        ceiling["useful_flops_fraction_of_matmul_rate"] = useful_flops / ceiling["xla_seconds"] / mm_rate
        msg = (f"the products alone of those {table['total']['steps']} steps, at their buckets: XLA "
               f"{ceiling['xla_seconds']:.1f}s")
        if hf_runs:
            ceiling["ratio_vs_best_transformers"] = hf_runs[best]["seconds"] / ceiling["xla_seconds"]
            ceiling["torch_ratio_vs_best_transformers"] = hf_runs[best]["seconds"] / ceiling["torch_seconds"]
            msg += (f", torch through transformers' modules {ceiling['torch_seconds']:.1f}s. A run that cost only "
                    f"its products would be {ceiling['ratio_vs_best_transformers']:.2f}x transformers with XLA's, "
                    f"{ceiling['torch_ratio_vs_best_transformers']:.2f}x with torch's (target >= 2.5x)")
        log(msg + f"; useful FLOPs at XLA's products alone: {ceiling['useful_flops_fraction_of_matmul_rate']:.2f} "
            "of the matmul rate (target >= 0.5)")
        result["mixed_workload"]["products_only"] = ceiling
    else:
        result["mixed_workload"] = {"skipped": "not in --sections"}

    # --- 3. batch-1 decode -------------------------------------------------------------------
    if "batch1" in sections:
        # The machine is shared: a second bandwidth measurement, and the better of the two is the ceiling.
        bw2 = read_bandwidth(bw_mib)
        result["read_bandwidth_GBps_samples"] = [bw / 1e9, bw2 / 1e9]
        bw = max(bw, bw2)
        result["read_bandwidth_GBps"] = bw / 1e9
        log(f"read bandwidth again: {bw2 / 1e9:.2f} GB/s; using {bw / 1e9:.2f} GB/s")
        n_dec = 64 if args.quick else 256
        one = [([1] + list(range(500, 515)), n_dec)]
        ridgeline_run(llm, one)
        wbytes = decode_weight_bytes(cfg, params)
        import torch

        step_s = hf_step = plain_step = float("inf")
        with torch.no_grad():
            ids = torch.tensor([one[0][0]])
            if hf is not None:
                hf.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            for _ in range(args.rounds):
                _, _, steps = ridgeline_run(llm, one)
                dec = [s for s in steps if s.num_tokens == 1]
                step_s = min(step_s, statistics.median(s.host_seconds + s.device_seconds for s in dec))
                plain_step = min(plain_step, plain_decode_step_seconds(cfg, params, n_dec // 4))
                if hf is None:
                    continue
                t = time.perf_counter()
                hf.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
                prefill = time.perf_counter() - t
                t = time.perf_counter()
                hf.generate(input_ids=ids, max_new_tokens=n_dec, min_new_tokens=n_dec, do_sample=False)
                hf_step = min(hf_step, (time.perf_counter() - t - prefill) / (n_dec - 1))
        ours_bw = wbytes / step_s
        result["batch1_decode"] = {
            "weight_bytes_per_step": wbytes, "decode_tokens": n_dec,
            "ridgeline": {"tok_per_s": 1 / step_s, "ms_per_step": step_s * 1e3,
                          "bandwidth_utilization": ours_bw / bw},
            "transformers": {"tok_per_s": 1 / hf_step, "ms_per_step": hf_step * 1e3,
                             "bandwidth_utilization": wbytes / hf_step / bw} if hf is not None else "skipped",
            "plain_jitted_matvec_chain": {"tok_per_s": 1 / plain_step, "ms_per_step": plain_step * 1e3,
                                          "bandwidth_utilization": wbytes / plain_step / bw},
            "ridgeline_over_plain_chain": plain_step / step_s}
        theirs = "" if hf is None else f"transformers {1 / hf_step:.1f} tok/s ({wbytes / hf_step / bw:.2f}), "
        log(f"batch-1 decode: ridgeline {1 / step_s:.1f} tok/s ({ours_bw / bw:.2f} of read bandwidth), {theirs}"
            f"plain jitted chain {1 / plain_step:.1f} tok/s ({wbytes / plain_step / bw:.2f}) (target >= 0.7)")
        del hf

    # --- 4. host overhead --------------------------------------------------------------------
    if "host" in sections:
        sizes = (1, 8, 32) if args.quick else (1, 32, 64, 256)
        engines = {mode: LLM(config=cfg, params=params, max_num_seqs=sizes[-1],
                             max_num_batched_tokens=max(512, sizes[-1]), page_size=16,
                             num_pages=sizes[-1] * 3 + 16, max_model_len=48, enable_prefix_caching=False,
                             async_scheduling=mode == "overlapped", warmup=False)
                   for mode in ("overlapped", "one_step_at_a_time")}
        overhead = []
        for n in sizes:
            r = {}
            for _ in range(args.rounds):  # alternate the modes; each keeps its fastest round
                for mode, llm_ in engines.items():
                    m = steady_decode(llm_, n)
                    if mode not in r or m["step_ms"] < r[mode]["step_ms"]:
                        r[mode] = m
            r = {"running_sequences": n, **r["overlapped"], "one_step_at_a_time": r["one_step_at_a_time"],
                 "step_time_ratio_overlapped_vs_one_at_a_time":
                     r["overlapped"]["step_ms"] / r["one_step_at_a_time"]["step_ms"]}
            overhead.append(r)
            off = r["one_step_at_a_time"]
            log(f"host time at {n} running: {r['host_ms_per_step']:.2f} ms of a {r['step_ms']:.1f} ms step "
                f"({100 * r['host_fraction']:.1f}%, target < 5%); one step at a time: {off['host_ms_per_step']:.2f} "
                f"ms of {off['step_ms']:.1f} ms -> step time x{r['step_time_ratio_overlapped_vs_one_at_a_time']:.3f}")
        result["host_overhead"] = overhead
    result["machine"]["loadavg_after"] = os.getloadavg()

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
