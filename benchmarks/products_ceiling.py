"""What a run's steps would cost if each were nothing but its matrix products.

`offline_throughput.py` compares the engine with transformers and breaks its
steps down against their roofs. The roofs come from a 512-row product and a
streaming read, which say nothing of what a product of 8 or 32 rows can do on
this machine. This module answers the question the steady-state targets hinge
on: take the steps a run actually made (their buckets: T tokens computed, S
rows sampled), and time, for each bucket, the products alone -- every
projection of every layer on T rows, the norms, the LM head on S rows and its
argmax, no attention, no K/V cache, no sampling, no host -- with two
libraries:

  * XLA (`products`, jitted as `products_jit`, which is also batch-1
    decode's plain chain in `offline_throughput.py`): what this stack's
    products cost, so the sum over the steps is what a run of that schedule
    would take if everything else were free;
  * torch, through the transformers model's own modules (`torch_products`):
    the peer's products on the same weights, which says whether a better
    matrix library would move that figure.

Each bucket's programs run in rotating rounds (`best_of_rotating_rounds`),
best of `rounds`, so both libraries see the same machine.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from attention_cpu_bench import best_of_rotating_rounds
from model.layers import head_projection, output_projection, rms_norm


def products(params, tokens, eps, head_rows: int | None = None, argmax: bool = True):
    """`tokens` [T] through every weight as plain jitted products (a stand-in for attention that
    keeps its shapes), then the LM head and its argmax (the logits with `argmax=False`) on
    `head_rows` rows (default T; rows past T repeat the last, as a step's padded sample rows do)."""
    x = params.embed[tokens]
    for L in params.layers:
        h = rms_norm(x, L.attn_norm, eps)
        q = head_projection(h, L.wq)
        kv = head_projection(h, L.wk) + head_projection(h, L.wv)
        o = q + jnp.repeat(kv, q.shape[1] // kv.shape[1], axis=1)  # stands in for attention
        x = x + output_projection(o, L.wo)
        h = rms_norm(x, L.mlp_norm, eps)
        gate, up = jnp.einsum("te,fe->tf", h, L.w_gate), jnp.einsum("te,fe->tf", h, L.w_up)
        x = x + jnp.einsum("tf,ef->te", jax.nn.silu(gate) * up, L.w_down)
    if head_rows is not None:
        x = x[jnp.minimum(jnp.arange(head_rows), x.shape[0] - 1)]
    logits = jnp.einsum("te,ve->tv", rms_norm(x, params.final_norm, eps), params.lm_head)
    return jnp.argmax(logits, axis=-1) if argmax else logits


products_jit = jax.jit(products, static_argnames=("eps", "head_rows", "argmax"))


def torch_products(hf, tokens, head_rows: int, argmax: bool = True):
    """The same chain through a transformers Llama's own modules (torch, no grad)."""
    import torch

    with torch.no_grad():
        x = hf.model.embed_tokens(tokens)
        for layer in hf.model.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h)
            kv = a.k_proj(h) + a.v_proj(h)
            group = q.shape[-1] // kv.shape[-1]
            head_dim = a.head_dim
            kv = kv.view(-1, kv.shape[-1] // head_dim, head_dim).repeat_interleave(group, dim=1)
            x = x + a.o_proj(q + kv.reshape(q.shape))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        rows = torch.clamp(torch.arange(head_rows), max=x.shape[0] - 1)
        logits = hf.lm_head(hf.model.norm(x[rows]))
        return torch.argmax(logits, dim=-1) if argmax else logits


def schedule_products(steps, params, eps: float, hf=None, rounds: int = 3) -> dict:
    """For the steps that computed something (`IterationStats` with a bucket): each bucket's products
    timed with XLA (and with torch through `hf`, when given), and their sums over the steps."""
    counts = collections.Counter(s.bucket[:2] for s in steps if s.bucket is not None and s.num_tokens > 0)
    if hf is not None:
        import torch
    runs = {}
    for T, S in counts:
        tokens = jnp.arange(7, 7 + T, dtype=jnp.int32)
        runs[("xla", T, S)] = lambda t=tokens, s=S: products_jit(params, t, eps=eps, head_rows=s).block_until_ready()
        if hf is not None:
            torch_tokens = torch.arange(7, 7 + T)
            runs[("torch", T, S)] = lambda t=torch_tokens, s=S: torch_products(hf, t, s)
    for run in runs.values():  # compile, then one warm run each
        run()
        run()
    if hf is not None:  # the same chain in both: the same logits, for the first bucket
        T, S = next(iter(counts))
        ours = np.asarray(products_jit(params, jnp.arange(7, 7 + T, dtype=jnp.int32), eps=eps, head_rows=S, argmax=False))
        theirs = torch_products(hf, torch.arange(7, 7 + T), S, argmax=False).numpy()
        np.testing.assert_allclose(theirs, ours, rtol=1e-3, atol=1e-3 * float(np.abs(ours).max()))
    best = best_of_rotating_rounds(runs, rounds)
    buckets = [{"tokens": T, "rows": S, "steps": n,
                **{f"{lib}_ms": 1e3 * best[(lib, T, S)] for lib in ("xla", "torch") if (lib, T, S) in best}}
               for (T, S), n in sorted(counts.items())]
    out = {"buckets": buckets, "rounds": rounds,
           "xla_seconds": sum(n * best[("xla", T, S)] for (T, S), n in counts.items())}
    if hf is not None:
        out["torch_seconds"] = sum(n * best[("torch", T, S)] for (T, S), n in counts.items())
    return out
