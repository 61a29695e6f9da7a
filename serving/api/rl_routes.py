"""The routes a reinforcement-learning trainer drives the server with, as vLLM's dev-mode routes are named:
`POST /sleep?level=`, `POST /wake_up?tags=`, `GET /is_sleeping`, `POST /pause?mode=abort|wait|keep`,
`POST /resume?recompute_kv=`, `GET /is_paused`, `POST /reset_prefix_cache` and `POST /update_weights`
(`{"checkpoint": DIR, "version": N}`).

They change what every client is served, so they exist only when the server is started with
`--enable_rl_routes` (or vLLM's `VLLM_SERVER_DEV_MODE=1`), and then behind the API key when keys are set.
`/update_weights` reads a checkpoint from the server's own disk: only a directory under one of
`--rl_checkpoint_roots` (none by default: the route then refuses every path), after symlinks are resolved,
so a client cannot make the server read an arbitrary file.

Each operation runs on the engine thread between steps (`AsyncEngine.call`). Requests that arrive while
the engine sleeps get a 503 with Retry-After (`http_app.ServingContext.stream_outputs`), never a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Optional

from fastapi import FastAPI, Query
from pydantic import BaseModel

from serving.api import http_protocol as P

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's switch for the same routes


@dataclasses.dataclass(frozen=True)
class RLRouteOptions:
    """The routes' options (`serving.server`'s flags)."""

    checkpoint_roots: tuple = ()  # directories `/update_weights` may read checkpoints under


def enabled_by_env() -> bool:
    return os.environ.get(DEV_MODE_ENV, "") in ("1", "true", "True")


class UpdateWeightsRequest(BaseModel):
    checkpoint: str
    version: Optional[int] = None


def checkpoint_under_roots(path: str, roots: tuple) -> str:
    """`path` resolved (symlinks followed), when it is a directory under one of `roots`; else an APIError."""
    if not roots:
        raise P.APIError("checkpoint: this server reads no checkpoints for weight updates (start it with "
                         "--rl_checkpoint_roots=DIR[,DIR...])", status=403, param="checkpoint", code="forbidden")
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, os.path.realpath(r)]) == os.path.realpath(r) for r in roots):
        raise P.APIError("checkpoint: not under --rl_checkpoint_roots", status=403, param="checkpoint",
                         code="forbidden")
    if not os.path.isdir(real):
        raise P.APIError(f"checkpoint: no directory {path}", status=404, param="checkpoint", code="not_found")
    return real


def load_for_update(engine, directory: str):
    """The weights of a Ridgeline or Hugging Face checkpoint directory, in the engine's compute dtype."""
    from model.checkpoint import load_checkpoint, load_config
    from serving import model_source
    from serving.core import compute_dtype

    checkpoint = model_source.resolve(directory).checkpoint
    cfg, params = load_checkpoint(checkpoint, None, load_config(checkpoint))
    _, params = compute_dtype.apply(cfg, params, engine.config.dtype)
    return params


def add_rl_routes(app: FastAPI, ctx, keyed: list, options: RLRouteOptions) -> None:
    """Mounts the routes (the caller mounts them only when they are enabled)."""
    from serving.features import pause, sleep_mode
    from serving.features import weight_updates

    async def on_engine(fn):
        try:
            return await ctx.engine.call(fn)
        except (sleep_mode.SleepError, pause.PauseError) as e:
            raise P.APIError(str(e), code="invalid_value") from None

    @app.post("/pause", dependencies=keyed)
    async def pause_generation(mode: str = "abort"):
        """Answers once paused: under "wait", after the started requests have finished."""
        state = await on_engine(lambda engine: pause.pause(engine, mode))
        while state == "draining":
            await asyncio.sleep(0.05)
            state = await on_engine(pause.state)
        return {"is_paused": state == "paused", "mode": mode}

    @app.post("/resume", dependencies=keyed)
    async def resume_generation(recompute_kv: bool = False):
        recomputed = await on_engine(lambda engine: pause.resume(engine, recompute_kv))
        return {"is_paused": False, "recomputed_sequences": recomputed}

    @app.get("/is_paused", dependencies=keyed)
    async def is_paused():
        state = await on_engine(pause.state)
        return {"is_paused": state != "running", "state": state}

    @app.post("/sleep", dependencies=keyed)
    async def sleep(level: int = 1):
        await on_engine(lambda engine: sleep_mode.sleep(engine, level))
        return {"is_sleeping": True, "level": level}

    @app.post("/wake_up", dependencies=keyed)
    async def wake_up(tags: Optional[list[str]] = Query(None)):
        await on_engine(lambda engine: sleep_mode.wake_up(engine, tags))
        return await on_engine(sleep_mode.state)

    @app.get("/is_sleeping", dependencies=keyed)
    async def is_sleeping():
        state = await on_engine(sleep_mode.state)
        return {"is_sleeping": bool(state["asleep"]), **state}

    @app.post("/reset_prefix_cache", dependencies=keyed)
    async def reset_prefix_cache():
        return {"pages_dropped": await on_engine(lambda engine: engine.reset_prefix_cache())}

    @app.post("/update_weights", dependencies=keyed)
    async def update_weights(req: UpdateWeightsRequest):
        directory = checkpoint_under_roots(req.checkpoint, options.checkpoint_roots)
        if req.version is not None and req.version < 0:
            raise P.APIError("version: must be >= 0", param="version", code="invalid_value")

        def update(engine):
            params = load_for_update(engine, directory)
            version = weight_updates.update_weights(engine, params, req.version)
            sleep_mode.weights_updated(engine)
            return version

        try:
            version = await ctx.engine.call(update)
        except (ValueError, FileNotFoundError) as e:  # a checkpoint of another model, or none at all
            raise P.APIError(f"checkpoint: {e}", param="checkpoint", code="invalid_value") from None
        return {"weight_version": version}
