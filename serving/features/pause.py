"""Pausing generation (vLLM's `pause_generation` / `resume_generation`, for RL loops that update the weights
between two rollout phases), as a step part that holds the engine's steps.

Modes of `pause(engine, mode)`:

* "abort": every unfinished request ends at once, its tokens so far returned as its final output
  (finish_reason "abort"), never lost; then the steps are held.
* "wait": no request that has not started is admitted (the part's gate), those that have run on until they
  finish, and the steps are held once none is left (`state` says "draining" until then).
* "keep": the steps are held at once; running requests stay as they are (their pages, their tokens so far)
  and continue on `resume`, under whatever weights the engine has then (partial rollouts).

While held, `Engine.step` schedules nothing (it only finishes a step in flight); new requests are taken and
wait. `resume(engine, recompute_kv=True)` first sends every running sequence back to the queue with its pages
freed and empties the prefix cache, so what continues after a weight update recomputes its K/V under the new
weights; `recompute_kv=False` keeps the K/V computed before (cheaper, slightly off-policy).
"""

from __future__ import annotations

import weakref

from serving.core.scheduler import AdmissionGate
from serving.core.step_parts import StepPart

MODES = ("abort", "wait", "keep")


class PauseError(ValueError):
    """A pause or resume the engine cannot do (an unknown mode, an engine without the part): a 400 over HTTP."""


class _NewRequestsWait(AdmissionGate):
    """While generation pauses, a request that has not started is not admitted (it keeps its place)."""

    def __init__(self, part: "GenerationPause"):
        self.part = part

    def needs(self, seq) -> bool:
        return seq.request.metrics.first_scheduled_time is None

    def fits(self, seq, running) -> bool:
        return self.part.state == "running" or not self.needs(seq)


class GenerationPause(StepPart):
    """The part: its state ("running", "draining", "paused") and the gate and step hold that enforce it."""

    def __init__(self):
        self.state = "running"
        self._engine = lambda: None

    def attach(self, engine) -> None:
        self._engine = weakref.ref(engine)

    def gate(self):
        return _NewRequestsWait(self)

    def holds_steps(self) -> bool:
        return self.state == "paused"

    def after_step(self) -> None:
        if self.state == "draining" and not _started(self._engine()):
            self.state = "paused"


def _started(engine) -> list:
    """The engine's unfinished requests that have been scheduled at least once."""
    return [r for r in engine.requests.values() if r.metrics.first_scheduled_time is not None]


def _part(engine) -> GenerationPause:
    part = engine.part(GenerationPause)
    if part is None:
        raise PauseError("this engine cannot pause: it was built without the pause part "
                         "(serving.features.build_parts adds it)")
    return part


def pause(engine, mode: str = "abort") -> str:
    """Pauses generation (see the module docstring); returns the state ("paused", or "draining" under "wait"
    while started requests remain). Run it where the engine's steps run (its thread)."""
    if mode not in MODES:
        raise PauseError(f"mode: must be one of {list(MODES)}, got {mode!r}")
    part = _part(engine)
    if mode == "abort":
        engine.abort_request(list(engine.requests), emit=True)
    part.state = "draining" if mode == "wait" and _started(engine) else "paused"
    return part.state


def resume(engine, recompute_kv: bool = False) -> int:
    """Resumes generation; with `recompute_kv`, the requests that continue recompute their K/V first (returns
    how many sequences were sent back to do so)."""
    part = _part(engine)
    recomputed = 0
    if recompute_kv:
        if part.state == "running":
            raise PauseError("recompute_kv: generation is not paused (pause first, then resume with it)")
        engine.finish_in_flight()  # every running sequence has its tokens on the host
        recomputed = engine.scheduler.preempt_running()
        engine.reset_prefix_cache()
    part.state = "running"
    return recomputed


def state(engine) -> str:
    """"running", "draining" (mode "wait": started requests still finishing) or "paused"."""
    return _part(engine).state
