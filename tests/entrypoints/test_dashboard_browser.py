"""The dashboard and the API docs page in a real browser: headless Chromium (Debian's
``chromium`` package; .ci/run installs it) driven by Playwright, against the real app on a
loopback port under load. The page must ask for the API key (its data needs it), then its step
timeline and block map must update, with no console error and no failed resource load.
Screenshots go to ``$PAGEDSERVE_ARTIFACTS`` (default ``test-artifacts/``)."""
from __future__ import annotations

import os
import pathlib
import shutil
import threading

try:
    import httpx
except ImportError:  # pragma: no cover
    import httpx2 as httpx
import pytest

from app_utils import kv_idle, serve, tiny_async_llm
from pagedserve.entrypoints.openai.server_args import ServerArgs

CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")
KEY = "dash-key-1"
ARTIFACTS = pathlib.Path(os.environ.get("PAGEDSERVE_ARTIFACTS", pathlib.Path(__file__).resolve().parents[2] / "test-artifacts"))


class Load:
    """Streaming requests from a background thread until stopped (one at a time per client)."""

    def __init__(self, base: str, clients: int = 3) -> None:
        self.base, self.stop, self.sent = base, threading.Event(), 0
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(clients)]

    def run(self, i: int) -> None:
        with httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            while not self.stop.is_set():
                body = {"model": "tiny", "prompt": "word " * (20 + 37 * i), "max_tokens": 40, "ignore_eos": True, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
                self.sent += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def watch(page) -> list[str]:
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed load: {r.url} {r.failure}"))
    return problems


def test_dashboard_and_docs_in_headless_chromium(tiny_model_factory):
    sync_api = pytest.importorskip("playwright.sync_api")
    llm = tiny_async_llm(tiny_model_factory("llama"), max_num_seqs=8)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    try:
        with serve(llm, ServerArgs(api_key=KEY)) as base, sync_api.sync_playwright() as pw:
            assert httpx.get(base + "/dashboard", timeout=10).status_code == 200  # the page itself is public
            assert httpx.get(base + "/dashboard/static/dashboard.js", timeout=10).status_code == 200
            assert httpx.get(base + "/dashboard/api/snapshot", timeout=10).status_code == 401  # its data is not
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                problems = watch(page)
                with Load(base) as load:
                    page.goto(base + "/dashboard")
                    page.wait_for_selector("#keyform:not([hidden])", timeout=15_000)  # asks for the key first
                    page.fill("#key", KEY)
                    page.click("#keyform button")
                    page.wait_for_function("window.__dashboard.stepsSeen > 0 && window.__dashboard.blockMapsSeen > 0", timeout=30_000)
                    page.wait_for_function("window.__dashboard.lastUsedBlocks > 0", timeout=30_000)
                    first = page.evaluate("[window.__dashboard.stepsSeen, window.__dashboard.blockMapsSeen]")
                    page.wait_for_function(f"window.__dashboard.stepsSeen > {first[0]} + 20 && window.__dashboard.blockMapsSeen > {first[1]} + 2",
                                           timeout=30_000)
                    assert int(page.get_attribute("#timeline", "data-bars")) > 0
                    assert page.locator("#timeline rect.bar").count() > 0
                    assert page.locator("#lanes g.lane").count() > 0
                    assert page.text_content("#status") == "live"
                    assert int(page.text_content("#t-running")) >= 0
                    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
                assert load.sent > 0
                assert not problems, problems

                ctx = browser.new_context(extra_http_headers={"Authorization": f"Bearer {KEY}"})
                docs = ctx.new_page()
                problems = watch(docs)
                docs.goto(base + "/docs")
                docs.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
                assert "pagedserve" in docs.text_content(".swagger-ui .info .title")
                docs.wait_for_selector(".opblock-summary-path", timeout=30_000)
                assert docs.locator(".opblock").count() >= 5  # the routes rendered from /openapi.json
                docs.screenshot(path=str(ARTIFACTS / "docs.png"))
                assert not problems, problems
            finally:
                browser.close()
            kv_idle(llm, 30)
    finally:
        llm.shutdown()
