"""The KV page pool: allocation, freeing, prefix-cache hits and LRU eviction, copy-on-write."""

import itertools

import pytest

from serving.core.block_manager import NO_PAGE, BlockManager, block_digest, salt_digest

_ids = itertools.count(10_000)


class Seq:
    """The few attributes the block manager reads from a sequence."""

    def __init__(self, tokens, cache_salt=None):
        self.seq_id = next(_ids)
        self.token_ids = list(tokens)
        self.num_computed_tokens = 0
        self.block_hashes = []
        self.hash_root = salt_digest(cache_salt)
        self.keeps_all_pages = False  # True for a prefill whose K/V is exported

    @property
    def num_tokens(self):
        return len(self.token_ids)


def compute(bm, seq, n, hits=()):
    """Allocates and 'computes' n tokens the way the scheduler and engine do."""
    copies = bm.allocate(seq, n, hits)
    assert copies is not None
    seq.num_computed_tokens += len(hits) * bm.page_size + n
    bm.register_full_blocks(seq)
    return copies


def test_allocate_and_free_returns_every_page():
    bm = BlockManager(num_pages=8, page_size=4)
    a, b = Seq(range(10)), Seq(range(5))
    compute(bm, a, 10)
    compute(bm, b, 5)
    assert len(bm.table(a)) == 3 and len(bm.table(b)) == 2
    assert set(bm.table(a)).isdisjoint(bm.table(b))
    assert bm.num_free_blocks == 3
    bm.check_invariants([a.seq_id, b.seq_id])
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
    bm.check_invariants([])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_pages=4, page_size=4)
    a = Seq(range(12))
    compute(bm, a, 12)  # 3 pages
    b = Seq(range(100, 108))
    before = (list(bm.free), list(bm.ref))
    assert bm.allocate(b, 8) is None  # needs 2, 1 free
    assert (list(bm.free), list(bm.ref)) == before
    assert bm.table(b) == []
    bm.check_invariants([a.seq_id])


def test_decode_grows_one_page_at_a_time():
    bm = BlockManager(num_pages=4, page_size=4)
    s = Seq(range(4))
    compute(bm, s, 4)
    assert len(bm.table(s)) == 1
    s.token_ids.append(99)
    compute(bm, s, 1)
    assert len(bm.table(s)) == 2  # position 4 opens page 2
    for t in range(3):
        s.token_ids.append(t)
        compute(bm, s, 1)
    assert len(bm.table(s)) == 2


def test_chained_digest_depends_on_the_whole_prefix():
    a = block_digest(None, [1, 2, 3, 4])
    assert a == block_digest(None, [1, 2, 3, 4])
    assert a != block_digest(None, [1, 2, 3, 5])
    # Same block contents after different prefixes are different blocks.
    assert block_digest(a, [5, 6, 7, 8]) != block_digest(block_digest(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_prefix_hit_shares_full_blocks_only():
    bm = BlockManager(num_pages=16, page_size=4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    a = Seq(prompt)
    compute(bm, a, len(prompt))
    b = Seq(prompt[:8] + [50, 51, 52])
    hits = bm.lookup_prefix(b)
    assert hits == bm.table(a)[:2]
    compute(bm, b, b.num_tokens - 8, hits)
    assert bm.table(b)[:2] == bm.table(a)[:2] and bm.table(b)[2] != bm.table(a)[2]
    assert [bm.ref[p] for p in bm.table(a)] == [2, 2, 1]
    bm.check_invariants([a.seq_id, b.seq_id])


def test_cache_salts_share_pages_only_with_the_same_salt():
    bm = BlockManager(num_pages=32, page_size=4)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    owner = Seq(prompt, cache_salt="tenant-a")
    compute(bm, owner, len(prompt))
    assert bm.lookup_prefix(Seq(prompt, cache_salt="tenant-a")) == bm.table(owner)[:3]
    assert bm.lookup_prefix(Seq(prompt, cache_salt="tenant-b")) == []
    assert bm.lookup_prefix(Seq(prompt)) == []  # unsalted requests do not see salted pages
    plain = Seq(prompt)
    compute(bm, plain, len(prompt))
    assert bm.lookup_prefix(Seq(prompt, cache_salt="tenant-b")) == []  # ... nor salted ones unsalted pages
    assert bm.lookup_prefix(Seq(prompt)) == bm.table(plain)[:3]
    # A salt is not a block: no salted chain starts like the unsalted chain of other tokens.
    assert salt_digest("x") != block_digest(None, []) and len(salt_digest("x")) == 16
    assert salt_digest("a") != salt_digest("b") and salt_digest(None) is None
    bm.check_invariants([owner.seq_id, plain.seq_id])


def test_fully_cached_prompt_still_recomputes_its_last_token():
    bm = BlockManager(num_pages=16, page_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    a = Seq(prompt)
    compute(bm, a, 8)
    b = Seq(prompt)
    assert len(bm.lookup_prefix(b)) == 1  # (8 - 1) // 4


def test_freed_blocks_stay_hittable_until_evicted_lru():
    bm = BlockManager(num_pages=6, page_size=2)
    a = Seq([1, 2, 3, 4, 5])  # blocks [1,2] [3,4] + partial
    compute(bm, a, 5)
    cached = bm.table(a)[:2]
    bm.free_seq(a)
    assert bm.num_free_blocks == 6
    # The partial (unregistered) page went to the front: it is reused first.
    c = Seq([9, 9])
    compute(bm, c, 2)
    assert bm.table(c)[0] not in cached
    b = Seq([1, 2, 3, 4, 7])
    assert bm.lookup_prefix(b) == cached
    # Taking 4 of the 5 free pages evicts the cached tail block before the head.
    d = Seq(range(100, 108))
    compute(bm, d, 8)
    assert bm.lookup_prefix(b) == cached[:1]
    e = Seq([7, 7])
    compute(bm, e, 2)
    assert bm.lookup_prefix(b) == []
    bm.check_invariants([c.seq_id, d.seq_id, e.seq_id])


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_pages=3, page_size=2)
    a = Seq([1, 2, 3])
    compute(bm, a, 3)
    bm.free_seq(a)
    b = Seq([1, 2, 3, 4, 5, 6])
    hits = bm.lookup_prefix(b)
    assert len(hits) == 1
    # 3 free pages, one of them is the hit: 2 more fit exactly, 3 more would not.
    assert bm.allocate(Seq([0] * 8), 8) is None
    compute(bm, b, 4, hits)
    assert bm.num_free_blocks == 0
    bm.check_invariants([b.seq_id])


def test_copy_on_write_of_a_shared_partial_block():
    bm = BlockManager(num_pages=8, page_size=4)
    parent = Seq(range(6))  # 1 full block + 2 tokens
    compute(bm, parent, 6)
    child = Seq(range(6))
    child.num_computed_tokens = 6
    bm.fork(parent, child)
    assert bm.table(child) == bm.table(parent)
    assert all(bm.ref[p] == 2 for p in bm.table(parent))
    # The child writes position 6 first: its partial page is copied.
    child.token_ids.append(42)
    copies = compute(bm, child, 1)
    assert copies == [(bm.table(parent)[1], bm.table(child)[1])]
    assert bm.table(child)[0] == bm.table(parent)[0]
    # Now the parent is the only holder of its page: no copy.
    parent.token_ids.append(43)
    assert compute(bm, parent, 1) == []
    bm.check_invariants([parent.seq_id, child.seq_id])
    bm.free_seq(parent)
    bm.free_seq(child)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_copy_on_write_counts_against_the_pool():
    bm = BlockManager(num_pages=2, page_size=4)
    parent = Seq(range(6))
    compute(bm, parent, 6)
    child = Seq(range(6))
    child.num_computed_tokens = 6
    bm.fork(parent, child)
    child.token_ids.append(1)
    assert bm.allocate(child, 1) is None  # no page to copy into
    bm.check_invariants([parent.seq_id, child.seq_id])


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_pages=8, page_size=2, enable_prefix_caching=False)
    a = Seq([1, 2, 3, 4, 5])
    compute(bm, a, 5)
    assert bm.lookup_prefix(Seq([1, 2, 3, 4, 5])) == []
    assert not bm.cached


def test_invalid_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


# --- sliding windows ----------------------------------------------------------------------------------


def test_pages_before_every_window_are_released_as_the_sequence_advances():
    """Window 6, pages of 4: the query at position p sees keys from p - 5 on, so a page is released once
    the next token's window starts past it; a fork shares what is still held; nothing leaks."""

    bm = BlockManager(num_pages=16, page_size=4, window=6)
    a = Seq(range(10))
    compute(bm, a, 10)  # next query at 10 sees 5.. : page 0 (keys 0-3) is released at the next allocate
    assert NO_PAGE not in bm.table(a)
    for _ in range(14):  # decode to 24 tokens, one at a time
        a.token_ids.append(7)
        compute(bm, a, 1)
        bm.check_invariants([a.seq_id])
    table = bm.table(a)
    # After the last allocate: computed 23, next query 23 sees 18.. ; pages 0-3 (keys 0-15) are passed.
    assert table[:4] == [NO_PAGE] * 4 and NO_PAGE not in table[4:]
    assert bm.num_used_blocks == len(table) - 4 == 2
    assert bm.num_released_pages == 4

    child = Seq(a.token_ids)
    child.num_computed_tokens = a.num_computed_tokens
    bm.fork(a, child)
    bm.check_invariants([a.seq_id, child.seq_id])
    assert bm.num_used_blocks == 2  # shared, not copied
    bm.free_seq(a)
    bm.free_seq(child)
    assert bm.num_free_blocks == 16
    bm.check_invariants([])


def test_released_pages_stay_in_the_prefix_cache_and_exporting_sequences_keep_theirs():
    bm = BlockManager(num_pages=16, page_size=4, window=4)
    a = Seq(range(20))
    compute(bm, a, 16)
    compute(bm, a, 4)  # releases pages 0-2 (next query 16 sees 13..): registered full blocks, still hittable
    assert bm.num_released_pages == 3
    b = Seq(range(20))
    assert len(bm.lookup_prefix(b)) == 4  # all four full blocks: the released ones are cached, not lost

    exporting = Seq(range(100, 120))
    exporting.keeps_all_pages = True  # a prefill whose K/V is shipped: every prompt page must stay
    compute(bm, exporting, 16)
    compute(bm, exporting, 4)
    assert NO_PAGE not in bm.table(exporting)
    bm.check_invariants([a.seq_id, exporting.seq_id])


def test_a_window_only_when_every_layer_slides():
    from model.config import LlamaConfig
    from serving.core.block_manager import releasing_window

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=8)
    assert releasing_window(LlamaConfig(**base)) is None
    assert releasing_window(LlamaConfig(**base, sliding_window=8)) == 8
    assert releasing_window(LlamaConfig(**base, sliding_window=8,
                                        layer_types=("sliding_attention", "full_attention"))) is None


def test_pages_released_before_their_step_was_processed_are_still_registered():
    """With overlapped scheduling the next step is planned (and the window moves) before the previous one's
    output is processed, i.e. before its full blocks are registered: they are registered on release."""
    bm = BlockManager(num_pages=16, page_size=4, window=4)
    a = Seq(range(20))
    assert bm.allocate(a, 16) == []
    a.num_computed_tokens = 16  # dispatched, not yet processed (no register_full_blocks call)
    assert bm.allocate(a, 4) == []  # the window now starts at 13: pages 0-2 go
    assert bm.table(a)[:3] == [NO_PAGE] * 3
    assert len(bm.lookup_prefix(Seq(range(20)))) == 4
    bm.check_invariants([a.seq_id])
