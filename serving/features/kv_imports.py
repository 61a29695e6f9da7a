"""Requests that resume a prefill another engine computed: admitted before each step is scheduled.

Such a request arrives with its prompt's K/V and its first sampled token (the
request argument `kv_import`, given by whoever received the payload:
`serving.disaggregation`), checked at admission against the request (its
prompt, its adapter: the parts before this one have admitted it). Before every
schedule the queue is served in order: the first token is taken as if sampled
here, then the request waits for a seat and pages (`Scheduler.admit_computed`),
and its K/V is written into them by the
import's own device program (`kv_import.write`, through the runner's
`run_on_cache`). A request that can never fit the pool ends with an error.
"""

from __future__ import annotations

import time

from serving.core.input_batch import sampling_row
from serving.core.scheduler import PoolTooSmall
from serving.core.step_parts import StepPart


ARG = "kv_import"  # the request argument: the shipped prefill (a `kv_transfer.KVImport`)
KEY = "kv_import"  # the part's entry of `Request.part_state`, until its K/V is written


class KVImports(StepPart):
    takes_args = (ARG,)

    def __init__(self, scheduler, runner, take_token, before_write=None, engine=None):
        """`take_token(seq, token, row, result, now, it)`: the engine's handling of a sampled token.
        `before_write()`: called before an import writes the cache (the host tier copies evicted pages out
        first)."""
        self.scheduler, self.runner, self.take_token = scheduler, runner, take_token
        self.pending: list = []  # requests in arrival order
        self.before_write = before_write
        self.engine = engine

    @classmethod
    def for_engine(cls, engine, before_write=None) -> "KVImports":
        return cls(engine.scheduler, engine.runner, engine.take_token, before_write, engine)

    def admit(self, req) -> None:
        imp = req.part_args.get(ARG)
        if imp is not None:
            imp.check(self.engine, req)  # (an InvalidParameterError naming what does not match)
            req.part_state[KEY] = imp

    def enqueue(self, req) -> bool:
        """A request with a shipped prefill waits here for its seat and pages; the others go to the scheduler."""
        if KEY not in req.part_state:
            return False
        self.pending.append(req)
        return True

    def abort(self, req) -> None:
        if req in self.pending:
            self.pending.remove(req)

    def before_schedule(self, touched: dict, it) -> None:
        now = time.monotonic()
        while self.pending:
            req = self.pending[0]
            seq, imp = req.seqs[0], req.part_state[KEY]
            if not seq.is_finished and seq.num_output_tokens == 0:  # the shipped first token, as if sampled here
                if req.params.seed is None:
                    req.seed = imp.seed
                    req.sampling_row = sampling_row(req)
                seq.token_ids.append(imp.first_token)
                req.metrics.first_scheduled_time = now
                self.take_token(seq, imp.first_token, 0, imp.step_result(req.params.logprobs), now, it)
                it.num_generation_tokens += 1
                touched[req.request_id] = req
            if seq.is_finished:  # finished on its first token, or aborted while pending
                self.pending.pop(0)
                continue
            try:
                admitted = self.scheduler.admit_computed(seq)
            except PoolTooSmall as e:
                req.error = f"request {req.request_id}: {e}"
                self.scheduler.finish(seq, "error")
                touched[req.request_id] = req
                self.pending.pop(0)
                continue
            if admitted is None:
                break  # wait for a seat or pages
            table, start = admitted
            n = seq.num_prompt_tokens
            if start < n:
                if self.before_write is not None:
                    self.before_write()
                imp.write(self.runner, table, start, n)
            del req.part_state[KEY]  # the host copy is no longer needed
            self.pending.pop(0)
