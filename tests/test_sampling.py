"""Sampling parameters, the on-device sampler, and incremental detokenization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.tokenizer import ByteTokenizer
from serving.core.detokenizer import ByteDetokenizer, WindowDetokenizer
from serving.core.output_processor import _find_stop
from serving.core.sampler import SamplingInputs, sample
from serving.core.sampling_params import InvalidParameterError, SamplingParams


# --- parameters -----------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0), ("logprobs", 21), ("logprobs", -1),
    ("prompt_logprobs", 100), ("seed", "abc"), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("stop_token_ids", [1000]), ("ignore_eos", "yes"),
])
def test_invalid_parameter_names_the_field(field, value):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**{field: value}).validate(vocab_size=100)
    assert e.value.param == field
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_defaults_are_vllms_and_valid():
    p = SamplingParams().validate(vocab_size=100)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.ignore_eos
    assert SamplingParams(stop="x").stop == ["x"]
    SamplingParams(top_k=-1, temperature=0, max_tokens=None).validate()


# --- the sampler --------------------------------------------------------------------------------

V = 50
R = 1024  # every sampler call uses this many rows, so it compiles once


def inputs(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, sample_index=0, token_index=None,
           target=-1, want_logprobs=False):
    full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (rows,))
    t = full(temperature, jnp.float32)
    k = full(top_k, jnp.int32)
    p = full(top_p, jnp.float32)
    seeds = np.broadcast_to(np.asarray(seed, np.uint64), (rows,))
    kd = np.stack([(seeds >> 32).astype(np.uint32), (seeds & 0xFFFFFFFF).astype(np.uint32)], -1)
    ti = jnp.arange(rows, dtype=jnp.int32) if token_index is None else full(token_index, jnp.int32)
    return SamplingInputs(t, k, p, full(min_p, jnp.float32), jnp.asarray(kd), full(sample_index, jnp.int32), ti,
                          full(target, jnp.int32), jnp.any(t > 0), jnp.any((k > 0) | (p < 1)),
                          jnp.asarray(want_logprobs))


def random_logits(rows, seed=0):
    return jax.random.normal(jax.random.key(seed), (rows, V)) * 2.0


sample_jit = jax.jit(sample)


def test_greedy_is_argmax():
    logits = random_logits(R)
    ids, _ = sample_jit(logits, inputs(R, temperature=0.0))
    np.testing.assert_array_equal(ids, np.argmax(logits, -1))


def test_temperature_sampling_follows_the_softmax():
    n = R
    logits = jnp.broadcast_to(random_logits(1)[0] / 2, (n, V))
    ids, _ = sample_jit(logits, inputs(n))
    freq = np.bincount(np.asarray(ids), minlength=V) / n
    probs = np.asarray(jax.nn.softmax(logits[0]))
    assert np.abs(freq - probs).max() < 0.05
    # Temperature 0.25 sharpens toward the argmax.
    ids_cold, _ = sample_jit(logits, inputs(n, temperature=0.25))
    top = int(np.argmax(probs))
    assert np.mean(np.asarray(ids_cold) == top) > np.mean(np.asarray(ids) == top)


def test_top_k_top_p_min_p_keep_only_allowed_tokens():
    n = R
    row = random_logits(1, seed=3)[0]
    logits = jnp.broadcast_to(row, (n, V))
    order = np.argsort(-np.asarray(row))
    probs = np.asarray(jax.nn.softmax(row))
    ids, _ = sample_jit(logits, inputs(n, top_k=3))
    assert set(np.asarray(ids).tolist()) == set(order[:3].tolist())
    # top_p: the smallest prefix of the sorted distribution reaching p.
    p = 0.6
    need = int(np.searchsorted(np.cumsum(probs[order]), p) + 1)
    ids, _ = sample_jit(logits, inputs(n, top_p=p))
    assert set(np.asarray(ids).tolist()) <= set(order[:need].tolist())
    assert len(set(np.asarray(ids).tolist())) == need
    ids, _ = sample_jit(logits, inputs(n, min_p=0.2))
    allowed = set(np.nonzero(probs >= 0.2 * probs.max())[0].tolist())
    assert set(np.asarray(ids).tolist()) == allowed


def test_a_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    logits = random_logits(R, seed=1)
    base = inputs(R, seed=1234, token_index=5)
    ids_a, _ = sample_jit(logits, base)
    # Move row 2 to row 0 of another batch whose other rows use top-k/top-p (the sorting path).
    other = random_logits(R - 1, seed=9)
    logits_b = jnp.concatenate([logits[2:3], other])
    b = inputs(R, seed=1234, token_index=5)
    b = b._replace(top_k=b.top_k.at[1:].set(3), top_p=b.top_p.at[1:].set(0.5), any_filter=jnp.asarray(True))
    ids_b, _ = sample_jit(logits_b, b)
    assert int(ids_b[0]) == int(ids_a[2])
    # Changing the seed, the sample index or the token index changes the draws.
    flat = jnp.zeros((R, V))
    draws = lambda **kw: np.asarray(sample_jit(flat, inputs(R, **kw))[0])
    ref = draws(seed=1)
    assert (draws(seed=1) == ref).all()
    assert (draws(seed=2) != ref).any() and (draws(seed=1, sample_index=1) != ref).any()


def test_logprobs_are_the_raw_distribution():
    logits = random_logits(R, seed=5)
    ids, lp = sample_jit(logits, inputs(R, temperature=0.0, want_logprobs=True))
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(lp.chosen, ref[np.arange(R), np.asarray(ids)], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lp.rank, 1)
    np.testing.assert_array_equal(lp.top_ids[:, 0], ids)
    np.testing.assert_allclose(lp.top_logprobs, -np.sort(-ref, -1)[:, :lp.top_ids.shape[1]], rtol=1e-5, atol=1e-6)
    # A target (a prompt token) is reported with its true rank.
    target = np.argsort(-np.asarray(logits[0]))[4]
    _, lp = sample_jit(logits, inputs(R, temperature=0.0, target=int(target), want_logprobs=True))
    assert int(lp.rank[0]) == 5
    np.testing.assert_allclose(float(lp.chosen[0]), ref[0, target], rtol=1e-5)


# --- detokenization and stop strings ------------------------------------------------------------

def test_byte_detokenizer_holds_split_characters():
    text = "añ€😀b"
    ids = list(text.encode("utf-8"))
    d = ByteDetokenizer()
    deltas = [d.push(i) for i in ids]
    assert "".join(deltas) == text == d.text
    assert deltas[1] == "" and deltas[2] == "ñ"  # ñ is two bytes: nothing until both arrived
    d.push(0xE2)  # an unfinished character at the end is released as U+FFFD on flush
    assert d.flush() == "\ufffd"
    assert d.push(ByteTokenizer.EOS) == ""


class PieceTokenizer:
    """A toy tokenizer whose pieces split a multi-byte character across tokens."""

    pieces = {1: b" he", 2: b"llo", 3: b" \xe2\x82", 4: b"\xac!", 5: b" w"}

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_window_detokenizer_matches_full_decode():
    tok = PieceTokenizer()
    ids = [1, 2, 3, 4, 5, 2]
    d = WindowDetokenizer(tok, prompt_ids=[5])
    deltas = [d.push(i) for i in ids]
    assert deltas[2] == ""  # half of the euro sign
    assert d.text + d.flush() == tok.decode(ids)


def test_find_stop_only_looks_at_new_text_and_picks_the_earliest():
    assert _find_stop("hello world", 5, ["wor", "o w"]) == (4, "o w")
    assert _find_stop("stop here", 2, ["stop"]) is None  # ended before the new text
    assert _find_stop("abcSTOP", 1, ["STOP"]) == (3, "STOP")


def test_counts_past_int32_pack_as_the_largest_int32():
    """A top_k or min_tokens a client may send (any non-negative integer) fits the step's int32 row."""
    from types import SimpleNamespace

    from serving.core import sampling_table

    params = SamplingParams(top_k=2**45, min_tokens=2**40, max_tokens=None)
    values = sampling_table.row_values(SimpleNamespace(params=params, seed=7))
    views = {p.name: np.zeros((2, p.width) if p.width > 1 else 2, p.dtype) for p in sampling_table.ROW_PARAMS}
    sampling_table.write_row(views, 1, values)
    assert views["top_k"][1] == views["min_tokens"][1] == 2**31 - 1
    assert sampling_table.row_values(SimpleNamespace(params=SamplingParams(top_k=-1), seed=7))["top_k"] == 0


def test_the_keep_mask_size_is_the_support_of_the_filtered_distribution():
    """`LogprobsOutput.kept` of processed logprobs: per row the tokens top-k, top-p and min-p left, as numpy
    counts them from the same logits; raw rows keep the whole vocabulary."""
    import jax.numpy as jnp

    from serving.core.sampler import SamplingInputs, filtered_logits, logprobs_of

    rng = np.random.default_rng(3)
    r, vocab = 6, 50
    logits = rng.standard_normal((r, vocab)).astype(np.float32) * 3
    top_k = np.array([0, 5, 0, 0, 7, 0], np.int32)
    top_p = np.array([1.0, 1.0, 0.6, 1.0, 0.5, 1.0], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.2, 0.0, 0.0], np.float32)
    temperature = np.array([1.0, 1.0, 0.7, 1.0, 1.0, 0.0], np.float32)
    s = SamplingInputs(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p),
                       jnp.zeros((r, 2), jnp.uint32), jnp.zeros(r, jnp.int32), jnp.zeros(r, jnp.int32),
                       jnp.full(r, -1, jnp.int32), jnp.asarray(True), jnp.asarray(True), jnp.asarray(True))
    x = jnp.asarray(logits)
    processed = jnp.where((s.temperature > 0)[:, None], filtered_logits(x, s), x)
    kept = np.asarray(logprobs_of(processed, jnp.zeros(r, jnp.int32), s).kept)
    raw_kept = np.asarray(logprobs_of(x, jnp.zeros(r, jnp.int32), s).kept)

    def count(row):
        z = logits[row] / max(temperature[row], 1e-9) if temperature[row] > 0 else None
        if z is None:
            return vocab  # greedy: the processed logits are the raw ones
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p)
        keep = np.ones(vocab, bool)
        if min_p[row] > 0:
            keep &= p >= min_p[row] * p.max()
        if top_k[row] > 0:
            keep[order[top_k[row]:]] = False
        if top_p[row] < 1:
            q = np.where(keep, p, 0)[order]
            q /= q.sum()
            before = np.cumsum(q) - q
            cut = np.zeros(vocab, bool)
            cut[order] = (before >= top_p[row]) & (np.arange(vocab) > 0)
            keep &= ~cut
        return int(keep.sum())

    assert list(kept) == [count(i) for i in range(r)]
    assert list(kept[[0, 5]]) == [vocab, vocab] and kept[1] == 5
    assert list(raw_kept) == [vocab] * r
