"""Where a run's step time goes: each step kind against its own roof, and what padding adds.

Input: the engine's per-step observations (`serving.core.stats.IterationStats`, from
`StatsLog.drain()`), which carry each step's bucket (T tokens, S rows, P pages per sequence)
and its sequences' new tokens and context lengths, together with the model's costs
(`ModelCosts`) and the two ceilings measured in the same run (a matmul rate and a read
bandwidth). Output: a table per step kind -- "prefill" (every sequence brings several new
tokens), "mixed" (prefill chunks and decodes together) and "decode xN" by token bucket N --
plus the tail (steps with few running sequences) and the whole run.

For each kind:
* `seconds`, `host_seconds`: wall time of its steps and the host's part of it. Take the steps from
  an engine that runs one step at a time (`async_scheduling=False`): with overlapped
  scheduling a step's `device_seconds` is the wait for the step before it;
* `roof_seconds`: the least time the step's *useful* work could take on this machine: the
  larger of its useful FLOPs at the matmul rate and the bytes it must read (the weights once,
  the live K/V) at the read bandwidth; `roof_fraction` = roof / actual, and `bound` says which
  of the two set the roof;
* `padded_token_share`: the share of the computed tokens (T of each step) that were padding;
* `padded_kv_share`: the share of the query-key positions attention computed that were masked
  off: past a sequence's context in a gathered page bucket or a partial page, after the query in
  a multi-row item, or rows of padding (`attention_positions`);
* `attention_flop_share`: attention's share of the step's computed FLOPs (padding included),
  an estimate from the shapes, not a measured time.

Useful FLOPs count the matrix products of the tokens computed (2 x matmul weights per token),
the LM head of the rows sampled (2 x vocab x hidden per row), and attention over each query's
visible context (4 x heads x head_dim per query-key pair per layer).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    matmul_params: int  # weights every token multiplies (the layers' projections)
    head_params: int  # the LM head's weights (vocab x hidden), multiplied per logit row
    weight_bytes: int  # bytes a step reads of weights (all but the embedding table)
    kv_bytes_per_position: int  # K and V of one position in every layer
    attention_flops_per_pair: int  # 4 x heads x head_dim x layers: one query-key pair, QK^T and PV

    @classmethod
    def of(cls, cfg, params) -> "ModelCosts":
        from model.params import param_bytes

        head = cfg.vocab_size * cfg.hidden_size
        embed = cfg.vocab_size * cfg.hidden_size
        norms = cfg.hidden_size * (2 * cfg.num_layers + 1)
        total = sum(int(x.size) for x in _leaves(params))
        matmul = total - embed - (0 if params.lm_head is None else head) - norms
        itemsize = params.embed.dtype.itemsize
        weight_bytes = param_bytes(params) - params.embed.nbytes + cfg.hidden_size * itemsize
        kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
        return cls(matmul, head, weight_bytes, kv, 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers)


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def kind_of(q_lens: Sequence[int], bucket) -> str:
    """"prefill", "mixed" or "decode xT" (T: the step's token bucket)."""
    if all(n == 1 for n in q_lens):
        return f"decode x{bucket[0]}"
    return "mixed" if any(n == 1 for n in q_lens) else "prefill"


def visible_pairs(q_len: int, kv_len: int) -> int:
    """Query-key pairs a sequence's `q_len` new tokens attend over, causally, ending at `kv_len`."""
    return q_len * kv_len - q_len * (q_len - 1) // 2


def attention_positions(q_lens, kv_lens, bucket, page_size: int, rows_per_item: Callable[[int, int], int],
                        item_block_pages: Optional[int] = None, pair_pages: int = 1) -> int:
    """Query-key positions attention computes for a step: `kernels_pallas.xla_attention`'s work.

    One-row items (every sequence of a decode bucket, and the decodes of a mixed step) visit their
    row's live pages `pair_pages` at a time (the last block masked past the row's last page). Larger
    items (`rows_per_item(T, S)` query rows each) read their sequence's page table `item_block_pages`
    pages at a time (the whole P-page table when None), up to the block holding the key their last row
    sees, and compute every row of the item against each block they read."""
    T, S, P = bucket
    b = rows_per_item(T, S)
    block = (item_block_pages or P) * page_size
    pair = min(pair_pages, P)
    total = 0
    for n, kv in zip(q_lens, kv_lens):
        if b == 1 or n == 1:  # row i at position kv - n + i sees (kv - n + i) // page_size + 1 pages
            total += sum(-(-((kv - n + i) // page_size + 1) // pair) * pair for i in range(n)) * page_size
            continue
        for first in range(0, n, b):
            end = kv - n + min(first + b, n)  # keys before this are visible to the item's last row
            total += b * -(-end // block) * block
    return total


@dataclasses.dataclass
class _Totals:
    steps: int = 0
    seconds: float = 0.0
    host_seconds: float = 0.0
    tokens: int = 0
    computed_tokens: int = 0
    sampled_rows: int = 0
    useful_flops: float = 0.0
    computed_flops: float = 0.0
    attention_flops: float = 0.0
    live_positions: int = 0
    computed_positions: int = 0
    roof_seconds: float = 0.0
    flop_seconds: float = 0.0
    byte_seconds: float = 0.0
    running: int = 0

    def add(self, s, costs: ModelCosts, page_size: int, matmul_rate: float, read_bw: float, rows_per_item,
            item_block_pages, pair_pages):
        T, S, P = s.bucket
        pairs = sum(visible_pairs(n, kv) for n, kv in zip(s.q_lens, s.kv_lens))
        computed_pairs = attention_positions(s.q_lens, s.kv_lens, s.bucket, page_size, rows_per_item,
                                             item_block_pages, pair_pages)
        rows = s.num_generation_tokens
        useful = 2 * costs.matmul_params * s.num_tokens + 2 * costs.head_params * rows \
            + costs.attention_flops_per_pair * pairs
        attn = costs.attention_flops_per_pair * computed_pairs
        computed = 2 * costs.matmul_params * T + 2 * costs.head_params * S + attn
        flop_s = useful / matmul_rate
        byte_s = (costs.weight_bytes + costs.kv_bytes_per_position * sum(s.kv_lens)) / read_bw
        self.steps += 1
        self.seconds += s.host_seconds + s.device_seconds
        self.host_seconds += s.host_seconds
        self.tokens += s.num_tokens
        self.computed_tokens += T
        self.sampled_rows += rows
        self.useful_flops += useful
        self.computed_flops += computed
        self.attention_flops += attn
        self.live_positions += pairs
        self.computed_positions += computed_pairs
        self.roof_seconds += max(flop_s, byte_s)
        self.flop_seconds += flop_s
        self.byte_seconds += byte_s
        self.running += s.num_seqs

    def summary(self, wall: Optional[float] = None) -> dict:
        out = {
            "steps": self.steps, "seconds": self.seconds, "host_seconds": self.host_seconds,
            "mean_running_sequences": self.running / max(1, self.steps),
            "tokens": self.tokens, "computed_tokens": self.computed_tokens,
            "padded_token_share": 1 - self.tokens / max(1, self.computed_tokens),
            "padded_kv_share": 1 - self.live_positions / max(1, self.computed_positions),
            "attention_flop_share": self.attention_flops / max(1.0, self.computed_flops),
            "useful_GFLOP": self.useful_flops / 1e9, "computed_GFLOP": self.computed_flops / 1e9,
            "roof_seconds": self.roof_seconds,
            "roof_fraction": self.roof_seconds / self.seconds if self.seconds else 0.0,
            "bound": "compute" if self.flop_seconds >= self.byte_seconds else "memory",
            "ms_per_step": 1e3 * self.seconds / max(1, self.steps),
        }
        if wall:
            out["share_of_wall"] = self.seconds / wall
        return out


def _kind_order(kind: str):
    return (0, 0) if kind == "prefill" else (1, 0) if kind == "mixed" else (2, int(kind.split("x")[1]))


def breakdown(steps, costs: ModelCosts, page_size: int, matmul_rate: float, read_bw: float,
              rows_per_item: Callable[[int, int], int], tail_seqs: int, item_block_pages: Optional[int] = None,
              pair_pages: int = 1) -> dict:
    """The per-kind table, the tail (steps with at most `tail_seqs` running sequences) and the run's
    totals, over the steps that computed something (`IterationStats` with a bucket).
    `rows_per_item` / `item_block_pages` / `pair_pages`: how the attention backend cuts its work
    (`attention_positions`)."""
    steps = [s for s in steps if s.bucket is not None and s.num_tokens > 0]
    kinds: dict[str, _Totals] = {}
    tail, total = _Totals(), _Totals()
    args = (costs, page_size, matmul_rate, read_bw, rows_per_item, item_block_pages, pair_pages)
    for s in steps:
        kinds.setdefault(kind_of(s.q_lens, s.bucket), _Totals()).add(s, *args)
        total.add(s, *args)
        if s.num_seqs <= tail_seqs:
            tail.add(s, *args)
    wall = total.seconds
    return {"kinds": {k: kinds[k].summary(wall) for k in sorted(kinds, key=_kind_order)},
            "tail": {"max_running_sequences": tail_seqs, **tail.summary(wall)},
            "total": {**total.summary(wall),
                      "useful_flop_rate_fraction_of_matmul_rate": total.useful_flops / wall / matmul_rate
                      if wall else 0.0}}


def format_table(table: dict) -> str:
    """The breakdown as fixed-width text, one line per kind, then the tail and the total."""
    head = (f"{'kind':<12}{'steps':>6}{'s':>7}{'%wall':>6}{'ms/step':>8}{'run':>5}{'roof':>6}{'bound':>8}"
            f"{'pad tok':>8}{'pad kv':>7}{'attn':>6}{'host':>6}")
    lines = [head]
    rows = list(table["kinds"].items()) + [("tail", table["tail"]), ("total", table["total"])]
    for name, r in rows:
        lines.append(f"{name:<12}{r['steps']:>6}{r['seconds']:>7.2f}{100 * r.get('share_of_wall', 0):>5.0f}%"
                     f"{r['ms_per_step']:>8.1f}{r['mean_running_sequences']:>5.0f}{r['roof_fraction']:>6.2f}"
                     f"{r['bound']:>8}{100 * r['padded_token_share']:>7.0f}%{100 * r['padded_kv_share']:>6.0f}%"
                     f"{100 * r['attention_flop_share']:>5.0f}%{100 * r['host_seconds'] / max(r['seconds'], 1e-9):>5.0f}%")
    return "\n".join(lines)
