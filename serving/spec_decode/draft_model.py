"""Drafting with a small model that shares the target's tokenizer.

The draft model has its own parameters, its own paged KV cache and its own
page pool (`BlockManager`, no prefix caching): it is a second, much cheaper
model runner. Once per engine step it

1. catches up on the tokens of each running sequence it has not seen yet:
   the prompt chunks the target has computed, and for a decoding sequence
   the target's newest token (plus the last accepted draft when all were
   accepted), rolled back first to what the target accepted;
2. draws `k` tokens autoregressively for every decoding sequence.

Both happen in one jitted call: one ragged forward for the catch-up (its
last row gives draft 1), then `k - 1` single-token forwards. The draws use
the request's temperature (greedy requests take the argmax) with a random
stream of their own, and their distributions `q` stay on device, padded to a
fixed `[max_num_seqs * k, vocab]` so the target's verification step always
sees one shape. Only the drafted ids come back to the host, since the host
packs them into the target's step.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from model.cache import BatchMetadata, init_cache
from model.config import ModelConfig
from model.forward import forward
from serving.core.block_manager import BlockManager
from serving.core.input_batch import Buckets, StepShape, sampling_row
from serving.core.sampler import inverse_cdf
from serving.spec_decode.rejection_sampler import DRAFT_STREAM, stream_uniforms


def _draw(logits, temperature, key_data, sample_index, token_index):
    """(token [S], its distribution q [S, V]) from the request's temperature; argmax when greedy."""
    temp = jnp.where(temperature > 0, temperature, 1.0)
    q = jax.nn.softmax(logits / temp[:, None], axis=-1)
    u = stream_uniforms(key_data, sample_index, token_index, DRAFT_STREAM)
    tok = jnp.where(temperature > 0, inverse_cdf(q, u), jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return tok, q


def _draft_step(params, cache, ibuf, fbuf, num_drafts, *, cfg: ModelConfig, backend: str, shape: StepShape, k: int,
                out_seqs: int):
    v = shape.split(ibuf, fbuf)
    S, ps = shape.S, cache.page_size
    pad = cache.num_pages * ps
    num_seqs = v["num_seqs"][0]
    tables = v["block_tables"]
    md = BatchMetadata(positions=v["positions"], slot_mapping=v["slots"], cu_q_lens=v["cu_q_lens"],
                       kv_lens=v["kv_lens"], block_tables=tables, num_seqs=num_seqs,
                       logits_indices=v["logits_indices"])
    logits, cache = forward(params, cache, v["tokens"], md, cfg, backend, None)
    temp = v["temperature"]
    key_data = jax.lax.bitcast_convert_type(v["key_data"], jnp.uint32)
    si, ti = v["sample_index"], v["token_index"]
    tok, q = _draw(logits, temp, key_data, si, ti)
    seqs = jnp.arange(S, dtype=jnp.int32)
    cu = jnp.minimum(jnp.arange(S + 1, dtype=jnp.int32), num_seqs)  # one query token per live sequence
    kv0 = v["kv_lens"]

    def one_more(carry, j):
        # Feed draft j at position kv0 + j - 1, only for sequences that want draft j + 1.
        cache, tok = carry
        pos = kv0 + (j - 1)
        want = j < num_drafts
        page = tables[seqs, jnp.clip(pos // ps, 0, shape.P - 1)]
        slots = jnp.where(want, page * ps + pos % ps, pad)
        kv = jnp.where(want, pos + 1, kv0)
        md = BatchMetadata(positions=jnp.where(want, pos, kv0 - 1), slot_mapping=slots, cu_q_lens=cu, kv_lens=kv,
                           block_tables=tables, num_seqs=num_seqs, logits_indices=seqs)
        logits, cache = forward(params, cache, tok, md, cfg, backend, None)
        tok, q = _draw(logits, temp, key_data, si, ti + j)
        return (cache, tok), (tok, q)

    # A loop, not k unrolled forwards: one compilation whatever k is.
    (cache, _), (toks, qs) = jax.lax.scan(one_more, (cache, tok), jnp.arange(1, k, dtype=jnp.int32))
    drafts = jnp.concatenate([tok[:, None], toks.T], axis=1)  # [S, k]
    probs = jnp.concatenate([q[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [S, k, V]
    probs = jnp.zeros((out_seqs, k, probs.shape[-1]), jnp.float32).at[:S].set(probs[:out_seqs])
    return cache, drafts, probs.reshape(out_seqs * k, -1)


_draft_jit = jax.jit(_draft_step, static_argnames=("cfg", "backend", "shape", "k", "out_seqs"), donate_argnums=(1,))


def compilation_count() -> int:
    return _draft_jit._cache_size()


class _Slot:
    """What `BlockManager.allocate` reads of a sequence: its id and its computed tokens (in the draft)."""

    __slots__ = ("seq_id", "num_computed_tokens")

    def __init__(self, seq_id: int, num_computed_tokens: int = 0):
        self.seq_id = seq_id
        self.num_computed_tokens = num_computed_tokens


def _on_processes(placement) -> bool:
    """Whether `placement` is a sharding over a mesh that spans several processes."""
    return isinstance(placement, jax.sharding.Sharding) and not placement.is_fully_addressable


def _put(tree, placement):
    """`tree` at `placement`; over several processes built from each process's own host copy (every
    process holds the same draft model), as the target runner's host inputs are."""
    if not _on_processes(placement):
        return jax.device_put(tree, placement)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(placement, np.asarray(x)), tree)


class DraftModelProposer:
    def __init__(self, cfg: ModelConfig, params, *, num_speculative_tokens: int, num_pages: int, page_size: int,
                 buckets: Buckets, max_num_seqs: int, backend: str = "reference", placement=None, runner=None):
        """`placement`: a device or sharding for the draft's params, cache and distributions (default:
        the first device). `runner`: the target's model runner; the draft then lives where it says
        (`replicated`), so the distributions feed its step, and on a mesh spanning processes each drafting
        call is announced through it (`ModelRunner.announce`) and replayed by the other processes' own
        proposers (`ModelRunner.register_replay`), so every process runs it with the same inputs."""
        self.runner = runner
        if runner is not None:
            placement = runner.replicated
        self.cfg = cfg
        self.k = num_speculative_tokens
        self.page_size = page_size
        self.num_pages = num_pages
        # The catch-up forward has the target's token buckets; one row per sequence.
        self.buckets = Buckets(buckets.max_num_batched_tokens, max_num_seqs, buckets.max_pages_per_seq,
                               buckets.min_tokens, buckets.min_pages, decode_step=buckets.decode_step)
        self.max_num_seqs = max_num_seqs
        self.backend = backend
        placement = jax.devices()[0] if placement is None else placement
        self.placement = placement
        self.params = _put(params, placement)
        self.cache = _put(init_cache(cfg, num_pages, page_size), placement)
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.computed: dict[int, int] = {}  # seq_id -> tokens whose draft K/V is in the cache
        # Committed to the device like the drafting call's output, so both are the same jit input. The
        # runner's own, when it has them: a step given them reads no drafts, and announces none.
        no_drafts = getattr(runner, "no_device_input", None)
        if no_drafts is None or no_drafts.shape != (max_num_seqs * self.k, cfg.vocab_size):
            no_drafts = _put(np.zeros((max_num_seqs * self.k, cfg.vocab_size), np.float32), placement)
        self.no_drafts = no_drafts
        self.draft_probs = self.no_drafts
        self.q_base: dict[int, int] = {}  # seq_id -> row of its first draft in `draft_probs`
        if runner is not None and hasattr(runner, "register_replay"):
            runner.register_replay("draft", self._replay, step_inputs={"device_input": lambda: self.draft_probs})

    # --- bookkeeping ---------------------------------------------------------------------
    def forget(self, live_seq_ids) -> None:
        """Drops the draft K/V of sequences that are no longer running (finished or preempted)."""
        live = set(live_seq_ids)
        for sid in [s for s in self.computed if s not in live]:
            del self.computed[sid]
            self.bm.free_seq(_Slot(sid))

    def _rolled_back(self, seq) -> int:
        """Draft tokens still valid: never more than the target has confirmed (rejected drafts go)."""
        dc = min(self.computed.get(seq.seq_id, 0), seq.num_computed_tokens)
        self.bm.trim(_Slot(seq.seq_id), dc)
        return dc

    # --- proposing ---------------------------------------------------------------------------
    def propose(self, feeds) -> tuple[dict[int, list[int]], jax.Array]:
        """`feeds`: (sequence, tokens to have seen, drafts wanted) per running sequence.

        Returns ({seq_id: drafts}, the drafts' distributions on device).
        """
        budget = self.buckets.max_num_batched_tokens
        items = []
        for seq, end, limit in feeds:
            if len(items) == self.max_num_seqs:
                break
            dc = self._rolled_back(seq)
            n = min(end - dc, budget)
            if n <= 0:
                continue
            nd = limit if dc + n == end else 0
            slot = _Slot(seq.seq_id, dc)
            if self.bm.allocate(slot, n + max(nd - 1, 0)) is None:
                nd = 0
                if self.bm.allocate(slot, n) is None:
                    continue  # the draft pool is full: this sequence runs without drafts
            items.append((seq, dc, n, nd))
            budget -= n
            if budget == 0:
                break
        self.q_base = {}
        self.draft_probs = self.no_drafts
        if not items:
            return {}, self.draft_probs
        shape, ibuf, fbuf, nd_arr = self._pack(items)
        drafts, probs = self._draft(shape, ibuf, fbuf, nd_arr)
        self.draft_probs = probs
        host = np.asarray(drafts)  # replicated: over several processes, read from this one's devices
        out = {}
        for i, (seq, dc, n, nd) in enumerate(items):
            self.computed[seq.seq_id] = dc + n + max(nd - 1, 0)
            if nd:
                out[seq.seq_id] = host[i, :nd].tolist()
                self.q_base[seq.seq_id] = i * self.k
        return out, probs

    def _pack(self, items):
        ps = self.page_size
        n_new = np.array([n for _, _, n, _ in items], np.int64)
        starts = np.array([dc for _, dc, _, _ in items], np.int64)
        total = int(n_new.sum())
        T = self.buckets.tokens_for(total)
        S = self.buckets.seqs_for(T)
        tables = [self.bm.tables[seq.seq_id] for seq, _, _, _ in items]
        P = self.buckets.step_pages(T, max(len(t) for t in tables))
        shape = StepShape(T, S, P)
        ibuf, fbuf, v = shape.empty(self.num_pages * ps)
        toks = []
        for seq, dc, n, _ in items:
            toks += seq.token_ids[dc:dc + n]
        m = len(items)
        v["tokens"][:total] = toks
        cu = np.cumsum(n_new)
        v["cu_q_lens"][1:m + 1] = cu
        v["cu_q_lens"][m + 1:] = total
        seq_of = np.repeat(np.arange(m), n_new)
        pos = np.arange(total) - (cu - n_new)[seq_of] + starts[seq_of]
        v["positions"][:total] = pos
        tbl = v["block_tables"]
        for i, t in enumerate(tables):
            tbl[i, :len(t)] = t
        v["slots"][:total] = tbl[seq_of, pos // ps] * ps + pos % ps
        v["kv_lens"][:m] = starts + n_new
        v["num_seqs"][0] = m
        v["logits_indices"][:m] = cu - 1
        nd_arr = np.zeros(S, np.int32)
        for i, (seq, dc, n, nd) in enumerate(items):
            values = seq.request.sampling_row or sampling_row(seq.request)
            v["temperature"][i] = values["temperature"]  # the draft samples at the target's temperature and seed
            v["key_data"][i] = values["key_data"]
            v["sample_index"][i] = seq.sample_index
            v["token_index"][i] = seq.num_output_tokens
            nd_arr[i] = nd
        return shape, ibuf, fbuf, nd_arr

    # --- the drafting call: every one passes through _draft -----------------------------------
    def _draft(self, shape: StepShape, ibuf, fbuf, nd_arr):
        """Runs the drafting call (announced first through the target's runner); (drafts, distributions)."""
        if self.runner is not None and hasattr(self.runner, "announce"):
            self.runner.announce("draft", ibuf, fbuf, nd_arr, shape=shape)
        if _on_processes(self.placement):  # host inputs as global arrays, as the runner's are
            ibuf, fbuf, nd_arr = (jax.make_array_from_process_local_data(self.placement, a) for a in (ibuf, fbuf, nd_arr))
        self.cache, drafts, probs = _draft_jit(self.params, self.cache, ibuf, fbuf, nd_arr, cfg=self.cfg,
                                               backend=self.backend, shape=shape, k=self.k,
                                               out_seqs=self.max_num_seqs)
        return drafts, probs

    def _replay(self, ibuf, fbuf, nd_arr, *, shape: StepShape):
        """Another process's announced drafting call, run here: this proposer's cache follows it, and its
        distributions are what the next replayed step that reads draft distributions takes."""
        _, self.draft_probs = self._draft(shape, ibuf, fbuf, nd_arr)
        return self.draft_probs

    def warm_up(self) -> dict:
        """Compiles the drafting call for every catch-up shape (on empty batches)."""
        t0 = time.perf_counter()
        before = compilation_count()
        shapes = self.buckets.all_shapes()
        for T, S, P in shapes:
            shape = StepShape(T, S, P)
            ibuf, fbuf, _ = shape.empty(self.num_pages * self.page_size)
            self._draft(shape, ibuf, fbuf, np.zeros(S, np.int32))
        jax.block_until_ready(self.cache)
        return {"seconds": time.perf_counter() - t0, "compiled": compilation_count() - before, "shapes": len(shapes)}
