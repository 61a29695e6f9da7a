"""The KV page pool on the host: free list, block tables, ref counts, prefix cache.

Pages ("blocks") are identified by index into the device cache. Each live
sequence owns a block table (list of page ids). A page's reference count is
the number of block tables holding it; a page with count 0 sits in the free
queue.

Prefix caching. A *full* block is named by a chained digest of (the previous
block's digest, this block's token ids), so equal digests mean equal prefixes
(a cryptographic digest: a collision would serve one request another's KV).
A sequence whose request carries a `cache_salt` starts its chain from a
digest of the salt instead of the shared root, so requests with different
salts (tenants) never name a page alike: they share no cached pages and cannot
learn from hit timing what another tenant sent. Full blocks are registered in
`cached` once their K/V is written. A new
sequence reuses every cached full block of its prompt. When a sequence ends,
its pages return to the free queue *still registered*: they stay hittable
until allocation pops them from the front of the queue, which evicts them
(LRU). Unregistered pages go to the front (they are worth nothing), the tail
block of a sequence before its head (a tail is less likely to be shared).

Copy-on-write. Samples of one prompt (`n > 1`) share the prompt's pages (ref
count > 1). Writing into a shared page first moves the writer onto a fresh
page and returns the (src, dst) pair so the model runner copies it on device.
Only a partially filled last page can ever be written, so that is the only
page ever copied.

Sliding windows. When every layer of the model attends only to the last
`window` positions (Mistral, Phi-3 with `sliding_window`), the pages wholly
before the window of a sequence's next token are read by no later step; each
`allocate` drops the sequence's hold on them (their table entries become
`NO_PAGE`, which the step reads as page 0 and never attends to), so a long
generation holds about `window / page_size` pages instead of its whole
context. A released page keeps its prefix-cache entry like any freed page.
Sequences whose prompt K/V is exported (`seq.keeps_all_pages`) keep theirs.

A host tier (`host`, e.g. `serving.features.host_kv_tier.HostKVTier`) extends the
prefix cache beyond the pool: every eviction of a cached page is reported to
it (`host.evicting(page, digest)`, before the page can be written again), and a
prefix block it holds (`host.holds(digest)`) is a hit too: `lookup_prefix`
returns it as a `HostHit`, and `allocate` gives it a free page, registers the
page under the block's digest and reports the page to restore
(`host.restoring(digest, page)`). The page is fresh from the free queue, so no
sequence holds it: nothing is restored into a page a running sequence owns.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterable, Optional

import numpy as np


def block_digest(parent: Optional[bytes], token_ids, extra: bytes = b"") -> bytes:
    """Chained digest of one full block: H(parent digest, the block's token ids[, extra]). `extra` is
    what else decides the block's K/V: the content digests of the images whose placeholder tokens the
    block holds (`serving.features.multimodal`), so prompts differing only in an image share no page."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        h.update(b"extra\0" + extra)
    return h.digest()


def is_cache_salt(value) -> bool:
    """Whether `value` can salt a request's pages: a non-empty string (None means unsalted)."""
    return isinstance(value, str) and bool(value)


def salt_digest(cache_salt: Optional[str]) -> Optional[bytes]:
    """The parent digest of the first block of a request salted with `cache_salt` (None: no salt).

    It is 16 bytes like every chained digest, while the unsalted root is the 4 bytes
    `b"root"`, so no salted chain can start like an unsalted one.
    """
    if cache_salt is None:
        return None
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8"), digest_size=16).digest()


def adapter_digest(parent: Optional[bytes], adapter: bytes) -> bytes:
    """The parent digest of the first block of a request run with a LoRA adapter whose weights are named
    by `adapter` (a digest of them), chained from the request's salt root `parent` (None: unsalted).
    K/V computed under one adapter's weights is valid for none other, nor for the base model, so its
    pages get names of their own: no hit across adapters or with the base."""
    return hashlib.blake2b(b"lora\0" + (parent or b"root") + adapter, digest_size=16).digest()


def weights_digest(parent: Optional[bytes], epoch: int) -> Optional[bytes]:
    """The parent digest of the first block of a request admitted after the engine's weights were
    replaced `epoch` times (`serving.features.weight_updates`), chained from its salt root `parent`. K/V computed
    under one set of weights is valid under no other, so each update starts new names and no request
    ever hits a page (or a host-tier block) written under older weights. Epoch 0, the weights the
    engine was built with, keeps `parent` as it is: an engine that never updates names its pages as
    before, and as the router does (`serving.routing.router_index`)."""
    if epoch == 0:
        return parent
    return hashlib.blake2b(b"weights\0" + (parent or b"root") + int(epoch).to_bytes(8, "little"),
                           digest_size=16).digest()


NO_PAGE = -1  # a block-table entry whose page was released (before the sliding window)


class HostHit:
    """A prefix block found in the host tier (`BlockManager.host`), not in a device page: `allocate`
    restores it into a free page."""

    __slots__ = ("digest",)

    def __init__(self, digest: bytes):
        self.digest = digest

    def __repr__(self):
        return f"HostHit({self.digest.hex()[:8]})"


def releasing_window(cfg) -> Optional[int]:
    """The window before which a sequence's pages may be released: the widest of the model's
    sliding windows when every layer has one; None when some layer attends to the whole context."""
    if cfg.sliding_window is None:
        return None
    windows = cfg.layer_windows()
    return None if any(w is None for w in windows) else max(windows)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 window: Optional[int] = None):
        """`window`: the widest sliding window of a model whose every layer slides (None: some layer
        sees the whole context, or pages must stay, e.g. for a draft model sharing the tables)."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_pages
        self.block_hash: list[Optional[bytes]] = [None] * num_pages
        # Front = next to be allocated (and evicted). Values unused.
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(num_pages))
        self.cached: dict[bytes, int] = {}
        self.tables: dict[int, list[int]] = {}
        self._registered: dict[int, int] = {}  # seq_id -> leading blocks already registered
        self.window = window
        self._released: dict[int, int] = {}  # seq_id -> leading blocks released (before the window)
        self.num_released_pages = 0  # pages released before a window (cumulative)
        self.host = None  # the host tier of the prefix cache, if any (see the module docstring)

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_pages - len(self.free)

    def usage(self) -> float:
        """Fraction of pages held by live sequences (cached-but-free pages count as free)."""
        return self.num_used_blocks / self.num_pages

    def table(self, seq) -> list[int]:
        return self.tables.get(seq.seq_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _hashes_upto(self, seq, num_blocks: int) -> list[bytes]:
        """Extends `seq.block_hashes` to cover its first `num_blocks` full blocks."""
        hashes, ps, toks = seq.block_hashes, self.page_size, seq.token_ids
        extra = getattr(seq, "block_extra", None)  # image digests of the block's tokens (a multimodal prompt)
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_digest(hashes[-1] if hashes else seq.hash_root, toks[i * ps:(i + 1) * ps],
                                       extra(i * ps, (i + 1) * ps) if extra is not None else b""))
        return hashes

    def block_digests(self, seq, num_blocks: int) -> list[bytes]:
        """The digests of `seq`'s first `num_blocks` full blocks (whether cached or not)."""
        return self._hashes_upto(seq, num_blocks)[:num_blocks]

    def lookup_prefix(self, seq) -> list:
        """Cached pages holding the longest prefix of `seq`'s tokens; no side effects. With a host
        tier, a block only it holds is a `HostHit` in its place.

        At most `(num_tokens - 1) // page_size` blocks: the last token is always
        computed again so the step has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.page_size
        hits = []
        for h in self._hashes_upto(seq, limit):
            b = self.cached.get(h)
            if b is None:
                if self.host is None or not self.host.holds(h):
                    break
                b = HostHit(h)
            hits.append(b)
        return hits

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, seq, num_new_tokens: int, computed_blocks: Iterable[int] = ()) -> Optional[list]:
        """Makes room for `num_new_tokens` more tokens of `seq` (after `computed_blocks`,
        prefix-cache hits that are appended to its table first).

        Returns the copy-on-write (src, dst) page pairs to perform before the
        step, or None when the free pool cannot cover it, in which case nothing
        changed but the release of pages before the sliding window (always valid).
        A `HostHit` among `computed_blocks` takes a free page, into which the host
        tier restores it.
        """
        if self.window is not None:
            self._release_before_window(seq)
        table = self.tables.get(seq.seq_id)
        ps = self.page_size
        if table is not None and not computed_blocks:  # fast path: a decode inside its last page
            start = seq.num_computed_tokens
            if start + num_new_tokens <= len(table) * ps and (
                    num_new_tokens == 0 or self.ref[table[start // ps]] == 1):
                return []
        computed_blocks = list(computed_blocks)
        if table is None:
            table = []
        start = seq.num_computed_tokens + len(computed_blocks) * ps
        need = max(0, self.blocks_needed(start + num_new_tokens) - len(table) - len(computed_blocks))
        write_block = start // ps
        cow = num_new_tokens > 0 and write_block < len(table) and self.ref[table[write_block]] > 1
        restores = sum(1 for b in computed_blocks if isinstance(b, HostHit))
        reclaimed = sum(1 for b in computed_blocks
                        if not isinstance(b, HostHit) and self.ref[b] == 0)  # hits now sitting in the free queue
        if need + cow + restores > len(self.free) - reclaimed:
            return None
        for b in computed_blocks:
            if not isinstance(b, HostHit):
                if self.ref[b] == 0:
                    del self.free[b]
                self.ref[b] += 1
        if restores:  # after the device hits left the free queue, so none of them is popped
            computed_blocks = [self._restore(b.digest) if isinstance(b, HostHit) else b for b in computed_blocks]
        table.extend(computed_blocks)
        self.tables[seq.seq_id] = table
        if computed_blocks:
            self._registered[seq.seq_id] = max(self._registered.get(seq.seq_id, 0), len(table))
        copies = []
        if cow:
            old = table[write_block]
            new = self._pop_free()
            self.ref[old] -= 1
            table[write_block] = new
            copies.append((old, new))
        for _ in range(need):
            table.append(self._pop_free())
        return copies

    def _release_before_window(self, seq) -> None:
        """Drops `seq`'s hold on the pages wholly before the window of its next token: that query
        (position `num_computed_tokens`, the earliest any later step computes) sees keys from
        `num_computed_tokens - window + 1` on."""
        table = self.tables.get(seq.seq_id)
        if not table or seq.keeps_all_pages:
            return
        done = self._released.get(seq.seq_id, 0)
        upto = min(len(table), max(0, seq.num_computed_tokens - self.window + 1) // self.page_size)
        if upto <= done:
            return
        self.register_full_blocks(seq)  # first, so the released pages stay hittable (their K/V is written)
        pages = table[done:upto]
        table[done:upto] = [NO_PAGE] * (upto - done)
        self._released[seq.seq_id] = upto
        self.num_released_pages += upto - done
        self._release(pages)

    def _pop_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # eviction from the prefix cache
            if self.cached.get(h) == b:
                del self.cached[h]
                if self.host is not None:
                    self.host.evicting(b, h)
            self.block_hash[b] = None
        self.ref[b] = 1
        return b

    def _restore(self, digest: bytes) -> int:
        """A free page for the host tier to restore the block `digest` into, registered under it."""
        b = self._pop_free()
        self.cached[digest] = b
        self.block_hash[b] = digest
        self.host.restoring(digest, b)
        return b

    def fork(self, parent, child) -> None:
        """`child` shares all of `parent`'s pages (copy-on-write on the first write)."""
        table = list(self.tables.get(parent.seq_id, []))
        for b in table:
            if b != NO_PAGE:
                self.ref[b] += 1
        self.tables[child.seq_id] = table
        self._registered[child.seq_id] = self._registered.get(parent.seq_id, 0)
        if parent.seq_id in self._released:
            self._released[child.seq_id] = self._released[parent.seq_id]

    def free_seq(self, seq) -> None:
        """Drops `seq`'s hold on its pages; pages nobody holds go back to the free queue."""
        table = self.tables.pop(seq.seq_id, None)
        self._registered.pop(seq.seq_id, None)
        self._released.pop(seq.seq_id, None)
        if table:
            self._release(table)

    def trim(self, seq, num_tokens: int) -> int:
        """Releases `seq`'s trailing pages beyond the first `num_tokens` tokens (rejected
        speculative tokens' pages); returns how many pages it dropped."""
        table = self.tables.get(seq.seq_id)
        keep = self.blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return 0
        dropped = table[keep:]
        del table[keep:]
        self._release(dropped)
        return len(dropped)

    def _release(self, pages: list[int]) -> None:
        """One hold less on each of `pages`; a page nobody holds any more joins the free queue: at its
        end (evicted last) while it is cached and may still be hit, at its front (reused first) if not.
        Last page first, so a sequence's tail is evicted before the prefix other prompts share."""
        for b in reversed(pages):
            if b == NO_PAGE:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)

    def register_full_blocks(self, seq) -> None:
        """Enters `seq`'s newly completed full blocks into the prefix cache.

        Call once the step that computes them was dispatched (any step that reads
        them runs after it). Only blocks whose tokens the host knows are hashed: a
        token sampled by a step still running waits for the next call. A block
        whose digest is already cached under another page stays unregistered (the
        cached copy serves future hits).
        """
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq.seq_id)
        if not table:
            return
        full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.page_size, len(table))
        done = self._registered.get(seq.seq_id, 0)
        if full <= done:
            return
        hashes = self._hashes_upto(seq, full)
        for i in range(done, full):
            b, h = table[i], hashes[i]
            if b != NO_PAGE and self.block_hash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
        self._registered[seq.seq_id] = full

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block that no sequence holds; returns how many."""
        n = 0
        for b in list(self.free):
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
                self.free.move_to_end(b, last=False)
                n += 1
        return n

    # --- checking ------------------------------------------------------------------------
    def check_invariants(self, live_seq_ids: Optional[Iterable[int]] = None) -> None:
        """Raises AssertionError when the pool's bookkeeping is inconsistent.

        Every page is either free (count 0, in the free queue exactly once) or
        held, and its count equals the number of tables holding it; no table
        holds a page twice; the cache map and the per-page digests agree; and
        the host tier's own (`host.check_invariants`), when there is one.
        """
        counts = [0] * self.num_pages
        for sid, table in self.tables.items():
            held = [b for b in table if b != NO_PAGE]
            assert len(set(held)) == len(held), f"seq {sid} holds a page twice: {table}"
            assert NO_PAGE not in table[self._released.get(sid, 0):], f"seq {sid}: a released page past its window"
            for b in held:
                counts[b] += 1
        assert counts == self.ref, "reference counts disagree with the block tables"
        free = set(self.free)
        assert len(free) == len(self.free)
        for b in range(self.num_pages):
            assert (b in free) == (self.ref[b] == 0), f"page {b}: ref {self.ref[b]}, free={b in free}"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache map points at page {b} with another digest"
        if live_seq_ids is not None:
            live = set(live_seq_ids)
            assert set(self.tables) <= live, f"tables of dead sequences: {set(self.tables) - live}"
        if self.host is not None:  # and the host tier's own bookkeeping
            self.host.check_invariants()
