"""Sampled output keeps the target's distribution under speculation (chi-square tests).

Two levels, each with a negative check that a deliberately biased acceptance
rule fails the same threshold, so the tests can fail:

* the rejection sampler alone, on fixed logits over a vocabulary of 8: the
  first emitted token of many independent rows must follow p exactly (a
  goodness-of-fit test against p), and so must the second token of rows
  whose first draft was accepted. Biased rule: after a rejection, draw from
  p instead of the residual max(0, p - q) (a subtle, classic mistake).
* the engine on a tiny random model (vocabulary 16): token frequencies at
  the verified output positions, with and without speculation (a two-sample
  test), for both proposers. Biased rule: accept every draft.

Seeds are fixed, so each statistic is a fixed number; the threshold is the
0.1% critical value of the chi-square distribution.
"""

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
from serving.core.sampler import SamplingInputs
from serving.compilation import executable_store, table
from serving.spec_decode import rejection_sampler

# Critical values of chi-square at p = 0.001 by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
            10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def biased_residual(p, q):
    """The classic mistake: resample from the target itself after a rejection."""
    return p


def accept_every_draft(p, q_d, p_d, u_accept):
    """The crudest bias: trust the proposer."""
    return jnp.ones_like(p_d, bool)


def goodness_of_fit(counts, probs):
    """Chi-square statistic of observed counts against probabilities, and its 0.1% threshold."""
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), CHI2_999[len(obs) - 1]


def two_sample(a, b):
    """Chi-square statistic of two count vectors coming from one distribution, and its threshold."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    keep = (a + b) >= 10
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    nz = (a + b) > 0
    a, b = a[nz], b[nz]
    ka, kb = np.sqrt(b.sum() / a.sum()), np.sqrt(a.sum() / b.sum())
    return float(((ka * a - kb * b) ** 2 / (a + b)).sum()), CHI2_999[len(a) - 1]


# --- the rejection sampler alone -----------------------------------------------------------------
V = 8
N = 20_000  # independent groups of k + 1 = 3 rows


def _inputs(n_rows, seed):
    rng = np.random.default_rng(seed)
    key_data = rng.integers(0, 2**32, (n_rows // 3, 2), dtype=np.uint64).astype(np.uint32).repeat(3, axis=0)
    return SamplingInputs(
        temperature=jnp.ones(n_rows), top_k=jnp.zeros(n_rows, jnp.int32), top_p=jnp.ones(n_rows),
        min_p=jnp.zeros(n_rows), key_data=jnp.asarray(key_data), sample_index=jnp.zeros(n_rows, jnp.int32),
        token_index=jnp.tile(jnp.arange(3, dtype=jnp.int32), n_rows // 3), target=-jnp.ones(n_rows, jnp.int32),
        any_random=jnp.array(True), any_filter=jnp.array(False), want_logprobs=jnp.array(False))


def _run_verify(point_mass: bool, seed=0):
    """Emitted ids [N, 3] for groups (draft row, draft row, bonus row) with fixed logits per position."""
    rng = np.random.default_rng(seed)
    logits3 = rng.normal(size=(3, V)) * 1.5
    q3 = np.exp(rng.normal(size=(3, V)))
    q3 /= q3.sum(-1, keepdims=True)
    if point_mass:  # prompt lookup: the same draft every time (the most likely token)
        p0 = np.exp(logits3[0]) / np.exp(logits3[0]).sum()
        drafts = np.stack([np.full(N, np.argmax(p0)), np.full(N, 3), np.full(N, -1)], axis=1)
        q = None
    else:
        drafts = np.stack([rng.choice(V, N, p=q3[0]), rng.choice(V, N, p=q3[1]), np.full(N, -1)], axis=1)
        q = jnp.asarray(np.tile(q3, (N, 1)), jnp.float32)
    logits = jnp.asarray(np.tile(logits3, (N, 1)), jnp.float32)
    group = jnp.repeat(jnp.arange(0, 3 * N, 3, dtype=jnp.int32), 3)
    fn = jax.jit(lambda lg, s, d, g, qq: rejection_sampler.verify(lg, s, d, g, qq))
    ids = fn(logits, _inputs(3 * N, seed + 1), jnp.asarray(drafts.reshape(-1), jnp.int32), group, q)
    p = np.exp(logits3) / np.exp(logits3).sum(-1, keepdims=True)
    return np.asarray(ids).reshape(N, 3), drafts, p


@pytest.mark.parametrize("point_mass", [True, False], ids=["point_mass_draft", "draft_distribution"])
def test_rejection_sampler_emits_the_target_distribution(point_mass, monkeypatch):
    ids, drafts, p = _run_verify(point_mass)
    assert (ids[:, 0] >= 0).all()
    accepted0 = ids[:, 0] == drafts[:, 0]
    assert 0.1 < accepted0.mean() < 0.9  # both branches are exercised
    stat0, thr0 = goodness_of_fit(np.bincount(ids[:, 0], minlength=V), p[0])
    second = ids[accepted0, 1]
    stat1, thr1 = goodness_of_fit(np.bincount(second, minlength=V), p[1])
    assert stat0 < thr0 and stat1 < thr1, (stat0, thr0, stat1, thr1)
    # Rows after a rejection come back as -1; a group of all-accepted drafts gets its bonus token.
    assert (ids[~accepted0, 1:] == -1).all()
    both = accepted0 & (ids[:, 1] == drafts[:, 1])
    assert (ids[both, 2] >= 0).all() and (ids[accepted0 & ~both, 2] == -1).all()

    monkeypatch.setattr(rejection_sampler, "residual", biased_residual)
    ids, _, p = _run_verify(point_mass)
    stat, thr = goodness_of_fit(np.bincount(ids[:, 0], minlength=V), p[0])
    assert stat > thr, f"the biased rule passed: {stat} <= {thr}"


def test_greedy_rows_take_the_longest_matching_prefix():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(8, V)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    s = _inputs(9, 0)._replace(temperature=jnp.zeros(8), any_random=jnp.array(False), key_data=jnp.zeros((8, 2),
                               jnp.uint32), sample_index=jnp.zeros(8, jnp.int32), token_index=jnp.zeros(8, jnp.int32),
                               top_k=jnp.zeros(8, jnp.int32), top_p=jnp.ones(8), min_p=jnp.zeros(8),
                               target=-jnp.ones(8, jnp.int32))
    # Group A rows 0-3: drafts match at 0 and 1, miss at 2. Group B rows 4-6: all match, bonus row 6.
    # Row 7 is an ordinary row.
    drafts = np.array([best[0], best[1], (best[2] + 1) % V, -1, best[4], best[5], -1, -1])
    group = np.array([0, 0, 0, 0, 4, 4, 4, 7])
    ids = np.asarray(jax.jit(rejection_sampler.verify)(logits, s, jnp.asarray(drafts, jnp.int32),
                                                        jnp.asarray(group, jnp.int32)))
    assert ids.tolist() == [best[0], best[1], best[2], -1, best[4], best[5], best[6], best[7]]


# --- the engine --------------------------------------------------------------------------------
VOCAB_CFG = tiny_config(vocab_size=16, eos_token_ids=(2,))
SAMPLES = 1000


@pytest.fixture(scope="module")
def sharp_params():
    """Random weights with sharpened logits, so the distributions are far from uniform. The seed gives
    prompt-lookup drafts an acceptance rate (0.03) inside the range the test asserts."""
    params = init_params(VOCAB_CFG, jax.random.key(6))
    return jax.tree.map(lambda w: w * 1.6, params)


def _frequencies(params, draft=None, **spec):
    # One step shape (64 tokens, 3 pages of 8 per sequence): little to compile.
    llm = LLM(config=VOCAB_CFG, params=params, max_num_seqs=32, max_num_batched_tokens=64, page_size=8,
              num_pages=120, max_model_len=24, min_token_bucket=64, min_context_bucket=24,
              attention_backend="reference", enable_prefix_caching=False, speculative_draft=draft, **spec)
    prompt = [1] + list(range(3, 16)) + [5, 9, 5, 9]  # every token occurs: prompt lookup always drafts
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(SAMPLES)]
    outs = llm.generate([prompt] * SAMPLES, sps)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    st = llm.engine.stats().spec_decode
    return [np.bincount(toks[:, j], minlength=VOCAB_CFG.vocab_size) for j in (1, 2)], st


@pytest.fixture(scope="module")
def plain_frequencies(sharp_params):
    return _frequencies(sharp_params)[0]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_token_frequencies_match_without_speculation(sharp_params, plain_frequencies, method,
                                                             monkeypatch):
    draft = None
    if method == "draft":  # a related but different model, so drafts are often rejected
        noisy = jax.tree.map(lambda w: w + 0.8 * w.std() * jax.random.normal(jax.random.key(9), w.shape, w.dtype),
                             sharp_params)
        draft = (VOCAB_CFG, noisy)
    spec = dict(speculative_method=method, num_speculative_tokens=2)
    freqs, st = _frequencies(sharp_params, draft, **spec)
    assert st.num_draft_tokens > SAMPLES // 2 and 0.02 < st.acceptance_rate < 0.98
    for a, b in zip(freqs, plain_frequencies):
        stat, thr = two_sample(a, b)
        assert stat < thr, (method, stat, thr, a, b)

    monkeypatch.setattr(rejection_sampler, "accept_random", accept_every_draft)
    # The step program is traced afresh with the biased rule: nothing compiled before may serve it.
    jax.clear_caches()
    monkeypatch.setattr(table, "_TABLE", weakref.WeakValueDictionary())
    monkeypatch.setattr(executable_store, "current", lambda *a: None)
    freqs, _ = _frequencies(sharp_params, draft, **spec)
    stats = [two_sample(a, b) for a, b in zip(freqs, plain_frequencies)]
    assert any(stat > thr for stat, thr in stats), f"the biased rule passed: {stats}"
