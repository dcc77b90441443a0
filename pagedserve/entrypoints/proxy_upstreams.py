"""The proxy's pieces that do not need its app: the two request bodies of vLLM's
disaggregation contract, the round-robin pool of instance URLs, and the response that cancels
its upstream request when the client disconnects (see :mod:`pagedserve.entrypoints.proxy`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from fastapi.responses import Response

logger = logging.getLogger("pagedserve.proxy")

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict) -> dict:
    """The body sent to the prefill instance (see the module docstring)."""
    p = dict(body, max_tokens=1, stream=False, n=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    p.pop("stream_options", None)
    for name, value in (("max_completion_tokens", 1), ("best_of", 1), ("min_tokens", 0)):
        if name in p:
            p[name] = value
    return p


def decode_body(body: dict, kv_transfer_params: Optional[dict]) -> dict:
    """The client's body, with the prefill's ``kv_transfer_params`` (none after a fallback)."""
    d = dict(body)
    d.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        d["kv_transfer_params"] = kv_transfer_params
    return d


class UpstreamPool:
    """Round-robin over instance URLs; one that refused a connection goes last for ``down_s``."""

    def __init__(self, urls: list[str], down_s: float) -> None:
        if not urls:
            raise ValueError("at least one URL is needed per role")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"instance URLs must start with http:// or https://, got {bad}")
        self.urls = [u.rstrip("/") for u in urls]
        self.down_s = down_s
        self._next = 0
        self._down_until: dict[str, float] = {}

    def order(self) -> list[str]:
        """Every URL, the round-robin's turn first, those marked down at the end."""
        n, start, now = len(self.urls), self._next, time.monotonic()
        self._next = (start + 1) % n
        ring = [self.urls[(start + i) % n] for i in range(n)]
        up = [u for u in ring if self._down_until.get(u, 0.0) <= now]
        return up + [u for u in ring if u not in up]

    def mark(self, url: str, ok: bool) -> None:
        if ok:
            self._down_until.pop(url, None)
        else:
            self._down_until[url] = time.monotonic() + self.down_s


async def _send_bytes(send: Any, status: int, headers: list, body: bytes) -> None:
    headers = headers + [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Proxied(Response):
    """Runs ``work(send)``, which answers the client itself, and cancels it (closing its upstream
    request) as soon as the client disconnects."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.background = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        task, watcher = asyncio.ensure_future(self.work(send)), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                logger.info("client disconnected; closing the upstream request")
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled():
            task.result()  # a bug surfaces as a 500 (or a cut stream), not silently
