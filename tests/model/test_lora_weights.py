"""PEFT LoRA adapters read for the fused projections (pagedserve.model.lora) and applied through
the slots (pagedserve.model.lora_slots), against HF PEFT itself.

- Random adapters made with ``peft.get_peft_model`` on the tiny random llama (lora_A and lora_B
  randomized, saved with ``save_pretrained``): all seven modules (r=8, alpha=16), rsLoRA, a
  rank_pattern / alpha_pattern adapter and one on q_proj and v_proj only. For every layer and fused
  projection, the fused base output plus ``LoRASlots.add_delta`` equals the concatenation of
  PEFT's modules' outputs (q|k|v, gate|up) in float32, with rows of all four adapters, of an empty
  slot and of the base model (-1) in one batch; base-model rows keep their bits. bf16 activations
  with float32 slots and with bf16 slots (a bf16 model's: the factors rounded once) within bf16
  tolerances.
- Every refusal of ``load_peft_adapter`` is a LoRAError naming the folder and the problem.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.model.lora import PROJ_WIDTH, LoRAError, LoRAModelSpec, load_peft_adapter
from pagedserve.model.lora_slots import LoRASlots

peft = pytest.importorskip("peft")

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig kwargs
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ALL_MODULES),
    "pattern": dict(
        r=8,
        lora_alpha=16,
        target_modules=ALL_MODULES,
        rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 2},
        alpha_pattern={"v_proj": 32, "model.layers.0.mlp.gate_proj": 4},
    ),
    "qv": dict(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj"]),
}
FUSED = {"qkv": ["q_proj", "k_proj", "v_proj"], "o": ["o_proj"], "gate_up": ["gate_proj", "up_proj"], "down": ["down_proj"]}
PARENT = {"qkv": "self_attn", "o": "self_attn", "gate_up": "mlp", "down": "mlp"}


def _peft_model(model_dir: str, seed: int, **lora_kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return pm.eval()


@pytest.fixture(scope="module")
def lora_setup(tiny_model_factory, tmp_path_factory):
    """(spec, {name: (adapter dir, PEFT model)}) for ADAPTERS on the tiny llama."""
    from transformers import AutoConfig

    model_dir = tiny_model_factory("llama")
    spec = LoRAModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        pm = _peft_model(model_dir, seed=10 + i, **kw)
        path = str(root / name)
        pm.save_pretrained(path)
        out[name] = (path, pm)
    return spec, out


def _module(pm, layer: int, parent: str, name: str):
    return getattr(getattr(pm.base_model.model.model.layers[layer], parent), name)


def test_spec_from_hf_config(lora_setup):
    spec, _ = lora_setup
    assert spec == LoRAModelSpec(num_layers=2, hidden_size=128, q_size=128, kv_size=64, intermediate_size=256)


def test_adapters_read_for_the_fused_projections(lora_setup):
    spec, adapters = lora_setup
    a = load_peft_adapter(adapters["all"][0], spec, max_rank=8)
    assert a.rank == 8 and a.target_modules == frozenset(ALL_MODULES)
    assert isinstance(a.base_model_name, str)  # the tiny model's folder, as PEFT saved it
    assert sorted(a.weights) == [(layer, p) for layer in range(2) for p in sorted(PROJ_WIDTH)]
    A, B = a.weights[(0, "qkv")]
    assert A.shape == (24, 128) and B.shape == (256, 24) and A.dtype == B.dtype == torch.float32
    assert not B[:128, 8:].any() and not B[128:192, :8].any() and not B[128:192, 16:].any() and not B[192:, :16].any()  # block-diagonal
    assert a.num_bytes() == sum(4 * (x.numel() + y.numel()) for x, y in a.weights.values())
    p = load_peft_adapter(adapters["pattern"][0], spec, max_rank=8)
    assert p.weights[(0, "qkv")][0].shape == (4 + 8 + 8, 128) and p.weights[(1, "down")][0].shape == (2, 256) and p.rank == 8
    qv = load_peft_adapter(adapters["qv"][0], spec, max_rank=16)
    assert qv.target_modules == frozenset({"q_proj", "v_proj"}) and sorted(qv.weights) == [(0, "qkv"), (1, "qkv")]
    A, B = qv.weights[(1, "qkv")]
    assert A.shape == (12, 128) and not B[128:192].any()  # k's rows get nothing


@pytest.mark.parametrize("dtype,slot_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_slots_delta_equals_peft_modules(lora_setup, dtype, slot_dtype):
    spec, adapters = lora_setup
    names = list(ADAPTERS)
    slots = LoRASlots(spec, max_loras=len(names) + 1, max_rank=8, device=torch.device("cpu"), dtype=slot_dtype)
    assert all(t.dtype == slot_dtype for d in (slots.AT, slots.BT) for t in d.values())
    loaded = [load_peft_adapter(adapters[name][0], spec, max_rank=8) for name in names]
    for s, adapter in enumerate(loaded):
        slots.set_slot(s, adapter)
    # rows of every adapter, of the empty last slot and of the base model, interleaved
    row_slots = torch.tensor([0, -1, 1, 2, 3, 4, 0, 2, -1, 1, 3, 3, 0], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    for layer in range(spec.num_layers):
        for proj, mods in FUSED.items():
            base_pm = adapters[names[0]][1]
            w = torch.cat([_module(base_pm, layer, PARENT[proj], m).base_layer.weight for m in mods])
            x = torch.randn(len(row_slots), w.shape[1], generator=g).to(dtype).float()  # exact in dtype
            base = x @ w.T
            out = base.clone().to(dtype)
            xin = x.to(dtype)
            slots.add_delta(out, xin, layer, proj, row_slots)
            for t, s in enumerate(row_slots.tolist()):
                if s < 0 or s == len(names):
                    assert torch.equal(out[t], base[t].to(dtype)), (layer, proj, t)
                    continue
                pm = adapters[names[s]][1]
                with torch.no_grad():
                    want = torch.cat([_module(pm, layer, PARENT[proj], m)(xin[t : t + 1].float())[0] for m in mods])
                if dtype == torch.float32:
                    torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-4, msg=f"{names[s]} layer {layer} {proj}")
                elif slot_dtype == torch.float32:  # base rounded to bf16, the delta added in float32, rounded once
                    ref = base[t].to(dtype).float() + (want - base[t])
                    torch.testing.assert_close(out[t].float(), ref, rtol=2**-7, atol=1e-3, msg=f"{names[s]} layer {layer} {proj}")
                else:  # and the delta from factors rounded once to bf16 (each by up to 2^-9 of itself)
                    ref = base[t].double() + (want - base[t]).double()
                    if (layer, proj) in loaded[s].weights:
                        a, b = loaded[s].weights[(layer, proj)]
                        terms = (x[t].double().abs() @ a.double().abs().T) @ b.double().abs().T  # the delta's terms' size
                    else:
                        terms = torch.zeros_like(ref)
                    # base and result rounded to bf16 (2^-9 each), the delta within 2^-8 of its terms
                    bound = 2**-8 * (ref.abs() + base[t].double().abs()) + 2**-8 * 1.01 * terms + 1e-5
                    err = (out[t].double() - ref).abs()
                    assert (err <= bound).all(), (names[s], layer, proj, (err - bound).max().item())


def test_clear_slot_and_set_slot_refusal(lora_setup):
    spec, adapters = lora_setup
    slots = LoRASlots(spec, max_loras=2, max_rank=8, device=torch.device("cpu"))
    a = load_peft_adapter(adapters["all"][0], spec, max_rank=8)
    slots.set_slot(1, a)
    x = torch.randn(3, 128)
    out = torch.zeros(3, 256)
    slots.add_delta(out, x, 0, "qkv", torch.tensor([1, 1, 0], dtype=torch.int32))
    assert out[:2].abs().sum() > 0 and not out[2].any()
    slots.clear_slot(1)
    out.zero_()
    slots.add_delta(out, x, 0, "qkv", torch.tensor([1, 1, 0], dtype=torch.int32))
    assert not out.any() and not slots.AT[(0, "qkv")].any() and not slots.BT[(1, "down")].any()
    small = LoRASlots(spec, max_loras=1, max_rank=4, device=torch.device("cpu"))
    with pytest.raises(LoRAError, match="do not fit"):
        small.set_slot(0, a)
    assert not any(t.any() for t in small.AT.values())
    with pytest.raises(ValueError, match="slot 2"):
        slots.set_slot(2, a)
    with pytest.raises(ValueError, match="projection"):
        slots.add_delta(out, x, 0, "q", torch.tensor([1, 1, 0], dtype=torch.int32))


# --- refusals ---------------------------------------------------------------------------------


def _variant(src: str, dst: str, config=None, tensors=None, drop=()) -> str:
    """A copy of the adapter src at dst, its config updated with ``config`` and its tensors
    replaced by ``tensors(dict)``'s result; the files in ``drop`` removed."""
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "adapter_config.json")
    if config is not None:
        with open(cfg_path) as fh:
            cfg = json.load(fh)
        cfg.update(config)
        with open(cfg_path, "w") as fh:
            json.dump(cfg, fh)
    if tensors is not None:
        w = os.path.join(dst, "adapter_model.safetensors")
        save_file(tensors(load_file(w)), w)
    for f in drop:
        os.remove(os.path.join(dst, f))
    return dst


def _rename(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def _edit(key_part: str, fn):
    return lambda t: {k: (fn(v) if key_part in k else v) for k, v in t.items()}


Q_A = "layers.0.self_attn.q_proj.lora_A"


def _bad_nan(v):
    v = v.clone()
    v[0, 0] = float("nan")
    return v


REFUSALS = {
    # name: (variant kwargs, max_rank, message pattern)
    "no folder": (None, 8, "no such folder"),
    "no config": (dict(drop=["adapter_config.json"]), 8, "no adapter_config.json"),
    "no weights": (dict(drop=["adapter_model.safetensors"]), 8, "no adapter_model.safetensors"),
    "malformed json": ("{not json", 8, "not valid JSON"),
    "json not an object": ("[1, 2]", 8, "JSON object"),
    "bad safetensors": (b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!", 8, "does not parse as safetensors"),
    "not lora": (dict(config={"peft_type": "IA3"}), 8, "peft_type is 'IA3'"),
    "rank above max": ({}, 4, "rank 8, above the maximum LoRA rank 4"),
    "lm_head target": (dict(config={"target_modules": ["q_proj", "lm_head"]}), 8, r"lm_head.*only q_proj"),
    "lm_head tensor": (dict(tensors=_rename("model.layers.0.self_attn.q_proj", "lm_head")), 8, "lm_head"),
    "embedding tensor": (dict(tensors=lambda t: {**t, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 49)}), 8, "embedding LoRA"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), 8, "modules_to_save"),
    "dora": (dict(config={"use_dora": True}), 8, "DoRA"),
    "bias": (dict(config={"bias": "all"}), 8, "bias='all'"),
    "lora_bias": (dict(config={"lora_bias": True}), 8, "lora_B"),
    "shape mismatch": (dict(tensors=_edit(Q_A, lambda v: v[:, :64].contiguous())), 8, r"do not fit the model.*another base model"),
    "layer out of range": (dict(tensors=_rename("layers.1.", "layers.7.")), 8, "layer 7, the model has 2 layers"),
    "nan": (dict(tensors=_edit(Q_A, _bad_nan)), 8, "NaN or infinite"),
    "inf": (dict(tensors=_edit("layers.1.mlp.down_proj.lora_B", lambda v: v / 0)), 8, "NaN or infinite"),
    "missing B": (dict(tensors=lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up_proj.lora_B" not in k}), 8, "lora_A without lora_B"),
    "rank vs config": (dict(config={"r": 4}), 8, "rank 8 in its weights but 4"),
    "no lora weights": (dict(tensors=lambda t: {}), 8, "no LoRA weights"),
    "integer weights": (dict(tensors=_edit(Q_A, lambda v: v.to(torch.int32))), 8, "expected floating point"),
    "bad r": (dict(config={"r": "eight"}), 8, "r must be a positive number"),
    "bad pattern": (dict(config={"rank_pattern": {"q_proj(": 8}}), 8, r"'q_proj\(': regular expressions in rank_pattern/alpha_pattern are not supported"),
    "regex pattern": (dict(config={"alpha_pattern": {"layers.0.*": 8}}), 8, "regular expressions.*give module names"),
    "empty pattern key": (dict(config={"rank_pattern": {"": 8}}), 8, "regular expressions"),
    "long pattern key": (dict(config={"rank_pattern": {"a" * 257: 8}}), 8, "257 characters, at most 256"),
    "many pattern keys": (dict(config={"alpha_pattern": {f"m{i}": 8 for i in range(4097)}}), 8, "4097 keys, at most 4096"),
    "absurd alpha": (dict(config={"lora_alpha": 1e300}), 8, r"scaling 1.25e\+299 .*above the accepted 1e\+06"),
    "absurd alpha_pattern": (dict(config={"alpha_pattern": {"q_proj": 1e7}}), 8, "layer 0 q_proj has scaling"),
    "scaled B overflows": (
        dict(config={"lora_alpha": 1e5}, tensors=_edit("layers.1.mlp.down_proj.lora_B", lambda v: v * 1e36)),
        8,
        "layer 1 down_proj: lora_B times the scaling 12500 overflows float32",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_lora_errors_naming_the_adapter(lora_setup, tmp_path, case):
    spec, adapters = lora_setup
    src = adapters["all"][0]
    how, max_rank, pattern = REFUSALS[case]
    dst = str(tmp_path / "adapter")
    if how is None:
        path = str(tmp_path / "missing")
    elif isinstance(how, str):
        path = _variant(src, dst)
        with open(os.path.join(path, "adapter_config.json"), "w") as fh:
            fh.write(how)
    elif isinstance(how, bytes):
        path = _variant(src, dst)
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as fh:
            fh.write(how)
    else:
        path = _variant(src, dst, **how)
    with pytest.raises(LoRAError, match=pattern) as e:
        load_peft_adapter(path, spec, max_rank=max_rank)
    assert path in str(e.value)


def test_bin_weights_are_refused_never_unpickled(lora_setup, tmp_path):
    spec, adapters = lora_setup
    path = _variant(adapters["all"][0], str(tmp_path / "bin"), drop=["adapter_model.safetensors"])
    with open(os.path.join(path, "adapter_model.bin"), "wb") as fh:
        fh.write(b"\x80\x04not read")
    with pytest.raises(LoRAError, match="pickle, never unpickled"):
        load_peft_adapter(path, spec, max_rank=8)


def test_another_base_model_name_is_not_an_error(lora_setup, tmp_path):
    spec, adapters = lora_setup
    path = _variant(adapters["all"][0], str(tmp_path / "other"), config={"base_model_name_or_path": "someone/other-model"})
    assert load_peft_adapter(path, spec, max_rank=8).base_model_name == "someone/other-model"


def test_an_adapter_for_another_model_is_refused_by_shapes(lora_setup):
    spec, adapters = lora_setup
    other = LoRAModelSpec(num_layers=2, hidden_size=128, q_size=128, kv_size=128, intermediate_size=256)
    with pytest.raises(LoRAError, match="k_proj.*do not fit the model"):
        load_peft_adapter(adapters["all"][0], other, max_rank=8)


def test_a_redos_pattern_is_refused_at_once(lora_setup, tmp_path):
    """rank_pattern keys are never run as regexes: PEFT's ``(.*\\.)?(key)$`` with this key
    backtracks for ages; here it is refused by its characters, in no time."""
    import time

    spec, adapters = lora_setup
    key = "(.*.*.*.*.*.*.*.*.*.*.*.*)*Z"
    path = _variant(adapters["all"][0], str(tmp_path / "redos"), config={"rank_pattern": {key: 8}})
    t0 = time.perf_counter()
    with pytest.raises(LoRAError, match="regular expressions in rank_pattern/alpha_pattern are not supported") as e:
        load_peft_adapter(path, spec, max_rank=8)
    assert time.perf_counter() - t0 < 0.5
    assert key in str(e.value)


def test_plain_pattern_keys_match_like_peft(lora_setup, tmp_path):
    """Plain keys (PEFT's escaped dots unescaped) match the module name or a suffix after a dot;
    the escaped spelling of the "pattern" adapter reads the same weights; a key that is only the
    end of a name part ("proj") matches nothing, as in PEFT."""
    spec, adapters = lora_setup
    src = adapters["pattern"][0]
    want = load_peft_adapter(src, spec, max_rank=8)
    escaped = {
        "rank_pattern": {"q_proj": 4, "layers\\.1\\.mlp\\.down_proj": 2},
        "alpha_pattern": {"v_proj": 32, "model\\.layers\\.0\\.mlp\\.gate_proj": 4},
    }
    got = load_peft_adapter(_variant(src, str(tmp_path / "escaped"), config=escaped), spec, max_rank=8)
    assert sorted(got.weights) == sorted(want.weights)
    for k, (a, b) in want.weights.items():
        assert torch.equal(got.weights[k][0], a) and torch.equal(got.weights[k][1], b), k
    full = {"rank_pattern": {}, "alpha_pattern": {"model.layers.0.self_attn.q_proj": 160}}  # PEFT's full module name
    a0 = load_peft_adapter(adapters["all"][0], spec, max_rank=8)
    a1 = load_peft_adapter(_variant(adapters["all"][0], str(tmp_path / "full"), config=full), spec, max_rank=8)
    torch.testing.assert_close(a1.weights[(0, "qkv")][1][:128, :8], a0.weights[(0, "qkv")][1][:128, :8] * 10)  # alpha 160 vs 16
    assert torch.equal(a1.weights[(0, "qkv")][1][128:], a0.weights[(0, "qkv")][1][128:])  # k, v of layer 0
    assert torch.equal(a1.weights[(1, "qkv")][1], a0.weights[(1, "qkv")][1])
    suffix = _variant(adapters["all"][0], str(tmp_path / "suffix"), config={"rank_pattern": {"proj": 4}})
    assert load_peft_adapter(suffix, spec, max_rank=8).rank == 8
