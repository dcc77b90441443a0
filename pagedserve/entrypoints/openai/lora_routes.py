"""LoRA adapters over HTTP (vLLM's routes and shapes).

A request's ``model`` names a served model or a registered adapter (``--lora-modules`` at start,
or loaded at run time); ``GET /v1/models`` lists each adapter as a card whose ``root`` is its
folder and ``parent`` the model it applies to (its ``base_model_name`` if one was given, else the
first served name; null on the base model's own card).

With ``--allow-runtime-lora-updating`` (off by default; it needs ``--enable-lora``):

* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: 200 with the plain text
  ``Success: LoRA adapter '<name>' added successfully.``; 400 when the name is taken (by an
  adapter or a served model) or the engine refuses the adapter (its message: files, rank, target
  modules, shapes, ``--max-cpu-loras`` full). The path is read by the server, as vLLM does.
* ``POST /v1/unload_lora_adapter`` ``{"lora_name"[, "lora_int_id"]}``: 200 with
  ``Success: LoRA adapter '<name>' removed successfully.``; 404 for an unknown name (or an id
  that is not that adapter's); 409 (``ConflictError``) while live requests use it: the engine
  never takes an adapter from under a request; retry when they finish.

Loads and unloads run one at a time. A request checked against an adapter that is unloaded
before it reaches the engine gets a 404 (or, in the instant the unload is in flight, ends with
finish_reason ``abort`` and no tokens); it never runs with other weights.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pagedserve.entrypoints.openai.http_common import APIError
from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel
from pagedserve.entrypoints.openai.protocol_responses import ModelCard
from pagedserve.entrypoints.openai.server_args import ServerArgs
from pagedserve.lora_request import LoRARequest

logger = logging.getLogger("pagedserve")


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None


def check_runtime_updating(server: ServerArgs, enable_lora: bool) -> None:
    """Raises ValueError: ``--allow-runtime-lora-updating`` without ``--enable-lora``."""
    if server.allow_runtime_lora_updating and not enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora (the engine serves no LoRA adapters without it)")


def check_lora_flags(llm: Any, server: ServerArgs) -> None:
    """Raises ValueError: ``--allow-runtime-lora-updating`` without ``--enable-lora``, or a
    ``--lora-modules`` name that is also a served model name."""
    check_runtime_updating(server, llm.config.enable_lora)
    for name in llm.loras:
        if name in llm.served_model_names:
            raise ValueError(f"--lora-modules: the adapter name {name!r} is also a served model name (--served-model-name)")


def lora_cards(llm: Any, max_model_len: Optional[int]) -> list[ModelCard]:
    """The model cards of the registered adapters (vLLM's shape)."""
    base = llm.served_model_names[0]
    return [
        ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or base, max_model_len=max_model_len)
        for name, (lora, _) in llm.loras.items()
    ]


def engine_failed(llm: Any, e: Exception) -> APIError:
    """A refusal of add/remove that came from an engine that stopped meanwhile: a 503, not the
    client's fault (the engine's error is logged)."""
    return APIError(f"the engine is not running: {e}", status_code=503, err_type="ServiceUnavailableError")


def not_found(name: str) -> APIError:
    return APIError(f"The lora adapter '{name}' cannot be found.", param="lora_name", status_code=404, err_type="NotFoundError")


def register_lora_routes(app: FastAPI, llm: Any) -> None:
    """Add /v1/load_lora_adapter and /v1/unload_lora_adapter to ``app`` (the caller checks
    ``--allow-runtime-lora-updating``)."""
    lock = asyncio.Lock()  # one load or unload at a time: ids from next_lora_id() stay unique

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name, path = req.lora_name, req.lora_path
        if not name:
            raise APIError("lora_name must not be empty.", param="lora_name")
        if not path:
            raise APIError("lora_path must not be empty.", param="lora_path")
        async with lock:
            if name in llm.served_model_names:
                raise APIError(f"The name '{name}' is a served model's; choose another lora_name.", param="lora_name")
            if name in llm.loras:
                raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            try:
                lora = LoRARequest(name, llm.next_lora_id(), path)
            except ValueError as e:  # a name with control characters, '/', blank ends, ...
                raise APIError(f"Invalid lora_name: {e}", param="lora_name") from None
            try:
                await llm.add_lora(lora)
            except ValueError as e:  # the engine's reason (files, rank, shapes, capacity) or LoRA off
                if not llm.is_running:
                    raise engine_failed(llm, e) from None
                logger.warning("pagedserve: refused LoRA adapter %r from %s: %s", name, path, e)
                raise APIError(f"Loading LoRA adapter '{name}' failed: {e}", param="lora_path") from None
        logger.info("pagedserve: loaded LoRA adapter %r (id %d) from %s", name, lora.lora_int_id, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = req.lora_name
        async with lock:
            entry = llm.loras.get(name)
            if entry is None or (req.lora_int_id is not None and req.lora_int_id != entry[0].lora_int_id):
                raise not_found(name)
            try:
                removed = await llm.remove_lora(name)
            except ValueError as e:  # live requests use it
                if not llm.is_running:
                    raise engine_failed(llm, e) from None
                raise APIError(
                    f"The lora adapter '{name}' cannot be unloaded now: {e}", param="lora_name", status_code=409, err_type="ConflictError"
                ) from None
            if not removed:
                raise not_found(name)
        logger.info("pagedserve: unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
