"""Schemathesis against the server's own /openapi.json: every route, positive cases (valid by
the schema) and negative ones (invalid by it), on the real app over a tiny random model. No
answer may be a 5xx, every 4xx must carry an OpenAI error body, and afterwards the server is
healthy and every KV block is free. ``PAGEDSERVE_FUZZ_EXAMPLES`` (default 20) sets the
examples per route and mode; benchmarks/README.md records a longer run."""
from __future__ import annotations

import collections
import os

try:
    import httpx
except ImportError:  # pragma: no cover
    import httpx2 as httpx
import pytest

from app_utils import kv_idle, serve, tiny_async_llm
from pagedserve.entrypoints.openai.server_args import ServerArgs

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "20"))


def check_response(case, resp, seen: collections.Counter) -> None:
    where = f"{case.method} {case.formatted_path} {str(case.body)[:300]!r}"
    seen[resp.status_code] += 1
    assert resp.status_code < 500, f"{where} -> {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400 and case.formatted_path.startswith("/v1/messages"):
        body = resp.json()  # Anthropic's shape on its routes
        assert body.get("type") == "error" and set(body) == {"type", "error"}, (where, body)
        assert isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str) and body["error"]["message"], (where, body)
        return
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"}, (where, body)
        err = body["error"]
        assert isinstance(err.get("message"), str) and err["message"], (where, body)
        assert isinstance(err.get("type"), str) and err.get("code") == resp.status_code, (where, body)
        assert "param" in err, (where, body)


@pytest.mark.slow
def test_schemathesis_positive_and_negative_on_every_route(tiny_model_factory):
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    llm = tiny_async_llm(tiny_model_factory("llama"), max_num_seqs=16)
    seen: collections.Counter = collections.Counter()
    try:
        # Every request is bounded in time, so a schema-valid n=128 x 500 tokens cannot stall the run.
        with serve(llm, ServerArgs(request_timeout=3.0)) as base:
            schema = schemathesis.openapi.from_url(base + "/openapi.json")
            operations = [r.ok() for r in schema.get_all_operations()]
            paths = {op.path for op in operations}
            assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"} <= paths, paths
            for op in operations:
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                    @given(case=op.as_strategy(generation_mode=mode))
                    def run(case):
                        check_response(case, case.call(base_url=base, timeout=60), seen)

                    try:
                        run()
                    except hypothesis.errors.Unsatisfiable:  # nothing to make invalid (GET /health)
                        assert mode is GenerationMode.NEGATIVE, op.path
            assert httpx.get(base + "/health", timeout=10).status_code == 200
            kv_idle(llm, timeout_s=30)
            r = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        llm.shutdown()
        print(f"\nfuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
    assert sum(v for k, v in seen.items() if k < 300) > 0 and sum(v for k, v in seen.items() if k >= 400) > 0
