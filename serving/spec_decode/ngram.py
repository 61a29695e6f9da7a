"""Prompt-lookup drafting: continue the sequence the way it continued before.

For a sequence ending in the n-gram `g` (n from `max_n` down to `min_n`), find
the most recent earlier occurrence of `g` in the sequence's own tokens (prompt
and output) and propose the tokens that followed it. Needs no second model;
pays off on text that repeats its context (code, extraction, edits). The draft
is a point mass, so verification accepts a token with the target's
probability of it (see `rejection_sampler`).
"""

from __future__ import annotations

import numpy as np


# The n-gram sizes matched, longest first (vLLM's prompt_lookup_max / prompt_lookup_min).
MAX_N, MIN_N = 4, 1


class NgramProposer:
    """Host-side; `propose` looks at the tail of every sequence that decodes next step."""

    draft_probs = None  # drafts are point masses: no distributions on device

    def __init__(self, num_speculative_tokens: int, max_n: int = MAX_N, min_n: int = MIN_N, window: int = 1024):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k = num_speculative_tokens
        self.max_n = max_n
        self.min_n = min_n
        self.window = window  # only the last `window` tokens are searched (bounded host time)

    def lookup(self, tokens, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        arr = np.asarray(tokens[-self.window:], np.int32)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n:]
            # Candidate starts whose n-gram is followed by at least one token.
            cand = np.flatnonzero(arr[:length - n] == suffix[0])
            for j in range(1, n):
                if not len(cand):
                    break
                cand = cand[arr[cand + j] == suffix[j]]
            if len(cand):
                start = int(cand[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def propose(self, seqs_and_limits) -> tuple[dict[int, list[int]], None]:
        """{seq_id: drafts} for (sequence, most drafts allowed) pairs of decoding sequences."""
        drafts = {}
        for seq, limit in seqs_and_limits:
            d = self.lookup(seq.token_ids, min(self.k, limit))
            if d:
                drafts[seq.seq_id] = d
        return drafts, None

    def forget(self, live_seq_ids) -> None:
        """Nothing per sequence to drop."""

    def warm_up(self) -> dict:
        return {"seconds": 0.0, "compiled": 0, "shapes": 0}
