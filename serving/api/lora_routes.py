"""LoRA adapters over HTTP: a request's `model` picks an adapter, `/v1/models` lists them, and (behind
`--allow_runtime_lora_updating` and the API key) `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`
change them at run time, with vLLM's request and response shapes.

A request naming an adapter as its `model` runs with it: `ServingContext.check_model` resolves the
name and leaves it in `current_lora` (a context variable, as the KV-import of disaggregated serving
travels), which `ServingContext.stream_outputs` hands to the engine, so every generating route serves
adapters without a parameter of its own.

Loading reads and checks the adapter before anything is registered (`model.lora.load_adapter`): a
path that does not exist is a 404, an adapter that does not fit the base model (or a name in use) a
400, each with the reason; a failed load never answers 200. Unloading an unknown name is a 404; an
adapter still used by running requests leaves once they finish (the answer says so).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Optional

from fastapi import FastAPI, Response
from pydantic import BaseModel

from serving.api import http_protocol as P

# The adapter of the request being served (None: the base model), set by `resolve_model`.
current_lora: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("lora_name", default=None)


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None


def manager_of(engine):
    """The engine's `LoraManager` (None without `--enable_lora`); `engine` is an `AsyncEngine` or an `Engine`."""
    from serving.features.lora import LoraManager  # (imports jax, which a process that only routes does not load)

    inner = getattr(engine, "engine", engine)
    return inner.part(LoraManager) if hasattr(inner, "part") else None


def resolve_model(engine, base_name: str, model: Optional[str]) -> bool:
    """Whether `model` names something this server serves: the base model (or no model), or a loaded
    adapter, which then becomes the current request's (`current_lora`)."""
    current_lora.set(None)
    if model is None or model == base_name:
        return True
    manager = manager_of(engine)
    if manager is not None and model in manager.names():
        current_lora.set(model)
        return True
    return False


def part_args() -> dict:
    """The request arguments (`Engine.make_request(part_args=...)`) of the current request's adapter (none for
    the base model)."""
    name = current_lora.get()
    return {} if name is None else {"lora_name": name}


def adapter_cards(engine, base_name: str, max_model_len: int) -> list:
    """`/v1/models` entries of the loaded adapters: their `parent` is the base model, `root` their path."""
    manager = manager_of(engine)
    if manager is None:
        return []
    return [P.ModelCard(id=name, root=manager.path(name), parent=base_name, max_model_len=max_model_len)
            for name in manager.names()]


def add_lora_routes(app: FastAPI, ctx, keyed: list) -> None:
    """Mounts the load / unload routes (the caller mounts them only when runtime updates are allowed)."""
    # Imported here: they import jax, which a process that only routes requests does not load.
    from model.lora import LoraError, LoraNotFoundError
    from serving.features.lora import UnknownLoraError

    def manager():
        m = manager_of(ctx.engine)
        if m is None:
            raise P.APIError("LoRA adapters are not served here: start the server with --enable_lora",
                             code="lora_disabled")
        return m

    @app.post("/v1/load_lora_adapter", dependencies=keyed)
    async def load_lora_adapter(req: LoadLoraAdapterRequest):
        m = manager()
        if req.lora_name == ctx.model_name:
            raise P.APIError(f"lora_name {req.lora_name!r} is the base model's name", param="lora_name",
                             code="invalid_value")
        try:
            await asyncio.to_thread(m.register, req.lora_name, req.lora_path)
        except LoraNotFoundError as e:
            raise P.APIError(str(e), status=404, param="lora_path", code="lora_path_not_found") from None
        except LoraError as e:
            raise P.APIError(str(e), param="lora_path", code="invalid_lora_adapter") from None
        except ValueError as e:  # the name is taken
            raise P.APIError(str(e), param="lora_name", code="lora_name_in_use") from None
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=keyed)
    async def unload_lora_adapter(req: UnloadLoraAdapterRequest):
        try:
            waiting = manager().unregister(req.lora_name)
        except UnknownLoraError as e:
            raise P.APIError(str(e), status=404, param="lora_name", code="lora_not_found") from None
        if waiting:
            return Response(f"Success: LoRA adapter '{req.lora_name}' unloaded; it leaves once the {waiting} "
                            f"running request(s) using it finish (new requests cannot name it).",
                            media_type="text/plain")
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")
