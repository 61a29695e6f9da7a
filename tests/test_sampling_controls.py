"""Logit bias, allowed / bad words, min_tokens and the penalties (serving.features.sampling_controls).

The device code is checked against a plain numpy reference written from
vLLM's definitions; the engine tests check each control's effect, that a
request's tokens do not depend on what it is batched with, and that varying
the values compiles nothing after warm-up.
"""

import collections
import gc
import random
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from model.params import init_params
from model.train import forward_dense
from model.tokenizer import ByteTokenizer
from serving import LLM, SamplingParams
from serving.core import step_parts
from serving.features import sampling_controls as sc
from serving.core.model_runner import compilation_count
from serving.core.sampling_params import InvalidParameterError

V = 300  # >= 258: the byte tokenizer fits
CFG = tiny_config(vocab_size=V, max_position_embeddings=256)
UNIT_EOS = 2  # of the device-function tests' 40-token vocabulary


# --- the device functions against numpy ---------------------------------------------------------------


def reference(logits, params, prompt, output, token_index, words):
    """One row as vLLM adjusts it: allowed ids, bad words, min_tokens, logit bias, then repetition
    (prompt + output), frequency and presence (output) penalties."""
    x = logits.astype(np.float64).copy()
    if params.allowed_token_ids:
        x[[t for t in range(len(x)) if t not in params.allowed_token_ids]] = -np.inf
    for w in words:
        if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1]):
            x[w[-1]] = -np.inf
    if token_index < params.min_tokens:
        x[list(params.stop_token_ids) + [UNIT_EOS]] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    counts = collections.Counter(output)
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x


def random_case(rng, vocab):
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    output = [rng.randrange(8) for _ in range(rng.randint(0, 12))]  # few ids: repeats and bad-word hits
    words = [[rng.randrange(8) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 4))]
    if output and rng.random() < 0.5:  # a word whose prefix the output ends with
        words.append(output[-2:] + [rng.randrange(vocab)])
    params = SamplingParams(
        presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 3.0)]), min_tokens=rng.randint(0, 4),
        stop_token_ids=[rng.randrange(vocab)],
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(0, 5))},
        allowed_token_ids=rng.sample(range(vocab), vocab // 2) if rng.random() < 0.3 else None)
    return prompt, output, words, params


def test_apply_matches_the_numpy_reference():
    vocab, slots, rows = 40, 5, 7
    rng = random.Random(0)
    state = [np.array(x) for x in sc.init_state(slots, vocab)]
    cases, slot_of_row, ti = [], [], []
    for r in range(rows):
        case = random_case(rng, vocab)
        cases.append(case)
        prompt, output, words, params = case
        slot = r if r < slots - 1 else -1  # the last rows hold no slot: left untouched
        slot_of_row.append(slot)
        ti.append(len(output))
        if slot >= 0:
            rows_ = sc.RequestRows(params, prompt, (UNIT_EOS,), vocab, words)
            for x, v in zip(state, sc.host_row(rows_, output, vocab)):
                x[slot] = v
    logits = np.random.default_rng(1).normal(0, 3, (rows, vocab)).astype(np.float32)
    Penalties = collections.namedtuple("Penalties", "presence_penalty frequency_penalty repetition_penalty min_tokens")
    s = Penalties(**{f: jnp.asarray([getattr(c[3], f) for c in cases], dt) for f, dt in (
        ("presence_penalty", jnp.float32), ("frequency_penalty", jnp.float32), ("repetition_penalty", jnp.float32),
        ("min_tokens", jnp.int32))})
    got = np.asarray(jax.jit(sc.apply)(jnp.asarray(logits), sc.ControlState(*map(jnp.asarray, state)),
                                       jnp.asarray(slot_of_row, jnp.int32), jnp.asarray(ti, jnp.int32), s))
    for r, (prompt, output, words, params) in enumerate(cases):
        want = reference(logits[r], params, prompt, output, ti[r], words) if slot_of_row[r] >= 0 else logits[r]
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-4)
    assert np.isneginf(got).any() and (got != logits).any()


def test_record_counts_each_rows_draw_in_its_own_slot():
    state = sc.ControlState(*map(jnp.asarray, sc.init_state(3, 10)))
    slot = jnp.asarray([1, -1, 0, 1], jnp.int32)  # rows 0 and 3: one slot drawn twice (a fork's samples)
    new = sc.record(state, slot, jnp.asarray([4, 5, 6, 4], jnp.int32))
    counts = np.asarray(new.counts)
    assert counts[1, 4] == 2 and counts[0, 6] == 1 and counts.sum() == 3  # row 1's draw went nowhere
    assert np.asarray(new.recent)[0, -1] == 6 and (np.asarray(new.recent)[2] == -1).all()


def _penalties(cases):
    Penalties = collections.namedtuple("Penalties", "presence_penalty frequency_penalty repetition_penalty min_tokens")
    return Penalties(**{f: jnp.asarray([getattr(c[3], f) for c in cases], dt) for f, dt in (
        ("presence_penalty", jnp.float32), ("frequency_penalty", jnp.float32), ("repetition_penalty", jnp.float32),
        ("min_tokens", jnp.int32))})


def test_verifying_rows_see_the_drafts_before_them():
    """Speculative decoding: a sequence's rows r0..r0+k check drafts d0..d(k-1); row j is adjusted as
    if d0..d(j-1) were output already, and `record` keeps only what the verification emitted."""
    vocab, slots = 40, 4
    rng = random.Random(5)
    state = [np.array(x) for x in sc.init_state(slots, vocab)]
    cases, slot_of_row, ti, draft_token, group_start, outputs = [], [], [], [], [], []
    for slot, k in enumerate((3, 0, 2)):  # groups of 4, 1 and 3 rows
        case = random_case(rng, vocab)
        prompt, output, words, params = case
        rows_ = sc.RequestRows(params, prompt, (UNIT_EOS,), vocab, words)
        for x, v in zip(state, sc.host_row(rows_, output, vocab)):
            x[slot] = v
        drafts = [rng.randrange(8) for _ in range(k)]  # few ids: they repeat the output's and hit bad words
        first = len(slot_of_row)
        for j in range(k + 1):
            cases.append(case)
            slot_of_row.append(slot)
            ti.append(len(output) + j)
            draft_token.append(drafts[j] if j < k else -1)
            group_start.append(first)
            outputs.append(output + drafts[:j])
    logits = np.random.default_rng(2).normal(0, 3, (len(cases), vocab)).astype(np.float32)
    drafts_in = step_parts.Proposals(jnp.asarray(draft_token, jnp.int32), jnp.asarray(group_start, jnp.int32))
    st = sc.ControlState(*map(jnp.asarray, state))
    got = np.asarray(jax.jit(sc.apply)(jnp.asarray(logits), st, jnp.asarray(slot_of_row, jnp.int32),
                                       jnp.asarray(ti, jnp.int32), _penalties(cases), drafts_in))
    for r, (prompt, _, words, params) in enumerate(cases):
        want = reference(logits[r], params, prompt, outputs[r], ti[r], words)
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-4)
    # The first group accepts d0 and emits e at row 1 (rows 2, 3: -1); the others emit every row.
    ids = np.asarray([draft_token[0], 7, -1, -1, 9, draft_token[5], draft_token[6], 11], np.int32)
    new = jax.jit(sc.record)(st, jnp.asarray(slot_of_row, jnp.int32), jnp.asarray(ids), drafts_in)
    L = sc.MAX_BAD_WORD_TOKENS - 1
    for slot, emitted in ((0, [draft_token[0], 7]), (1, [9]), (2, [draft_token[5], draft_token[6], 11])):
        output = cases[group_start.index(group_start[slot_of_row.index(slot)])][1] + emitted
        want_counts = np.bincount(output, minlength=vocab)[:vocab]
        np.testing.assert_array_equal(np.asarray(new.counts)[slot], want_counts)
        want_recent = ([-1] * L + output)[-L:]
        np.testing.assert_array_equal(np.asarray(new.recent)[slot], want_recent)


def test_slots_are_taken_back_after_finish_preemption_and_fork():
    slots = sc.ControlSlots(2)
    req = types.SimpleNamespace(part_state={sc.KEY: object()})
    plain = types.SimpleNamespace(part_state={})
    a, b, c, d = (types.SimpleNamespace(seq_id=i, request=r) for i, r in enumerate((req, req, plain, req)))
    item = lambda seq, samples=(0,): types.SimpleNamespace(seq=seq, sample_indices=samples)
    running = {0, 1, 2, 3}
    got, loads = slots.assign([item(a), item(b, (0, 1)), item(c)], lambda s: s.seq_id in running)
    assert set(got) == {0, 1} and len(loads) == 2 and 2 not in got
    got, loads = slots.assign([item(a), item(b)], lambda s: s.seq_id in running)
    assert [s.seq_id for _, s in loads] == [1]  # the forked sequence reloads its row; a keeps its slot
    running.discard(0)
    got, loads = slots.assign([item(d)], lambda s: s.seq_id in running)
    assert got == {3: loads[0][0]}  # a's slot, free again once a stopped running


# --- the engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(3))


@pytest.fixture(scope="module")
def llm(params):
    # One step shape (a single token and context bucket), so warm-up compiles once.
    return LLM(config=CFG, params=params, tokenizer=ByteTokenizer(V), max_num_seqs=4, max_num_batched_tokens=32,
               max_model_len=96, num_pages=48, min_token_bucket=32, min_context_bucket=96, warmup=True)


PROMPT = [1, 5, 6, 7, 8]


def gen(llm, prompt=PROMPT, **kw):
    kw = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw}
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]


def test_logit_bias_forces_and_forbids(llm):
    base = gen(llm).token_ids
    assert gen(llm, logit_bias={42: 100}).token_ids == [42] * 12
    banned = gen(llm, logit_bias={base[0]: -100}).token_ids
    assert base[0] not in banned and banned != base


def test_penalties_stop_repeats(llm):
    base = gen(llm, max_tokens=40).token_ids
    most = max(collections.Counter(base).values())
    assert most >= 4  # the unpenalised greedy output repeats
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        out = gen(llm, max_tokens=40, **kw).token_ids
        assert max(collections.Counter(out).values()) < most, kw


def test_repetition_penalty_follows_the_definition(llm, params):
    """Each greedy token is the argmax of the dense forward's logits penalised as vLLM defines it."""
    rp = 1.8
    out = gen(llm, repetition_penalty=rp).token_ids
    assert out != gen(llm).token_ids
    tokens = list(PROMPT)
    dense = jax.jit(lambda t: forward_dense(params, t, CFG))
    for tok in out:  # causal: right padding to one length changes no earlier position (one compile)
        x = np.asarray(dense(jnp.asarray([tokens + [0] * (32 - len(tokens))])))[0, len(tokens) - 1]
        x = x.astype(np.float64)
        seen = list(set(tokens))
        x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
        assert tok == int(np.argmax(x))
        tokens.append(tok)


def test_min_tokens_holds_off_eos_stop_ids_and_stop_strings(llm):
    force_eos = {ByteTokenizer.EOS: 100}
    assert len(gen(llm, ignore_eos=False, logit_bias=force_eos).token_ids) == 1
    out = gen(llm, ignore_eos=False, logit_bias=force_eos, min_tokens=5)
    assert len(out.token_ids) == 6 and out.token_ids[-1] == ByteTokenizer.EOS and out.finish_reason == "stop"
    out = gen(llm, logit_bias={77: 100}, stop_token_ids=[77], min_tokens=3)
    assert len(out.token_ids) == 4 and 77 not in out.token_ids[:3] and out.stop_reason == 77
    out = gen(llm, logit_bias={ord("a"): 100}, stop=["a"], min_tokens=3)
    assert (out.text, out.finish_reason, out.stop_reason) == ("aa", "stop", "a")
    assert gen(llm, logit_bias={ord("a"): 100}, stop=["a"]).text == ""


def test_allowed_token_ids_restrict_sampling(llm):
    allowed = [10, 20, 30, 40]
    out = gen(llm, temperature=1.0, seed=5, max_tokens=16, allowed_token_ids=allowed).token_ids
    assert set(out) <= set(allowed) and len(set(out)) > 1


def test_bad_words_single_and_multi_token(llm):
    base = gen(llm).token_ids
    word = next(chr(t) for t in base if 33 <= t < 127)
    assert ord(word) not in gen(llm, bad_words=[word]).token_ids
    # "xx": after an x, x is banned; a lone x stays possible.
    out = gen(llm, logit_bias={ord("x"): 100}, bad_words=["xx"]).token_ids
    assert out.count(ord("x")) >= 5
    assert all(not (a == b == ord("x")) for a, b in zip(out, out[1:]))


def test_batch_invariance_and_no_recompilation(llm):
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if "backend_compile" in name else None)
    compiled = compilation_count()
    sp = SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
                        frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={7: 5.0}, bad_words=["q"])
    alone = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=12 + i, ignore_eos=True,
                             frequency_penalty=[0.0, 2.0, -1.0][i], min_tokens=i, logit_bias={i + 3: 50.0})
              for i in range(3)]
    prompts = [[1, 9, 9, 9], PROMPT, [1] + list(range(20, 40)), [1, 3]]
    outs = llm.generate(prompts, [others[0], sp, others[1], others[2]])
    assert outs[1].outputs[0].token_ids == alone
    n2 = llm.generate([PROMPT], sp.clone(n=2))[0].outputs
    assert n2[0].token_ids == alone  # sample 0 of a fork: its own counts, the same draws
    assert compilation_count() == compiled
    assert not events, "a backend compile happened after warm-up"


def test_same_tokens_without_overlap_and_through_preemption(llm, params):
    """A pool too small for the batch preempts and recomputes sequences (their slots reloaded from the
    host), and steps run one at a time: every request still draws what it draws on the roomy engine."""
    small = LLM(config=CFG, params=params, tokenizer=ByteTokenizer(V), max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=96, num_pages=10, min_token_bucket=32, min_context_bucket=96, async_scheduling=False)
    prompts = [[1] + list(range(10 + i, 30 + i)) for i in range(4)]
    sps = [SamplingParams(temperature=0.8, seed=i, max_tokens=36, ignore_eos=True, presence_penalty=1.0,
                          repetition_penalty=1.2, frequency_penalty=0.3 * i, bad_words=["(x"]) for i in range(4)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, sps)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == want
    # The part outlives the engine as a static argument in JAX's tracing cache; the runner it wrote slots
    # through (weights, KV pool, executables) does not.
    runner = weakref.ref(small.engine.runner)
    small.shutdown()
    del small
    gc.collect()
    assert runner() is None


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_draws_the_same_tokens(llm, params, method):
    """Greedy requests with every control draw what the plain engine draws when their drafts are
    verified: row j of a verifying sequence counts drafts 0..j-1 as output (penalties, bad words,
    min_tokens) and only accepted tokens are recorded. The draft model is the target itself, unaware
    of the controls, so it proposes many tokens the controls change and many they keep."""
    spec = LLM(config=CFG, params=params, tokenizer=ByteTokenizer(V), max_num_seqs=4, max_num_batched_tokens=32,
               max_model_len=96, num_pages=48, min_token_bucket=32, min_context_bucket=96,
               speculative_method=method, num_speculative_tokens=3,
               speculative_draft=(CFG, params) if method == "draft" else None)
    prompts = [[1] + [40 + i, 41, 42, 43] * 5 for i in range(4)]
    sps = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=0.02),
           SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.05, repetition_penalty=1.02,
                          min_tokens=30),
           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, bad_words=["(x", "ab"],
                          logit_bias={44: 0.5}),
           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=0.01, min_tokens=5)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sps)]
    st = spec.engine.stats().spec_decode
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens, st
    assert got == want


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0), ("min_tokens", -1),
    ("min_tokens", 17), ("logit_bias", {5: 101}), ("logit_bias", {500: 1}), ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]), ("bad_words", [""]),
])
def test_invalid_control_values_name_the_field(field, value):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**{field: value}).validate(vocab_size=V)
    assert e.value.param == field


def test_processed_logprobs_are_those_of_the_distribution_drawn_from():
    """logprobs_mode=processed_logprobs: a token drawn with top_k=2 at temperature 0.5 reports its log-probability
    among the two tokens top-k kept, at that temperature: computed from the raw top-2 logprobs of an engine in
    the default mode (the same draws, since the mode changes no sampling), and 0 under top_k=1."""
    from serving import LLM

    engine = dict(max_num_seqs=2, max_num_batched_tokens=16, page_size=16, max_model_len=64, num_pages=16)
    sp = SamplingParams(temperature=0.5, top_k=2, max_tokens=6, logprobs=2, seed=7, ignore_eos=True)
    raw = LLM(**engine).generate(["def f("], sp)[0].outputs[0]
    processed = LLM(logprobs_mode="processed_logprobs", **engine).generate(["def f("], sp)[0].outputs[0]
    assert processed.token_ids == raw.token_ids
    for tok, raw_lp, lp in zip(raw.token_ids, raw.logprobs, processed.logprobs):
        kept = np.array([raw_lp[t].logprob for t in sorted(raw_lp, key=lambda t: raw_lp[t].rank)[:2]])
        want = raw_lp[tok].logprob / 0.5 - np.log(np.exp(kept / 0.5).sum())  # (the normalizer cancels)
        assert abs(lp[tok].logprob - want) < 1e-4, (lp[tok].logprob, want)
    greedy_k1 = LLM(logprobs_mode="processed_logprobs", **engine).generate(
        ["def f("], sp.clone(top_k=1))[0].outputs[0]
    assert all(abs(lp[t].logprob) < 1e-6 for t, lp in zip(greedy_k1.token_ids, greedy_k1.logprobs))
    # The keep-mask size of every drawn token: the two top-k kept (one under top_k=1); raw logprobs are of the
    # whole vocabulary.
    vocab = LLM(**engine).engine.cfg.vocab_size
    assert processed.keep_sizes == [2] * 6 and greedy_k1.keep_sizes == [1] * 6 and raw.keep_sizes == [vocab] * 6
