"""LoRA adapters over HTTP (issue 50) on the tiny random llama, driven by the ``openai`` client:

- a completion whose ``model`` names an adapter gives PEFT's merged model's greedy tokens
  (float32), the base model's name gives the base model's; chat, responses and Anthropic messages
  pass the adapter through too (their answers equal the completion of the same prompt);
- an unknown model is a 404; ``/v1/models`` lists each adapter with its ``root`` and ``parent``;
- ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (only with
  ``--allow-runtime-lora-updating``, under ``--api-key``): a round trip, and every refusal (bad
  path, rank above ``--max-lora-rank``, a taken name, an unknown name, an adapter in use: 409)
  with the server still serving after each; the in-use adapter's running request finishes whole;
- ``pagedserve:lora_requests_info`` shows the adapter running while a request streams.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from app_utils import kv_idle, serve, tiny_async_llm
from pagedserve.entrypoints.openai.server_args import ServerArgs

peft = pytest.importorskip("peft")

KEY = "sk-lora"
PROMPT = [1, 450, 3681, 338, 263, 1243, 310, 278, 16, 99, 7]  # token ids: no tokenizer in the comparison
N = 8  # greedy tokens compared
ADAPTERS = {  # name -> (LoraConfig kwargs, seed)
    "a": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]), 1),
    "b": (dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]), 2),
    "big": (dict(r=32, lora_alpha=32, target_modules=["q_proj"]), 3),  # above --max-lora-rank 16
}


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    """(model dir, {name: adapter dir}, {name or "base": PEFT's merged greedy tokens of PROMPT})."""
    from transformers import AutoModelForCausalLM

    d = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora-http")
    paths, expected = {}, {}
    expected["base"] = _greedy(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), PROMPT, N)
    for name, (kw, seed) in ADAPTERS.items():
        pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), peft.LoraConfig(**kw))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_B" in pname:  # PEFT starts B at zero: the adapter would change nothing
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        paths[name] = str(root / name)
        pm.save_pretrained(paths[name])
        if name != "big":
            expected[name] = _greedy(pm.merge_and_unload().eval(), PROMPT, N)
    assert expected["a"] != expected["base"] and expected["b"] != expected["base"]
    return d, paths, expected


@pytest.fixture(scope="module")
def server(setup):
    """(base URL with --allow-runtime-lora-updating and --api-key, base URL without either, llm)."""
    d, paths, _ = setup
    # "c": a's files again, in --lora-modules' JSON form with the model it was trained on.
    c = json.dumps({"name": "c", "path": paths["a"], "base_model_name": "org/tiny-base"})
    llm = tiny_async_llm(d, enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules=[f"a={paths['a']}", c])
    try:
        with serve(llm, ServerArgs(allow_runtime_lora_updating=True, api_key=KEY)) as base, serve(llm) as plain:
            yield base, plain, llm
    finally:
        llm.shutdown()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def _tokens(client: openai.OpenAI, model: str, prompt=PROMPT, n: int = N) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == model
    return r.choices[0].model_extra["token_ids"]


def _post(base: str, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_the_adapter_named_by_model_gives_pefts_merged_greedy_tokens(server, setup):
    base, _, llm = server
    c = _client(base)
    expected = setup[2]
    assert _tokens(c, "a") == expected["a"]
    assert _tokens(c, "tiny") == expected["base"]
    # Two requests of the adapter and one of the base model at once: each its own tokens.
    got: dict = {}
    threads = [threading.Thread(target=lambda k=k, m=m: got.__setitem__(k, _tokens(c, m))) for k, m in (("a1", "a"), ("t", "tiny"), ("a2", "a"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"a1": expected["a"], "a2": expected["a"], "t": expected["base"]}
    kv_idle(llm)


def test_chat_responses_and_messages_pass_the_adapter_through(server):
    base, _, _ = server
    c = _client(base)
    msgs = [{"role": "user", "content": "Say something about paged attention."}]
    chat = {}
    for model in ("a", "tiny"):
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        assert r.model == model
        chat[model] = r.choices[0].message.content
        # The chat answer is the completion of the same prompt on the same weights.
        ids = r.choices[0].model_extra["token_ids"]
        assert _tokens(c, model, r.prompt_token_ids, 6)[: len(ids)] == ids
    assert chat["a"] != chat["tiny"]
    for model in ("a", "tiny"):
        resp = c.responses.create(model=model, input=msgs, max_output_tokens=6, temperature=0)
        assert resp.model == model and resp.output_text == chat[model]
        h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        m = httpx.post(base + "/v1/messages", json={"model": model, "max_tokens": 6, "temperature": 0, "messages": msgs}, headers=h, timeout=30)
        assert m.status_code == 200 and m.json()["model"] == model, m.text
        assert "".join(b.get("text", "") for b in m.json()["content"]) == chat[model]


def test_an_unknown_model_is_a_404_and_models_lists_the_adapters(server, setup):
    base, _, _ = server
    c = _client(base)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "nope" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    cards = {m.id: m for m in c.models.list().data}
    assert cards["tiny"].parent is None
    assert cards["a"].parent == "tiny" and cards["a"].root == setup[1]["a"]
    one = c.models.retrieve("a")
    assert one.id == "a" and one.parent == "tiny" and one.root == setup[1]["a"]
    assert cards["c"].parent == "org/tiny-base" and c.models.retrieve("c").root == setup[1]["a"]
    assert _tokens(c, "c") == setup[2]["a"]


def test_a_request_whose_adapter_was_unloaded_after_its_check_is_a_404():
    from pagedserve.entrypoints.openai.http_common import APIError
    from pagedserve.entrypoints.openai.serving_common import OpenAIServing
    from pagedserve.lora_request import LoRARequest

    entry = (LoRARequest("z", 3, "/p"), "digest")
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.served_model_names = ["tiny"]
    serving.llm = SimpleNamespace(loras={"z": entry})
    assert serving.resolve_model("z") == ("z", entry) and serving.resolve_model(None) == ("tiny", None)
    assert serving.current_lora(entry) is entry and serving.current_lora(None) is None
    serving.llm.loras = {}
    with pytest.raises(APIError) as e:
        serving.current_lora(entry)
    assert e.value.status_code == 404 and e.value.err_type == "NotFoundError" and "`z`" in e.value.message


def test_load_and_unload_round_trip(server, setup):
    base, _, llm = server
    c = _client(base)
    paths, expected = setup[1], setup[2]
    with pytest.raises(openai.NotFoundError):
        _tokens(c, "b")
    r = _post(base, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": paths["b"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
    assert {"a", "b"} <= {m.id for m in c.models.list().data}
    assert _tokens(c, "b") == expected["b"]
    assert _tokens(c, "a") == expected["a"]  # the first adapter is untouched
    bad_id = _post(base, "/v1/unload_lora_adapter", {"lora_name": "b", "lora_int_id": llm.loras["b"][0].lora_int_id + 100})
    assert bad_id.status_code == 404
    r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "b", "lora_int_id": llm.loras["b"][0].lora_int_id})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
    assert "b" not in {m.id for m in c.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _tokens(c, "b")
    r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    # Loaded again under the same name: the same weights' tokens (no stale KV, no stale slot).
    assert _post(base, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": paths["b"]}).status_code == 200
    assert _tokens(c, "b") == expected["b"]
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    kv_idle(llm)


def test_every_refusal_is_a_4xx_and_the_server_keeps_serving(server, setup, tmp_path):
    base, _, llm = server
    c = _client(base)
    paths, expected = setup[1], setup[2]
    (tmp_path / "empty").mkdir()
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "x"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "empty")}, "x"),
        ({"lora_name": "big", "lora_path": paths["big"]}, "rank"),
        ({"lora_name": "a", "lora_path": paths["b"]}, "already been loaded"),
        ({"lora_name": "tiny", "lora_path": paths["b"]}, "served model"),
        ({"lora_name": "", "lora_path": paths["b"]}, "lora_name"),
        ({"lora_name": " x", "lora_path": paths["b"]}, "whitespace"),
        ({"lora_name": "x/y", "lora_path": paths["b"]}, "control characters or '/'"),
        ({"lora_name": "x\u0000y", "lora_path": paths["b"]}, "control characters"),
        ({"lora_name": "   ", "lora_path": paths["b"]}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
    ]
    for body, words in cases:
        r = _post(base, "/v1/load_lora_adapter", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "BadRequestError" and words in r.text, (body, r.text)
        assert _tokens(c, "a") == expected["a"]  # still serving, the adapter intact
    assert set(llm.loras) == {"a", "c"}
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 404
    assert _tokens(c, "tiny") == expected["base"]


def test_an_adapter_in_use_is_not_unloaded_and_its_request_finishes_whole(server, setup):
    base, _, llm = server
    c = _client(base)
    n = 400  # long enough that the unload below lands while it runs
    stream = c.completions.create(model="a", prompt=PROMPT, max_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens: list[int] = []
    refused = metrics = None
    for chunk in stream:
        tokens += chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
        if refused is None and tokens:
            metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
            refused = _post(base, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert refused is not None and refused.status_code == 409, refused.text if refused is not None else None
    assert refused.json()["error"]["type"] == "ConflictError" and "in use" in refused.text
    assert 'running_lora_adapters="a"' in metrics and 'max_lora="2"' in metrics, metrics
    assert len(tokens) == n and tokens[:N] == setup[2]["a"]
    assert "a" in llm.loras
    kv_idle(llm)
    # Once nothing runs, the gauge lists no adapter.
    deadline = time.monotonic() + 5
    while 'running_lora_adapters=""' not in (text := httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text):
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    assert text.count("pagedserve:lora_requests_info{") == 1
    assert 'pagedserve:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text


def test_the_routes_need_the_flag_and_the_api_key(server, setup):
    base, plain, _ = server
    body = {"lora_name": "b", "lora_path": setup[1]["b"]}
    assert httpx.post(plain + "/v1/load_lora_adapter", json=body).status_code == 404
    assert httpx.post(plain + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    assert httpx.post(base + "/v1/load_lora_adapter", json=body).status_code == 401
    assert _post(base, "/v1/load_lora_adapter", body, key="wrong").status_code == 401
    assert httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 401
    # Without the flag the adapters still serve.
    assert _tokens(openai.OpenAI(base_url=plain + "/v1", api_key="none"), "a") == setup[2]["a"]


def test_runtime_updating_without_enable_lora_is_a_start_up_error(tiny_model_factory):
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.openai.lora_routes import check_lora_flags
    from pagedserve.entrypoints.openai.run_server import run_server

    args = build_parser(only="serve").parse_args(["serve", tiny_model_factory("llama"), "--allow-runtime-lora-updating", "--port", "1"])
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating needs --enable-lora"):
        run_server(args)  # before binding the port or loading the engine
    stub = SimpleNamespace(config=SimpleNamespace(enable_lora=False), loras={}, served_model_names=["tiny"])
    with pytest.raises(ValueError, match="needs --enable-lora"):
        check_lora_flags(stub, ServerArgs(allow_runtime_lora_updating=True))
    stub = SimpleNamespace(config=SimpleNamespace(enable_lora=True), loras={"tiny": None}, served_model_names=["tiny"])
    with pytest.raises(ValueError, match="also a served model name"):
        check_lora_flags(stub, ServerArgs())


def test_lora_requests_info_keeps_one_series_of_the_live_adapters():
    from prometheus_client import generate_latest

    from pagedserve.metrics import EngineMetrics

    m = EngineMetrics("tiny")
    info = m.enable_lora_info(4)
    assert m.enable_lora_info(4) is info

    def series() -> list[str]:
        return [line for line in generate_latest(m.registry).decode().splitlines() if line.startswith("pagedserve:lora_requests_info{")]

    assert series() == ['pagedserve:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} ' + series()[0].split()[-1]]
    info.add("r1", "b")
    info.add("r2", "a")
    info.add("r3", "b")
    assert info.adapters() == ([], ["a", "b"])
    info.update("r1", finished=False)  # b's first request returned its first token
    assert info.adapters() == (["b"], ["a", "b"])
    info.update("r3", finished=True)
    info.discard("r2")
    info.discard("r2")
    assert info.adapters() == (["b"], [])
    (line,) = series()
    assert 'running_lora_adapters="b",waiting_lora_adapters=""' in line and abs(float(line.split()[-1]) - time.time()) < 60
    info.discard("r1")
    (line,) = series()
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in line
