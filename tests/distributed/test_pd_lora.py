"""Prefill/decode disaggregation with LoRA adapters: the adapter travels with the request (the
proxy sends the same ``model`` to both instances), the decode instance reads the prompt's KV by
hashes that carry the adapter's digest, so its output equals a colocated server's with the same
adapter; an instance whose adapter of that name has other weights never serves its blocks (the
decode recomputes), and a prefill instance without the adapter refuses the request."""

from __future__ import annotations

import httpx
import pytest

from lora_utils import make_adapter
from server_utils import free_port
from test_pd_disagg import Cluster, T, body, ids, metrics, text_of, wait_idle

pytestmark = pytest.mark.slow  # three servers and a proxy: the slow suite


class LoraCluster(Cluster):
    """P (producer) and D (consumer) behind the proxy, C colocated, each with its adapters."""

    def __init__(self, tmp_path_factory, model: str, p_loras: list[str], d_loras: list[str]) -> None:
        self.procs = []
        self.p_port, self.d_port = free_port(), free_port()
        lora = ["--enable-lora", "--lora-modules"]
        self.P = self.start(tmp_path_factory, model, "p", {"kv_role": "kv_producer", "kv_port": self.p_port, "kv_lease_s": 3}, *lora, *p_loras)
        self.D = self.start(tmp_path_factory, model, "d", {"kv_role": "kv_consumer", "kv_port": self.d_port, "kv_transfer_timeout_s": 30}, *lora, *d_loras)
        self.C = self.start(tmp_path_factory, model, "c", None, *lora, *d_loras)
        self.proxy = self.start_proxy(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_factory):
    d = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("pd-loras")
    x = make_adapter(d, str(root / "x"), seed=5)
    y = make_adapter(d, str(root / "y"), seed=6)
    # "ad" is the same adapter on both; "mix" has other weights on P than on D (and C); "donly" is on D alone.
    c = LoraCluster(tmp_path_factory, d, [f"ad={x}", f"mix={x}"], [f"ad={x}", f"mix={y}", f"donly={y}"])
    yield c
    c.close()


def received(cluster) -> float:
    return metrics(cluster.D)["pagedserve:kv_transfer_received_tokens_total"]


def completion(base: str, b: dict) -> list[str]:
    return text_of(httpx.post(base + "/v1/completions", json=b, timeout=T))


def test_adapter_kv_moves_from_prefill_to_decode(cluster):
    b = body(ids(100, 1), model="ad")
    before = received(cluster)
    assert completion(cluster.proxy, b) == completion(cluster.C, b)
    assert received(cluster) - before == (99 // 16) * 16
    base = body(ids(100, 1))  # the same prompt on the base model: other KV, other text
    assert completion(cluster.proxy, base) == completion(cluster.C, base) != completion(cluster.C, b)
    for url in (cluster.P, cluster.D):
        wait_idle(url)


def test_other_weights_under_the_same_name_are_never_read(cluster):
    b = body(ids(80, 2), model="mix")
    before = received(cluster)
    assert completion(cluster.proxy, b) == completion(cluster.C, b)  # D ran its own "mix" (y): recomputed
    assert received(cluster) == before
    for url in (cluster.P, cluster.D):
        wait_idle(url)


def test_a_prefill_instance_without_the_adapter_refuses(cluster):
    r = httpx.post(cluster.P + "/v1/completions", json=dict(body(ids(40, 3), model="donly"), max_tokens=1, kv_transfer_params={"do_remote_decode": True}), timeout=T)
    assert r.status_code == 404, r.text
    via_proxy = httpx.post(cluster.proxy + "/v1/completions", json=body(ids(40, 3), model="donly"), timeout=T)
    assert via_proxy.status_code == 404 and "donly" in via_proxy.json()["error"]["message"], via_proxy.text
    for url in (cluster.P, cluster.D):
        wait_idle(url)
