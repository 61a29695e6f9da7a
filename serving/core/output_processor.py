"""What a sampled token does to its request on the host: the output side of the engine.

Per token, `OutputProcessor.on_token` records the token's timing (time to
first token, inter-token latency) and logprobs, detokenizes incrementally,
checks the stop conditions (EOS, stop token ids, stop strings, length) and
finishes the sequence through the scheduler when one is met. `make_output`
turns a request into the `RequestOutput` callers see, holding back text that
may still turn out to begin a stop string. The token itself is appended to
the sequence by whoever drew it (the scheduler, or the speculative decoder
for verified drafts).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence as Seq

from serving.core.detokenizer import make_detokenizer
from serving.core.outputs import CompletionOutput, Logprob, RequestOutput
from serving.core.sequence import Request, Sequence
from serving.core.stats import IterationStats, StatsLog


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, finish: Callable, stats_log: StatsLog):
        """`finish(seq, reason, stop_reason)` ends a sequence (the scheduler's `finish`)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.finish = finish
        self.stats_log = stats_log

    def on_token(self, seq: Sequence, tok: int, row: int, result, now: float, it: IterationStats) -> None:
        """Takes in `tok`, just appended to `seq`, drawn in row `row` of the step's `result`."""
        req = seq.request
        p = req.params
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            it.time_to_first_tokens.append(now - req.metrics.arrival_time)
            self.stats_log.prompt_tokens += len(req.prompt_token_ids)
        elif seq.last_token_time is not None:
            it.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = req.metrics.last_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(result, row, tok, p.logprobs))
            seq.cumulative_logprob += float(result.chosen_logprob[row])
            seq.keep_sizes.append(int(result.kept[row]))
        reason = stop_reason = None
        held = seq.num_output_tokens < p.min_tokens  # only the length may end it yet
        if not held and not p.ignore_eos and tok in req.eos_token_ids:
            reason = "stop"
        elif not held and tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif self.tokenizer is not None:
            if seq.detokenizer is None:
                seq.detokenizer = make_detokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                                   p.spaces_between_special_tokens)
            delta = seq.detokenizer.push(tok)
            if delta:
                seq.text = seq.detokenizer.text
                if p.stop and not held:
                    hit = _find_stop(seq.text, len(delta), p.stop)
                    if hit is not None:
                        at, s = hit
                        seq.text = seq.text[:at + len(s)] if p.include_stop_str_in_output else seq.text[:at]
                        reason, stop_reason = "stop", s
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if stop_reason is None or not isinstance(stop_reason, str):
                if seq.detokenizer is not None and seq.detokenizer.flush():
                    seq.text = seq.detokenizer.text
            self.finish(seq, reason, stop_reason)

    def prompt_logprobs(self, seq: Sequence, result, row: int, p0: int, p1: int) -> None:
        """Records the logprobs of prompt positions p0..p1-1, computed in rows `row`..."""
        req = seq.request
        k = req.params.prompt_logprobs
        for j in range(p1 - p0):
            target = req.prompt_token_ids[p0 + j + 1]
            req.prompt_logprobs.append(self._logprob_entry(result, row + j, target, k))

    def _token_text(self, tok: int) -> Optional[str]:
        if self.tokenizer is None:
            return None
        return self.tokenizer.token_text(int(tok))

    def _logprob_entry(self, result, row: int, tok: int, k: int) -> dict:
        entry = {tok: Logprob(float(result.chosen_logprob[row]), int(result.rank[row]), self._token_text(tok))}
        for j in range(k):
            tid = int(result.top_ids[row, j])
            if tid not in entry:
                entry[tid] = Logprob(float(result.top_logprobs[row, j]), j + 1, self._token_text(tid))
        return entry

    @staticmethod
    def make_output(req: Request) -> RequestOutput:
        """The request as callers see it now (cumulative: every sample's text and tokens so far)."""
        finished = req.is_finished
        outs = []
        holdback = max((len(s) for s in req.params.stop), default=1) - 1
        for seq in sorted(req.seqs, key=lambda s: s.sample_index):
            text = seq.text
            if holdback and not seq.is_finished:
                text = text[:max(0, len(text) - holdback)]  # may be the start of a stop string
            outs.append(CompletionOutput(
                index=seq.sample_index, text=text, token_ids=seq.token_ids[seq.num_prompt_tokens:],
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                weight_versions=list(seq.weight_versions),
                keep_sizes=list(seq.keep_sizes) if seq.keep_sizes is not None else None))
        plp = list(req.prompt_logprobs) if req.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), plp, outs, finished,
                             req.metrics, req.seqs[0].num_cached_tokens, req.pooled)


def _find_stop(text: str, delta_len: int, stops: Seq[str]):
    """The earliest stop string that ends inside the newly added text, as (index, string)."""
    best = None
    for s in stops:
        start = max(0, len(text) - delta_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
