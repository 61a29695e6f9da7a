"""Sleep mode: an engine gives its device memory back between uses and takes it again, as vLLM's
`LLM.sleep` / `wake_up` do for reinforcement-learning loops that share the accelerator between the trainer
and the sampler.

* `sleep(engine, level=1)`: the weights move to host memory and the KV pool is let go; `wake_up` puts the
  weights back as they were and makes a fresh (empty) pool, so generation after waking is what it was
  before (the prefix cache is empty: its pages' K/V is gone; the host KV tier keeps its blocks, computed
  under the same weights).
* `sleep(engine, level=2)`: the weights are dropped too, with no host copy (the caller is about to replace
  them). `wake_up(tags=["weights"])` places zeroed weights of the same shapes and shardings, which
  `update_weights` then fills; requests are refused until it has.

`tags` wake one kind of memory at a time (`"weights"`, `"kv_cache"`), so a trainer can update the weights
before the KV pool takes its memory back. While anything is asleep, or the weights await an update, the
engine refuses requests (`EngineUnavailableError`: a 503 with Retry-After over HTTP). The engine must be
idle to sleep: an unfinished request would lose its K/V.

Arrays are let go, not deleted (`ModelRunner.release_weights`): memory returns once nothing else holds it, so
a trainer that shares the engine's weight arrays keeps its own. Everything comes back with the shapes,
dtypes and shardings it had: no step program compiles again.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

TAGS = ("weights", "kv_cache")
LEVELS = (1, 2)


# engine -> {"level", "asleep" (a set of tags), "weights_pending"} while it sleeps or awaits its weights.
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class SleepError(ValueError):
    """A sleep or wake the engine cannot do now (bad level or tag, requests in flight): a 400 over HTTP."""


def state(engine) -> dict:
    """{"level": the level slept at (0: awake), "asleep": the tags still asleep, "weights_pending": whether the
    weights woke without contents and wait for `update_weights`}."""
    s = _STATES.get(engine) or {"level": 0, "asleep": (), "weights_pending": False}
    return dict(s, asleep=list(s["asleep"]))


def is_sleeping(engine) -> bool:
    return bool(state(engine)["asleep"])


def sleep(engine, level: int = 1) -> None:
    """Puts the engine to sleep (see the module docstring). Raises `SleepError` for an unknown level, an engine
    already asleep, or unfinished requests."""
    if isinstance(level, bool) or level not in LEVELS:
        raise SleepError(f"level: must be 1 (weights kept in host memory) or 2 (weights dropped), got {level!r}")
    if is_sleeping(engine):
        raise SleepError(f"the engine is asleep already (level {state(engine)['level']}); wake it first")
    if engine.has_unfinished_requests():
        raise SleepError(f"{len(engine.requests)} requests are unfinished: finish or abort them before sleeping "
                         "(their K/V would be lost)")
    engine.runner.release_weights(keep_host_copy=level == 1)
    engine.runner.release_cache()
    engine.block_manager.reset_prefix_cache()  # its pages' K/V is gone (the host tier keeps its blocks)
    _STATES[engine] = {"level": level, "asleep": set(TAGS), "weights_pending": False}
    engine.unavailable = f"the engine is asleep (level {level}): wake it up first"


def wake_up(engine, tags: Optional[Iterable[str]] = None) -> None:
    """Wakes the memory of `tags` (default: all) that is asleep; tags already awake are skipped."""
    tags = list(TAGS if tags is None else tags)
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise SleepError(f"tags: unknown {unknown}; the tags are {list(TAGS)}")
    s = _STATES.get(engine)
    if s is None:
        return
    if "weights" in tags and "weights" in s["asleep"]:
        s["weights_pending"] = not engine.runner.restore_weights()
        s["asleep"].discard("weights")
    if "kv_cache" in tags and "kv_cache" in s["asleep"]:
        engine.runner.restore_cache()
        s["asleep"].discard("kv_cache")
    _settle(engine)


def weights_updated(engine) -> None:
    """The weights were replaced (`update_weights`): weights woken without contents have them now."""
    s = _STATES.get(engine)
    if s is not None and "weights" not in s["asleep"]:
        s["weights_pending"] = False
        _settle(engine)


def _settle(engine) -> None:
    """The engine's availability from its sleep state."""
    s = _STATES[engine]
    if s["asleep"]:
        engine.unavailable = f"the engine is partly asleep ({', '.join(sorted(s['asleep']))}): wake it up first"
    elif s["weights_pending"]:
        engine.unavailable = ("the weights woke from sleep level 2 without contents: update_weights before "
                              "generating")
    else:
        engine.unavailable = None
        del _STATES[engine]
