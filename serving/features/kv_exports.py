"""Requests whose prompt K/V is shipped to another engine once their first token is drawn (the prefill side of
disaggregated serving, `serving.disaggregation`).

Such a request names its exporter as the request argument `kv_export` (a `kv_transfer.Exporter`). The part
keeps every prompt page of it held (`Request.keeps_all_pages`: no sliding window releases them early) and,
when the first token is about to enter the output (`before_output`, before a stop condition can free the
pages), hands the exporter the prompt's pages, which it gathers on the device through the runner.
"""

from __future__ import annotations

import weakref

from serving.core.step_parts import StepPart

ARG = "kv_export"  # the request argument: the exporter
KEY = "kv_export"  # the part's entry of `Request.part_state`


class KVExports(StepPart):
    takes_args = (ARG,)

    def __init__(self):
        self._engine = lambda: None

    def attach(self, engine) -> None:
        self._engine = weakref.ref(engine)

    def admit(self, request) -> None:
        exporter = request.part_args.get(ARG)
        if exporter is None:
            return
        exporter.check(self._engine(), request)
        request.part_state[KEY] = exporter
        request.keeps_all_pages = True

    def before_output(self, seq, token: int, result, row: int) -> None:
        exporter = seq.request.part_state.get(KEY)
        if exporter is None or seq.num_output_tokens != 1:
            return
        engine = self._engine()
        bm = engine.block_manager
        table = bm.table(seq)[:bm.blocks_needed(seq.num_prompt_tokens)]
        exporter.export(engine.runner, seq.request, table, int(token), result, row)
