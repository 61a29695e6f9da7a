"""What a feature may add to an engine step, declared once: the `StepPart` interface.

`Engine.step` is four phases: schedule, pack, run, process. The plain engine
needs nothing else; a feature that must act inside a step (speculative
decoding proposes drafts before scheduling and takes the verified tokens
after; shipped prefills are admitted before scheduling; the host KV tier
copies pages out and back in once the step is scheduled) is a part: an object
with these hooks, which the engine calls in order for every part it holds.
A part changes only its own state and what it is handed (the step's packed
batch, the requests it touched), so adding a feature adds a part, not a
branch in the step.

Inputs a part gives the device travel in the packed batch (`StepBatch`), and
so through the one step program (`model_runner._step`).
"""

from __future__ import annotations

from typing import Iterable

NO_WARM_UP = {"seconds": 0.0, "compiled": 0, "shapes": 0}


class StepPart:
    """The hooks of one feature; each does nothing unless the feature overrides it."""

    def before_schedule(self, touched: dict, it) -> None:
        """Runs before the scheduler: requests that produced output go into `touched` ({request id:
        request}), their first tokens' statistics into `it` (the step's `IterationStats`)."""

    def after_schedule(self, out) -> None:
        """Runs once the step is scheduled (`out`: its `SchedulerOutput`), before anything of it (page
        copies, the step itself) is dispatched: the last moment to read pages the step will overwrite."""

    def pack(self, batch) -> None:
        """Adds the part's inputs to the packed step (`input_batch.StepBatch`) before it is dispatched."""

    def new_tokens(self, out, sampled) -> Iterable[tuple]:
        """(sequence, token, logit row) the part takes from a finished step beyond the scheduler's own
        (`Scheduler.update`), each token appended to its sequence just before it is yielded."""
        return ()

    def after_step(self) -> None:
        """Runs once the step's outputs are made."""

    def warm_up(self) -> dict:
        """Compiles what the part runs on the device itself; {"seconds", "compiled", "shapes"}."""
        return dict(NO_WARM_UP)
