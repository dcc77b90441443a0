"""Bad model files (issue 46): truncated, corrupted and inconsistent GGUF files, safetensors
checkpoints and config.json, hand-made and fuzzed (hypothesis). Each must fail with a
``ModelFileError`` (a ValueError) whose text is one line naming the file, without a hang and
without allocating from an unchecked header field; a file the checks pass must then load.

The files are small: a tiny llama checkpoint (vocab 512, no tokenizer) and a tiny GGUF with a
300-token byte-level BPE tokenizer, written with the ``gguf`` package. ``PAGEDSERVE_CACHE`` points
at a temporary folder for the module. ``PAGEDSERVE_MODEL_FUZZ_EXAMPLES`` sets the examples per
fuzz test (default 150; the slow variant runs 10x and also mutates the real SmolLM2 GGUF header).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
gguf = pytest.importorskip("gguf")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gguf_utils import write_tiny_gguf  # noqa: E402
from pagedserve.model import files as model_files, loader, validation  # noqa: E402
from pagedserve.model.validation import ModelFileError  # noqa: E402

EXAMPLES = int(os.environ.get("PAGEDSERVE_MODEL_FUZZ_EXAMPLES", "150"))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- tiny files ---------------------------------------------------------------------------------------
def write_tiny_hf(path: str) -> str:
    """A tiny random llama checkpoint: config.json + model.safetensors (no tokenizer)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for extra in os.listdir(path):
        if extra not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(path, extra))
    return path


def st_header(data: bytes) -> tuple[int, dict]:
    n = struct.unpack_from("<Q", data)[0]
    return n, json.loads(data[8:8 + n])


def st_with_header(data: bytes, header: dict) -> bytes:
    """``data`` (a safetensors file) with its JSON header replaced."""
    n = struct.unpack_from("<Q", data)[0]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def gguf_offsets(path: str) -> dict:
    """Byte offsets of a GGUF file's header fields (from the gguf package's reader):
    ``counts`` (tensor and metadata counts), ``values`` (metadata key -> value offset),
    ``string_lengths``, and per tensor its ``dims``, ``type`` and ``offset`` fields."""
    r = gguf.GGUFReader(path)
    out = {"counts": [8, 16], "values": {}, "string_lengths": [], "dims": [], "types": [], "tensor_offsets": [],
           "data_offset": r.data_offset}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        out["string_lengths"].append(f.offset)
        out["values"][key] = f.offset + 8 + len(key.encode()) + 4  # past the key and its value type
    for t in r.tensors:
        off = t.field.offset
        out["string_lengths"].append(off)
        off += 8 + len(t.name.encode())
        out["dims"].extend(off + 4 + 8 * i for i in range(len(t.shape)))
        off += 4 + 8 * len(t.shape)
        out["types"].append(off)
        out["tensor_offsets"].append(off + 4)
    return out


# -- what a load does with the files ------------------------------------------------------------
def load_chain(path: str) -> str:
    """What a start does with a model path, short of the KV cache: resolve (convert a GGUF),
    read the config, and load every weight into a real (tiny) model."""
    from pagedserve.model.llama import LlamaForCausalLM
    from pagedserve.model.quant_linear import quantize_modules

    model_dir = loader.resolve_model(path)
    cfg = loader.load_config(model_dir)
    model = LlamaForCausalLM(cfg, 64)
    quantized = loader.gguf_quantized_modules(model_dir, LlamaForCausalLM.module_of)
    quantize_modules(model, quantized)
    model.load_weights(loader.iterate_weights(model_dir, cfg, quantized=bool(quantized)))
    return model_dir


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail (instead of hanging the suite) when the body runs longer than ``seconds``."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def assert_clean(path: str, fn=load_chain):
    """``fn(path)`` either works or raises a one-line ModelFileError naming ``path`` (or a file
    inside it); anything else fails the test. Returns the error or None."""
    try:
        with time_limit(60):
            fn(path)
        return None
    except ModelFileError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 1000, msg
        assert e.path.startswith(path) or e.path.startswith(loader.cache_dir()), (path, msg)
        assert msg.startswith(e.path + ": ") and e.what, msg
        assert "Traceback" not in msg
        return e


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Pristine tiny files, and PAGEDSERVE_CACHE in a temporary folder while the module runs."""
    base = tmp_path_factory.mktemp("model-files")
    old = os.environ.get("PAGEDSERVE_CACHE")
    os.environ["PAGEDSERVE_CACHE"] = str(base / "cache")
    hf = write_tiny_hf(str(base / "hf"))
    g = write_tiny_gguf(str(base / "tiny.gguf"))
    with open(os.path.join(hf, "model.safetensors"), "rb") as fh:
        st_bytes = fh.read()
    with open(os.path.join(hf, "config.json")) as fh:
        config = json.load(fh)
    with open(g, "rb") as fh:
        g_bytes = fh.read()
    yield {"base": str(base), "hf": hf, "gguf": g, "st": st_bytes, "config": config, "gguf_bytes": g_bytes,
           "gguf_offsets": gguf_offsets(g)}
    if old is None:
        os.environ.pop("PAGEDSERVE_CACHE", None)
    else:
        os.environ["PAGEDSERVE_CACHE"] = old


def hf_case(files, st_bytes: bytes | None = None, config: dict | None = None, raw_config: bytes | None = None) -> str:
    d = tempfile.mkdtemp(dir=files["base"], prefix="hf-")
    with open(os.path.join(d, "model.safetensors"), "wb") as fh:
        fh.write(files["st"] if st_bytes is None else st_bytes)
    with open(os.path.join(d, "config.json"), "wb") as fh:
        fh.write(raw_config if raw_config is not None else json.dumps(config or files["config"]).encode())
    return d


def gguf_case(files, data: bytes) -> str:
    fd, path = tempfile.mkstemp(dir=files["base"], prefix="g-", suffix=".gguf")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


def patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def edit_header(data: bytes, tensor: str, **fields) -> bytes:
    _, h = st_header(data)
    h[tensor].update(fields)
    return st_with_header(data, h)


# -- the good files pass ------------------------------------------------------------------------------
def test_valid_files_load(files):
    assert list(_st_cases(files)) == _ST_IDS and list(_gguf_cases(files)) == _GGUF_IDS  # every case runs
    assert assert_clean(files["hf"]) is None
    with time_limit(120):
        model_dir = load_chain(files["gguf"])
    assert os.path.exists(os.path.join(model_dir, ".complete"))
    assert load_chain(files["gguf"]) == model_dir  # the cached copy, validated again
    # The real default model's header (92 MB, 272 Q4_1/Q8_0/F32 tensors, 49152-token vocab).
    header = validation.read_gguf_header(loader.default_model_path())
    assert len(header.tensors) == 272 and len(model_files._gguf_weight_names(header)) == 272


# -- hand-made bad files: each named case of the issue ------------------------------------------
def _st_cases(files):
    data, n = files["st"], st_header(files["st"])[0]
    up = st_header(data)[1]["model.layers.0.mlp.up_proj.weight"]
    return {
        "st-truncated-in-data": (data[: len(data) // 2], None, "runs past the end of the file"),
        "st-truncated-in-header": (data[: n // 2], None, "runs past the end of the file"),
        "st-truncated-to-4-bytes": (data[:4], None, "too short"),
        "st-empty": (b"", None, "too short"),
        "st-header-length-2**60": (patch(data, 0, "<Q", 2**60), None, "header length 1152921504606846976"),
        "st-header-not-json": (data[:8] + b"\xff" * n + data[8 + n:], None, "not valid JSON"),
        "st-header-json-list": (st_with_header(data, []), None, "not an object"),
        "st-dim-2**62": (edit_header(data, "model.norm.weight", shape=[2**62, 2**62]), None, "dimension 4611686018427387904"),
        "st-dtype-unknown": (edit_header(data, "model.norm.weight", dtype="Q9"), None, "unknown dtype 'Q9'"),
        "st-dtype-int": (edit_header(data, "model.norm.weight", dtype="I32"), None, "has dtype I32"),
        "st-offsets-past-eof": (edit_header(data, "model.norm.weight", data_offsets=[0, 2**40]), None, "runs past the end"),
        "st-shape-not-matching-bytes": (edit_header(data, "model.norm.weight", shape=[63]), None, "needs 252 bytes"),
        "st-shape-swapped": (edit_header(data, "model.layers.0.mlp.up_proj.weight", shape=up["shape"][::-1]), None, "expected (128, 64)"),
        "st-trailing-bytes": (data + b"\0" * 64, None, "trailing bytes"),
        "cfg-hidden-10**12": (None, {"hidden_size": 10**12}, "hidden_size=1000000000000"),
        "cfg-layers-10**9": (None, {"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
        "cfg-layers-3": (None, {"num_hidden_layers": 3}, "checkpoint has weights for 2 layers"),
        "cfg-vocab-10**12": (None, {"vocab_size": 10**12}, "vocab_size"),
        "cfg-max-positions-10**12": (None, {"max_position_embeddings": 10**12}, "max_position_embeddings"),
        "cfg-intermediate-in-range-but-wrong": (None, {"intermediate_size": 1 << 20}, "1048576)"),
        "cfg-hidden-string": (None, {"hidden_size": "64"}, "hidden_size='64'"),
        "cfg-heads-zero": (None, {"num_attention_heads": 0}, "num_attention_heads=0"),
        "cfg-kv-heads-not-dividing": (None, {"num_key_value_heads": 3}, "not a multiple"),
        "cfg-eos-dict": (None, {"eos_token_id": {"a": 1}}, "eos_token_id"),
        "cfg-eps-negative": (None, {"rms_norm_eps": -1.0}, "rms_norm_eps"),
        "cfg-model-type-bert": (None, {"model_type": "bert"}, "not supported"),
        "cfg-quantized": (None, {"quantization_config": {"quant_method": "gptq"}}, "quantized"),
        "cfg-not-json": (None, b'{"model_type": "llama", ', "not valid JSON"),
        "cfg-json-list": (None, b"[1, 2]", "not an object"),
        "cfg-binary": (None, b"\x00\xff\xfe" * 10, "not valid JSON"),
    }


_ST_IDS = ["st-truncated-in-data", "st-truncated-in-header", "st-truncated-to-4-bytes", "st-empty", "st-header-length-2**60",
           "st-header-not-json", "st-header-json-list", "st-dim-2**62", "st-dtype-unknown", "st-dtype-int",
           "st-offsets-past-eof", "st-shape-not-matching-bytes", "st-shape-swapped", "st-trailing-bytes",
           "cfg-hidden-10**12", "cfg-layers-10**9", "cfg-layers-3", "cfg-vocab-10**12", "cfg-max-positions-10**12",
           "cfg-intermediate-in-range-but-wrong", "cfg-hidden-string", "cfg-heads-zero", "cfg-kv-heads-not-dividing",
           "cfg-eos-dict", "cfg-eps-negative", "cfg-model-type-bert", "cfg-quantized", "cfg-not-json", "cfg-json-list",
           "cfg-binary"]


@pytest.mark.parametrize("case", _ST_IDS)
def test_bad_hf_checkpoint(files, case):
    st_bytes, cfg, fragment = _st_cases(files)[case]
    if isinstance(cfg, bytes):
        d = hf_case(files, raw_config=cfg)
    else:
        d = hf_case(files, st_bytes=st_bytes, config={**files["config"], **(cfg or {})})
    err = assert_clean(d)
    assert err is not None, f"{case}: loaded"
    assert fragment in str(err), str(err)
    expected_file = "config.json" if case.startswith("cfg-") and case != "cfg-intermediate-in-range-but-wrong" else "model.safetensors"
    assert os.path.basename(err.path) == expected_file, str(err)


def _gguf_cases(files):
    data, off = files["gguf_bytes"], files["gguf_offsets"]
    values = off["values"]
    last_offset = off["tensor_offsets"][-1]
    return {
        "gguf-truncated-in-data": (data[: len(data) // 2], "runs past the end of the file"),
        "gguf-truncated-in-header": (data[: off["data_offset"] // 2], "GGUF header truncated"),
        "gguf-truncated-by-100": (data[:-100], "runs past the end of the file"),
        "gguf-truncated-to-10": (data[:10], "too short"),
        "gguf-not-gguf": (b"PK\x03\x04" + data[4:], "not a GGUF file"),
        "gguf-version-99": (patch(data, 4, "<I", 99), "version 99"),
        "gguf-dim-2**62": (patch(data, off["dims"][0], "<Q", 2**62), "dimension 4611686018427387904"),
        "gguf-ggml-type-unknown": (patch(data, off["types"][0], "<I", 9999), "unknown ggml type 9999"),
        "gguf-ggml-type-int": (patch(data, off["types"][1], "<I", int(gguf.GGMLQuantizationType.I32)), "ggml type I32"),
        "gguf-data-past-eof": (patch(data, off["tensor_offsets"][0], "<Q", 2**40), "runs past the end of the file"),
        "gguf-last-tensor-past-eof": (patch(data, last_offset, "<Q", struct.unpack_from("<Q", data, last_offset)[0] + 4096),
                                      "runs past the end of the file"),
        "gguf-tensors-overlap": (patch(data, off["tensor_offsets"][1], "<Q", struct.unpack_from("<Q", data, off["tensor_offsets"][0])[0]), "overlap"),
        "gguf-misaligned": (patch(data, off["tensor_offsets"][1], "<Q", struct.unpack_from("<Q", data, off["tensor_offsets"][1])[0] + 1), "aligned"),
        "gguf-tensor-count-2**60": (patch(data, off["counts"][0], "<Q", 2**60), "do not fit"),
        "gguf-kv-count-2**60": (patch(data, off["counts"][1], "<Q", 2**60), "do not fit"),
        "gguf-array-length-2**40": (patch(data, values["tokenizer.ggml.token_type"] + 4, "<Q", 2**40), "array items"),
        "gguf-string-length-2**62": (patch(data, off["string_lengths"][0], "<Q", 2**62), "bytes long"),
        "gguf-value-type-99": (patch(data, values["general.name"] - 4, "<I", 99), "unknown value type 99"),
        "gguf-meta-hidden-2**31": (patch(data, values["llama.embedding_length"], "<I", 2**31), "hidden_size=2147483648"),
        "gguf-meta-layers-10**9": (patch(data, values["llama.block_count"], "<I", 10**9), "num_hidden_layers=1000000000"),
        "gguf-meta-layers-3": (patch(data, values["llama.block_count"], "<I", 3), "weights for 2 layers"),
        "gguf-meta-ffn-in-range-but-wrong": (patch(data, values["llama.feed_forward_length"], "<I", 1 << 20), "expected"),
        "gguf-meta-heads-0": (patch(data, values["llama.attention.head_count"], "<I", 0), "num_attention_heads"),
    }


_GGUF_IDS = ["gguf-truncated-in-data", "gguf-truncated-in-header", "gguf-truncated-by-100", "gguf-truncated-to-10",
             "gguf-not-gguf", "gguf-version-99", "gguf-dim-2**62", "gguf-ggml-type-unknown", "gguf-ggml-type-int",
             "gguf-data-past-eof", "gguf-last-tensor-past-eof", "gguf-tensors-overlap", "gguf-misaligned",
             "gguf-tensor-count-2**60", "gguf-kv-count-2**60", "gguf-array-length-2**40", "gguf-string-length-2**62",
             "gguf-value-type-99", "gguf-meta-hidden-2**31", "gguf-meta-layers-10**9", "gguf-meta-layers-3",
             "gguf-meta-ffn-in-range-but-wrong", "gguf-meta-heads-0"]


@pytest.mark.parametrize("case", _GGUF_IDS)
def test_bad_gguf(files, case):
    data, fragment = _gguf_cases(files)[case]
    path = gguf_case(files, data)
    err = assert_clean(path)
    assert err is not None, f"{case}: loaded"
    assert err.path == path and fragment in str(err), str(err)
    assert not glob.glob(os.path.join(loader.cache_dir(), "gguf", os.path.basename(path)[:-5] + "-*")), "a failed conversion left a folder"


def test_gguf_unknown_tensor_is_an_error(files):
    path = write_tiny_gguf(os.path.join(files["base"], "extra.gguf"), extra_tensors=(("rope_freqs.weight", (8,)),))
    err = assert_clean(path)
    assert err is not None and "'rope_freqs.weight' is not a llama-family weight" in str(err), err


def test_error_pickles_and_is_a_value_error():
    import pickle

    e = ModelFileError("/m/model.safetensors", "bad\nthing   here")
    assert isinstance(e, ValueError) and str(e) == "/m/model.safetensors: bad thing here"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is ModelFileError and str(back) == str(e) and back.path == e.path


# -- the conversion cache ---------------------------------------------------------------------------------------
def test_failed_conversion_leaves_nothing_and_a_broken_cache_is_redone(files, monkeypatch):
    path = gguf_case(files, files["gguf_bytes"])
    gguf_cache = os.path.join(loader.cache_dir(), "gguf")
    stem = os.path.basename(path)[:-5]
    real = model_files._write_source

    def dies_midway(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(model_files, "_write_source", dies_midway)
    err = assert_clean(path)
    assert err is not None and "conversion to" in str(err) and "RuntimeError: disk on fire" in str(err), err
    assert not glob.glob(os.path.join(gguf_cache, stem + "-*")), os.listdir(gguf_cache)
    monkeypatch.setattr(model_files, "_write_source", real)
    out = load_chain(path)
    assert os.path.exists(os.path.join(out, ".complete"))
    # No weights are written: the folder holds the config, the tokenizer and source.json.
    assert not glob.glob(os.path.join(out, "*.safetensors")) and model_files.gguf_source(out) == os.path.abspath(path)
    # A crash mid-conversion (kill -9) leaves <out>.tmp<pid>: removed by the next conversion.
    stale = out + ".tmp999999999"
    os.makedirs(stale)
    # A published folder whose config got truncated later is not trusted: written again.
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path, "r+b") as fh:
        fh.truncate(os.path.getsize(cfg_path) // 2)
    assert load_chain(path) == out
    assert validation.read_json(cfg_path, "config.json") and not os.path.exists(stale)


# -- through LLM(...) and the CLI -----------------------------------------------------------------------
def test_llm_raises_model_file_error(files):
    from pagedserve import LLM

    cases = _gguf_cases(files)
    bad_gguf = gguf_case(files, cases["gguf-data-past-eof"][0])
    bad_dir = hf_case(files, config={**files["config"], "hidden_size": 10**12})
    for path in (bad_gguf, bad_dir):
        with pytest.raises(ValueError) as info:
            LLM(path, dtype="float32", num_kv_blocks=16, max_model_len=64)
        assert isinstance(info.value, ModelFileError) and "\n" not in str(info.value), info.value
        assert str(info.value).startswith(path), info.value


def test_cli_prints_one_line(files):
    """``pagedserve generate`` and ``serve`` with a bad model (run at once, in subprocesses):
    exit status 2, no traceback, one error line naming the file. ``serve`` listens before it
    loads, so INFO lines (listening, uvicorn start and shutdown) come before it."""
    cases = _gguf_cases(files)
    bad_gguf = gguf_case(files, cases["gguf-truncated-in-data"][0])
    bad_dir = hf_case(files, config={**files["config"], "num_hidden_layers": 10**9})
    runs = [(["generate", "--model", bad_gguf, "--prompt", "hi"], bad_gguf),
            (["serve", "--model", bad_dir, "--port", "0"], os.path.join(bad_dir, "config.json"))]
    env = dict(os.environ, PAGEDSERVE_CACHE=loader.cache_dir(), TOKENIZERS_PARALLELISM="false")
    procs = [subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for args, _ in runs]
    for (args, named), proc in zip(runs, procs):
        _, stderr = proc.communicate(timeout=300)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and "Traceback" not in stderr, (args, proc.returncode, stderr[-3000:])
        assert lines and lines[-1].startswith(f"pagedserve {args[0]}: error: {named}: "), (args, stderr[-3000:])
        others = lines[:-1]
        assert all(line.startswith("INFO") for line in others) and (args[0] == "serve" or not others), (args, stderr[-3000:])


# -- memory: a failing load allocates nothing sized by the file ---------------------------------------
MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from pagedserve.model import loader
    from pagedserve.model.validation import ModelFileError
    from pagedserve.model.llama import LlamaForCausalLM

    def status_kb(field):
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))

    def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            return True
        except OSError:
            return False

    warm, cases = json.loads(sys.argv[1])
    loader.resolve_model(warm)  # imports and one conversion
    out = {}
    for name, path in cases.items():
        exact = reset_peak()
        before = status_kb("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            d = loader.resolve_model(path)
            LlamaForCausalLM(loader.load_config(d), 64).load_weights(loader.iterate_safetensors_weights(d))
            out[name] = "loaded"
        except ModelFileError as e:
            out[name] = "ModelFileError"
        except BaseException as e:
            out[name] = f"{type(e).__name__}: {e}"[:300]
        peak = status_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out[name + ".peak_mb"] = (peak - before) / 1024
    if sys.argv[2:] == ["control"]:  # the measure sees a real allocation
        import torch
        reset_peak()
        before = status_kb("VmRSS")
        x = torch.ones(64 << 20, dtype=torch.uint8)
        out["control.peak_mb"] = (status_kb("VmHWM") - before) / 1024
    print(json.dumps(out))
""")


def test_failing_loads_use_bounded_memory(files):
    """Absurd sizes in headers and configs, a few within the per-field bounds (those would have
    allocated gigabytes before the shapes were checked): the peak RSS of the process, measured
    in a subprocess after a warm-up conversion, grows by less than 64 MB over all of them."""
    g, hf = _gguf_cases(files), _st_cases(files)
    cases = {name: gguf_case(files, g[name][0]) for name in
             ("gguf-dim-2**62", "gguf-array-length-2**40", "gguf-kv-count-2**60", "gguf-meta-hidden-2**31",
              "gguf-meta-ffn-in-range-but-wrong", "gguf-data-past-eof")}
    for name in ("st-header-length-2**60", "st-dim-2**62", "st-offsets-past-eof"):
        cases[name] = hf_case(files, st_bytes=hf[name][0])
    for name in ("cfg-hidden-10**12", "cfg-layers-10**9", "cfg-intermediate-in-range-but-wrong", "cfg-max-positions-10**12"):
        cases[name] = hf_case(files, config={**files["config"], **hf[name][1]})
    warm = gguf_case(files, files["gguf_bytes"])  # its own name, so its own cache key: a real conversion
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, json.dumps([warm, cases]), "control"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(out[name] == "ModelFileError" for name in cases), out
    peak = max(out[name + ".peak_mb"] for name in cases)
    print("peak RSS growth of a failing load: %.1f MB (64 MB control: %.1f MB)" % (peak, out["control.peak_mb"]), out)
    assert peak < 32, out
    assert out["control.peak_mb"] > 60, out  # the measure is not blind


# -- fuzzing ------------------------------------------------------------------------------------------------
ABSURD = [0, 1, 7, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**60, 2**62, 2**63 - 1, 2**64 - 1]
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.sampled_from(ABSURD + [-1, -(2**63), 10**12, 10**30]),
                        st.integers(-10, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                        st.lists(st.integers(-5, 2**40), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
CONFIG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                 "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias", "eos_token_id", "bos_token_id",
                 "model_type", "hidden_act", "sliding_window", "torch_dtype", "dtype", "layer_types"]


def _hf_mutation(data_st: bytes, config: dict):
    n = st_header(data_st)[0]
    header = st_header(data_st)[1]
    names = sorted(k for k in header if k != "__metadata__")
    size = len(data_st)
    return st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, size - 1)),
        st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 8 + n - 1), st.integers(0, 255)), min_size=1, max_size=8)),
        st.tuples(st.just("u64"), st.integers(0, 8 + n - 8), st.sampled_from(ABSURD)),
        st.tuples(st.just("entry"), st.sampled_from(names), st.sampled_from(["dtype", "shape", "data_offsets"]),
                  st.one_of(st.sampled_from(list(validation.SAFETENSORS_BITS) + ["Q9", "", "f32"]),
                            st.lists(st.sampled_from(ABSURD + [64, 128, 512]), max_size=4),
                            st.tuples(st.sampled_from(ABSURD), st.sampled_from(ABSURD)).map(list), JSON_VALUES)),
        st.tuples(st.just("drop"), st.sampled_from(names)),
        st.tuples(st.just("config"), st.sampled_from(CONFIG_FIELDS), JSON_VALUES),
        st.tuples(st.just("config-text"), st.integers(0, len(json.dumps(config)))),
    )


def _apply_hf(files, m) -> str:
    data, cfg = files["st"], dict(files["config"])
    kind = m[0]
    if kind == "truncate":
        return hf_case(files, st_bytes=data[: m[1]])
    if kind == "flip":
        b = bytearray(data)
        for off, val in m[1]:
            b[off] = val
        return hf_case(files, st_bytes=bytes(b))
    if kind == "u64":
        return hf_case(files, st_bytes=patch(data, m[1], "<Q", m[2]))
    if kind == "entry":
        _, h = st_header(data)
        h[m[1]][m[2]] = m[3]
        return hf_case(files, st_bytes=st_with_header(data, h))
    if kind == "drop":
        _, h = st_header(data)
        del h[m[1]]
        return hf_case(files, st_bytes=st_with_header(data, h))
    if kind == "config":
        cfg[m[1]] = m[2]
        return hf_case(files, config=cfg)
    return hf_case(files, raw_config=json.dumps(cfg).encode()[: m[1]])


def _gguf_mutation(files):
    data, off = files["gguf_bytes"], files["gguf_offsets"]
    u64_fields = off["counts"] + off["string_lengths"] + off["dims"] + off["tensor_offsets"] + \
        [v + 4 for k, v in off["values"].items() if k.startswith("tokenizer.ggml.t")]  # array lengths
    u32_fields = off["types"] + [v - 4 for v in off["values"].values()] + \
        [v for k, v in off["values"].items() if k.startswith("llama.") and "rope.freq" not in k and "epsilon" not in k]
    return st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, len(data) - 1)),
        st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, off["data_offset"] - 1), st.integers(0, 255)), min_size=1, max_size=6)),
        st.tuples(st.just("u64"), st.sampled_from(u64_fields), st.sampled_from(ABSURD + [1, 2, 3, 64])),
        st.tuples(st.just("u32"), st.sampled_from(u32_fields), st.sampled_from([v for v in ABSURD if v < 2**32] + [2, 3, 9, 12, 30, 64])),
    )


def _apply_gguf(files, m) -> str:
    data = files["gguf_bytes"]
    if m[0] == "truncate":
        return gguf_case(files, data[: m[1]])
    if m[0] == "flip":
        b = bytearray(data)
        for o, v in m[1]:
            b[o] = v
        return gguf_case(files, bytes(b))
    return gguf_case(files, patch(data, m[1], "<Q" if m[0] == "u64" else "<I", m[2]))


def _fuzz_settings(n: int, derandomize: bool = True):
    """Default suite: the same examples every run; the slow variant draws new ones each time
    (a failure prints the blob to replay it with ``@reproduce_failure``)."""
    return settings(max_examples=n, deadline=None, database=None, derandomize=derandomize, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def _fuzz_hf(files, n: int, derandomize: bool = True) -> None:
    seen = {"loaded": 0, "error": 0}

    @_fuzz_settings(n, derandomize)
    @given(m=_hf_mutation(files["st"], files["config"]))
    def run(m):
        d = _apply_hf(files, m)
        try:
            outcome = "error" if assert_clean(d) is not None else "loaded"
            seen[outcome] += 1
            seen[f"{m[0]}:{outcome}"] = seen.get(f"{m[0]}:{outcome}", 0) + 1
        finally:
            shutil.rmtree(d, ignore_errors=True)

    run()
    print("hf fuzz:", seen)
    assert seen["error"] > 0


def _fuzz_gguf(files, n: int, derandomize: bool = True) -> None:
    seen = {"loaded": 0, "error": 0}

    @_fuzz_settings(n, derandomize)
    @given(m=_gguf_mutation(files))
    def run(m):
        path = _apply_gguf(files, m)
        try:
            outcome = "error" if assert_clean(path) is not None else "loaded"
            seen[outcome] += 1
            seen[f"{m[0]}:{outcome}"] = seen.get(f"{m[0]}:{outcome}", 0) + 1
        finally:
            os.remove(path)
            # A loaded mutation's converted copy (its own cache key) is not needed again.
            for d in glob.glob(os.path.join(loader.cache_dir(), "gguf", os.path.basename(path)[:-5] + "-*")):
                shutil.rmtree(d, ignore_errors=True)

    run()
    print("gguf fuzz:", seen)
    assert seen["error"] > 0


def test_fuzz_hf_checkpoints(files):
    _fuzz_hf(files, EXAMPLES)


def test_fuzz_gguf(files):
    _fuzz_gguf(files, EXAMPLES)


@pytest.mark.slow
def test_fuzz_long(files):
    _fuzz_hf(files, 10 * EXAMPLES, derandomize=False)
    _fuzz_gguf(files, 10 * EXAMPLES, derandomize=False)


@pytest.mark.slow
def test_fuzz_real_gguf_header(files):
    """Header mutations of the real SmolLM2 GGUF (92 MB, 49152-token vocab): the header check
    (and the tensor-name map) either passes or gives a one-line error, quickly."""
    real = loader.default_model_path()
    size = os.path.getsize(real)
    data_offset = validation.read_gguf_header(real).data_start
    with open(real, "rb") as fh:
        head = fh.read(data_offset)
    path = os.path.join(files["base"], "real-mutated.gguf")
    shutil.copyfile(real, path)

    def check(p):
        model_files._gguf_weight_names(validation.read_gguf_header(p))

    @_fuzz_settings(EXAMPLES, derandomize=False)
    @given(flips=st.lists(st.tuples(st.integers(0, data_offset - 1), st.integers(0, 255)), min_size=1, max_size=6),
           cut=st.one_of(st.none(), st.integers(0, size - 1)))
    def run(flips, cut):
        b = bytearray(head)
        for o, v in flips:
            b[o] = v
        with open(path, "r+b") as fh:
            fh.write(b)
            fh.truncate(cut if cut is not None else size)
        try:
            assert_clean(path, check)
        finally:
            with open(path, "r+b") as fh:  # back to the real file
                fh.write(head)
            if cut is not None:
                shutil.copyfile(real, path)

    run()


def test_front_without_torch_converts_in_a_child_and_checks_headers(files, tmp_path):
    """A server front blocks torch: it resolves a GGUF file by converting it in a child process
    (with torch, the full checks), checks an HF folder's headers and config itself, and still
    refuses a bad file with one line; torch never loads in it."""
    good = gguf_case(files, files["gguf_bytes"])
    bad = gguf_case(files, files["gguf_bytes"][: len(files["gguf_bytes"]) // 2])
    code = (
        "import sys\n"
        "from pagedserve import platform\n"
        "platform.block_torch_import()\n"
        "from pagedserve.model import files\n"
        "from pagedserve.model.validation import ModelFileError\n"
        f"out = files.resolve_model({good!r})\n"
        "tok = files.load_tokenizer(out); cfg = files.load_config(out)\n"
        f"assert files.resolve_model({files['hf']!r}) == {files['hf']!r}\n"
        "try:\n"
        f"    files.resolve_model({bad!r})\n"
        "except ModelFileError as e:\n"
        "    print('refused:', e)\n"
        "assert sys.modules.get('torch') is None, 'torch loaded'\n"
        "print(out)\n"
    )
    env = dict(os.environ, PAGEDSERVE_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert os.path.exists(os.path.join(lines[-1], ".complete")) and lines[-1].startswith(str(tmp_path / "cache"))
    refused = [line for line in lines if line.startswith("refused: ")]
    assert len(refused) == 1 and bad in refused[0] and "\n" not in refused[0]
