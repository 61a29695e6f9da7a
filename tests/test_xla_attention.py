"""The "xla" attention backend (the CPU serving path) against the reference.

Same batches as the Pallas kernel tests (random normals, scattered pages,
random unused table entries, ragged and partial-page lengths, empty and
padding sequences), run through every way the backend can cut the work:
one row per item (in one block of pages, or by (row, page) pairs), several
rows per item with the step's decodes as one-row items beside them, and chunk
sizes that force the chunk loop with skipped all-padding chunks.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas import get_backend
from kernels_pallas.xla_attention import ragged_paged_attention_xla, rows_per_item
from test_kernels import MAX_SEQS, PAGES_PER_SEQ, assert_attention_close, mixes, random_mix, ragged_batch, \
    reference_attention

# (dtype, q_heads, kv_heads, page_size, head_dim)
CONFIGS = [
    pytest.param(jnp.float32, 4, 4, 8, 32, id="f32-g1-ps8"),
    pytest.param(jnp.float32, 6, 2, 16, 16, id="f32-g3-ps16"),
    pytest.param(jnp.bfloat16, 8, 2, 8, 32, id="bf16-g4-ps8"),
]
# (rows per item, chunk bytes, pages per block of a multi-row item or of a one-row item's pairs):
# None = what the backend picks for the shape. Chunk bytes 1 means one item (or, for one-row items,
# one (row, block) pair) per chunk, so results are merged across many chunks; the default chunk holds
# these small batches' one-row items in one block of pages. Blocks of 1 or 3 of the 4-page tables
# merge a softmax across blocks (3: the last block padded past the table, or a pair's last block
# re-reading the row's last page).
CUTS = [(None, None, None), (1, None, None), (1, 1, 3), (2, 1, 1), (4, None, None), (16, 1, 3)]


@pytest.mark.parametrize("dtype,hq,hkv,page_size,head_dim", CONFIGS)
def test_xla_attention_matches_reference(dtype, hq, hkv, page_size, head_dim):
    rng = np.random.RandomState(page_size * 100 + hq * 10 + hkv)
    num_pages = MAX_SEQS * PAGES_PER_SEQ + 5
    cases = dict(mixes(page_size), random=random_mix(rng, page_size), random2=random_mix(rng, page_size))
    batches = {name: ragged_batch(rng, seqs, page_size=page_size, num_pages=num_pages, num_q_heads=hq,
                                  num_kv_heads=hkv, head_dim=head_dim, dtype=dtype) for name, seqs in cases.items()}
    for rows, chunk_bytes, block_pages in CUTS:
        fast = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=head_dim**-0.5, rows=rows,
                                         chunk_bytes=chunk_bytes, block_pages=block_pages))
        for name, args in batches.items():
            out = fast(*args)
            ref = reference_attention(*args, sm_scale=head_dim**-0.5)
            try:
                assert_attention_close(out, ref, args[5], args[6], dtype)
            except AssertionError as e:
                raise AssertionError(f"rows={rows} chunk_bytes={chunk_bytes} block_pages={block_pages} mix {name!r} "
                                     f"{cases[name]}: {e}") \
                    from None


def test_rows_per_item_follows_the_bucket():
    assert rows_per_item(32, 32) == 1  # decode-only bucket: one row per item
    assert rows_per_item(64, 32) == 2
    assert rows_per_item(512, 32) == 16
    assert rows_per_item(4096, 8) == 16  # capped
    assert rows_per_item(3, 8) == 1


def test_auto_backend_is_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    assert get_backend("auto").name == "xla"
    assert get_backend("reference").name == "reference"


def test_auto_backend_on_gpu_takes_pallas_only_for_the_head_sizes_it_supports(monkeypatch):
    """Phi-3's head_dim 96 is not a Pallas head size: "auto" serves it with the xla backend on a GPU."""
    import kernels_pallas

    kernels_pallas._load_kernels()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert get_backend("auto", head_dim=128).name == "pallas"
    assert get_backend("auto", head_dim=96).name == "xla"
    assert get_backend("auto").name == "pallas"
    assert [d for d in (16, 32, 64, 96, 128, 256) if kernels_pallas.pallas_supports_head_dim(d)] == [16, 32, 64, 128,
                                                                                                   256]



def test_engine_greedy_output_is_the_same_with_xla_and_reference_backends():
    """Through the whole engine (chunked prefill mixed with decodes, several buckets),
    the xla backend and the reference produce identical greedy tokens."""
    import random

    from conftest import tiny_config
    from model.params import init_params
    from serving import LLM, SamplingParams

    cfg = tiny_config(num_layers=1)
    params = init_params(cfg, jax.random.key(7))
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (40, 3, 17, 1, 29, 8)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("reference", "xla"):
        # Token buckets 4, 8, 16 over 4 sequence slots: one, two and four rows per item.
        llm = LLM(config=cfg, params=params, max_num_seqs=4, max_num_batched_tokens=16, page_size=8, num_pages=32,
                  max_model_len=64, min_token_bucket=4, min_context_bucket=64, enable_prefix_caching=False,
                  attention_backend=backend)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert outs["xla"] == outs["reference"]
    assert all(len(t) == 12 for t in outs["xla"])


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_xla_attention_with_quantized_kv_matches_reference(kv_dtype):
    """int8 / fp8 pages with per-token scales: the backend applies the scales as the reference does."""
    from test_quant_kernels import mixes as quant_mixes, quantized_batch

    rng = np.random.RandomState(11)
    d, ps = 32, 8
    for rows, chunk_bytes, block_pages in ((None, None, None), (1, 1, None), (4, None, None), (4, None, 3)):
        fast = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=d**-0.5, rows=rows,
                                         chunk_bytes=chunk_bytes, block_pages=block_pages))
        for name, seqs in quant_mixes(ps).items():
            q, (k, v, ks, vs), meta = quantized_batch(rng, seqs, page_size=ps, num_q_heads=6, num_kv_heads=2,
                                                      head_dim=d, q_dtype=jnp.float32, kv_dtype=kv_dtype)
            want = np.asarray(jax.jit(functools.partial(reference_attention, sm_scale=d**-0.5))(
                q, k, v, *meta, k_scale=ks, v_scale=vs))
            got = np.asarray(fast(q, k, v, *meta, k_scale=ks, v_scale=vs))
            tol = 1e-5 * max(1.0, float(np.std(want)))
            np.testing.assert_allclose(got, want, atol=tol, rtol=1e-5, err_msg=f"rows={rows} block_pages={block_pages} mix {name}")
    with pytest.raises(ValueError, match="need their scales"):
        ragged_paged_attention_xla(q, k, v, *meta)
