"""/v1/embeddings on a live ``--runner pooling`` server, driven by the ``openai`` client and
LangChain's ``OpenAIEmbeddings``: vectors equal to HF transformers' pooled
``last_hidden_state`` (float32, random weights) for LAST and MEAN pooling, mixed lengths in one
request, prefix hits and chunked prefill; bad requests get a 400 and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from app_utils import kv_idle, serve, tiny_async_llm

TEXTS = ["hello world", "Paged attention keeps the KV cache in fixed-size blocks. " * 12, "x", "Retrieval needs embeddings of documents"]


@pytest.fixture(scope="module")
def hf(tiny_model_factory):
    from transformers import AutoModel, AutoTokenizer

    d = tiny_model_factory("llama")
    return d, AutoTokenizer.from_pretrained(d), AutoModel.from_pretrained(d, dtype=torch.float32).eval()


def hf_embedding(hf, text_or_ids, kind: str) -> torch.Tensor:
    _, tok, model = hf
    ids = tok(text_or_ids)["input_ids"] if isinstance(text_or_ids, str) else text_or_ids
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if kind == "LAST" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=0)


def assert_cos(vec, ref: torch.Tensor) -> None:
    v = torch.tensor(vec, dtype=torch.float32)
    assert v.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(v, ref, dim=0).item() > 0.9999


@pytest.fixture(scope="module", params=["LAST", "MEAN"])
def pooling_server(request, hf):
    # A 64-token budget: the long input is pooled across chunks, beside the short ones.
    llm = tiny_async_llm(hf[0], runner="pooling", pooler_config={"pooling_type": request.param}, max_num_batched_tokens=64)
    try:
        with serve(llm) as base:
            yield request.param, base, llm
    finally:
        llm.shutdown()


def test_openai_client_embeddings_equal_hf(pooling_server, hf):
    kind, base, llm = pooling_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    res = client.embeddings.create(model="tiny", input=TEXTS)  # base64 on the wire: the client's default
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    assert res.model == "tiny"
    tok = hf[1]
    n = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert res.usage.prompt_tokens == res.usage.total_tokens == n
    for t, d in zip(TEXTS, res.data):
        assert_cos(d.embedding, hf_embedding(hf, t, kind))
        assert abs(sum(x * x for x in d.embedding) - 1.0) < 1e-4
    floats = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(res.data[1].embedding, abs=1e-6)
    ids = tok(TEXTS[3])["input_ids"]
    by_ids = client.embeddings.create(model="tiny", input=[ids, ids[:5]])
    assert_cos(by_ids.data[0].embedding, hf_embedding(hf, ids, kind))
    assert_cos(by_ids.data[1].embedding, hf_embedding(hf, ids[:5], kind))
    kv_idle(llm)


def test_prefix_hits_leave_vectors_unchanged(pooling_server, hf):
    kind, base, llm = pooling_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    hits = llm.get_stats().prefix_cache_hits
    first = client.embeddings.create(model="tiny", input=TEXTS[1]).data[0].embedding
    again = client.embeddings.create(model="tiny", input=TEXTS[1]).data[0].embedding
    if kind == "LAST":
        assert llm.get_stats().prefix_cache_hits > hits
    else:  # MEAN reads every position: the engine turned prefix caching off
        assert llm.get_stats().prefix_cache_hits == hits
    assert again == pytest.approx(first, abs=1e-5)
    assert_cos(again, hf_embedding(hf, TEXTS[1], kind))


def test_langchain_openai_embeddings(pooling_server, hf):
    from langchain_openai import OpenAIEmbeddings

    kind, base, _ = pooling_server
    # check_embedding_ctx_length=False: LangChain would otherwise tokenize with tiktoken (a download).
    emb = OpenAIEmbeddings(model="tiny", base_url=base + "/v1", api_key="none", check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS[:2])
    query = emb.embed_query(TEXTS[3])
    assert_cos(docs[0], hf_embedding(hf, TEXTS[0], kind))
    assert_cos(docs[1], hf_embedding(hf, TEXTS[1], kind))
    assert_cos(query, hf_embedding(hf, TEXTS[3], kind))


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": []}, 400, None),
        ({"input": ""}, 400, None),
        ({"input": [[]]}, 400, None),
        ({"input": [1, 2, 10**9]}, 400, "input"),
        ({"input": "hi", "encoding_format": "int8"}, 400, None),
        ({"input": "hi", "dimensions": 16}, 400, "dimensions"),
        ({"input": "hi", "model": "other"}, 404, "model"),
        ({"input": "hi " * 600}, 400, "input"),
        ({"input": ["hi"] * 2049}, 400, "input"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ],
)
def test_bad_embedding_requests(pooling_server, body, status, param):
    _, base, llm = pooling_server
    r = httpx.post(base + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(base + "/v1/embeddings", json={"input": "still serving"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 128
    kv_idle(llm)


def test_generation_routes_refused_on_a_pooling_server(pooling_server):
    _, base, _ = pooling_server
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(base + path, json=body, timeout=30)
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text


def test_embeddings_refused_on_a_generating_server(tiny_url):
    r = httpx.post(tiny_url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
