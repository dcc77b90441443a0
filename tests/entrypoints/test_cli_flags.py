"""The CLI shows each command the flags that apply to it (issue 47): the server's own engine
flags (data parallelism, disaggregation, the API's model names) on ``serve`` alone, a usage
error in one line; ``pagedserve cache list|clear``; the start-up log's engine pids."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.cli import build_parser, main


def _flags(field: dataclasses.Field) -> list[str]:
    return list(field.metadata["names"]) or ["--" + field.name.replace("_", "-")]


SERVE_ONLY = [n for f in dataclasses.fields(EngineConfig) if f.metadata["only"] == "serve" for n in _flags(f)]
EVERYWHERE = [n for f in dataclasses.fields(EngineConfig) if f.metadata["only"] is None and f.name != "model" for n in _flags(f)]


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _shown(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings ``--help`` lists."""
    return {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def test_the_server_only_fields_are_the_ones_the_offline_engine_has_no_use_for():
    assert {"--data-parallel-size", "-dp", "--data-parallel-backend", "--ray-address", "--threads-per-replica",
            "--pin-replica-cores", "--router", "--kv-transfer-config", "--served-model-name", "--lora-modules"} == set(SERVE_ONLY)
    assert {"--max-num-seqs", "--dtype", "-tp", "--max-step-ms", "--speculative-config", "--trace-file"} <= set(EVERYWHERE)


@pytest.mark.parametrize("command", [("generate",), ("chat",), ("bench", "throughput"), ("bench", "latency"), ("bench", "memory")])
def test_offline_commands_show_the_engine_flags_but_not_the_servers(command):
    p = _subparser(build_parser(), *command)
    shown, text = _shown(p), p.format_help()
    assert set(EVERYWHERE) <= shown and "--model" in shown, set(EVERYWHERE) - shown
    assert not shown & set(SERVE_ONLY), shown & set(SERVE_ONLY)
    for flag in ("--data-parallel-size", "--router", "--ray-address", "--kv-transfer-config", "--served-model-name"):
        assert flag not in text, (command, flag)
    assert "--max-num-seqs" in text and "--enable-prefix-caching" in text


def test_serve_shows_every_engine_flag_and_the_servers():
    p = _subparser(build_parser(), "serve")
    shown = _shown(p)
    assert set(SERVE_ONLY) <= shown and set(EVERYWHERE) <= shown
    assert {"--port", "--api-key", "--no-pin-replica-cores"} <= shown
    args = p.parse_args(["-dp", "2", "--router", "round-robin", "--served-model-name", "a", "b", "--no-pin-replica-cores"])
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.data_parallel_size, cfg.router, cfg.served_model_name, cfg.pin_replica_cores) == (2, "round-robin", ["a", "b"], False)
    cfg = EngineConfig.from_cli_args(p.parse_args(["--kv-transfer-config", '{"kv_role": "kv_both"}']))
    assert cfg.kv_transfer_config["kv_role"] == "kv_both"


def test_explain_and_proxy_take_no_engine_server_flags():
    for cmd in ("explain", "proxy"):
        assert not _shown(_subparser(build_parser(), cmd)) & {"--data-parallel-size", "--router", "--ray-address"}


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--data-parallel-size", "2"],
    ["generate", "--prompt", "hi", "--router=round-robin"],
    ["generate", "--prompt", "hi", "--no-pin-replica-cores"],
    ["chat", "--kv-transfer-config", "{}"],
    ["bench", "throughput", "-dp", "2"],
    ["bench", "latency", "--served-model-name", "x"],
])
def test_a_server_flag_offline_is_a_one_line_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "pagedserve serve" in err and "error:" in err and "usage:" not in err


def test_usage_errors_are_one_line(capsys):
    for argv in (["generate"], ["generate", "--prompt", "x", "--no-such-flag"], ["serve", "--port", "x"], ["bench", "nope"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "error:" in err, (argv, err)


def test_server_flag_given_to_generate_exits_2_in_a_subprocess():
    r = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "generate", "--prompt", "hi", "--data-parallel-size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == [
        "pagedserve generate: error: --data-parallel-size is a flag of `pagedserve serve` only: this command runs one engine "
        "in this process (see `pagedserve generate --help`)"]


# -- pagedserve cache ---------------------------------------------------------------------------
def _write(path: str, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(b"x" * size)


def _conversion(root: str, name: str, source: str, age_s: float = 0.0) -> None:
    d = os.path.join(root, "gguf", name)
    _write(os.path.join(d, "model.safetensors"), 1000)
    with open(os.path.join(d, "source.json"), "w") as fh:
        json.dump({"gguf": source}, fh)
    open(os.path.join(d, ".complete"), "w").close()
    t = time.time() - age_s
    os.utime(os.path.join(d, ".complete"), (t, t))


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    root = str(tmp_path / "cache")
    gguf = str(tmp_path / "m.gguf")
    _write(gguf, 10)
    _conversion(root, "m-aaaa", gguf, age_s=100)  # converted again since: stale
    _conversion(root, "m-bbbb", gguf)
    _conversion(root, "gone-cccc", str(tmp_path / "gone.gguf"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write(os.path.join(root, "gguf", f"m-dddd.tmp{dead.pid}", "model.safetensors"), 500)
    _write(os.path.join(root, "gguf", f"m-eeee.tmp{os.getpid()}", "model.safetensors"), 500)  # running: kept
    _write(os.path.join(root, "kernels", "decode-1111.so"), 300)
    _write(os.path.join(root, "kernels", "decode-2222.so"), 200)
    old = time.time() - 50
    os.utime(os.path.join(root, "kernels", "decode-1111.so"), (old, old))
    _write(os.path.join(root, "kernels", "fused_ops-3333.so"), 100)
    _write(os.path.join(root, "kernels", "obj", "a.o"), 10)
    _write(os.path.join(root, "bench", "tiny-llama-v1", "model.safetensors"), 50)
    _write(os.path.join(root, "unrelated.txt"), 5)
    monkeypatch.setenv("PAGEDSERVE_CACHE", root)
    return root


def test_cache_list_shows_each_entry_its_size_and_what_is_stale(fake_cache, capsys):
    from pagedserve.entrypoints.cache_cli import cache_entries

    entries = {e.name: e for e in cache_entries()}
    stale = {n for n, e in entries.items() if e.stale}
    assert stale == {"gguf/m-aaaa", "gguf/gone-cccc", next(n for n in entries if n.startswith("gguf/m-dddd")), "kernels/decode-1111.so"}
    assert 1000 < entries["gguf/m-bbbb"].size < 1200 and "m.gguf" in entries["gguf/m-bbbb"].what
    assert "unrelated.txt" not in " ".join(entries) and "bench/tiny-llama-v1" in entries and "kernels/obj" in entries
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert fake_cache in out and "gguf/m-bbbb" in out and "kernels/decode-2222.so" in out and "stale" in out and "total" in out


def test_cache_clear_removes_the_stale_then_named_then_all(fake_cache, capsys):
    from pagedserve.entrypoints.cache_cli import cache_entries

    assert main(["cache", "clear"]) == 0
    assert "freed" in capsys.readouterr().out
    left = {e.name for e in cache_entries()}
    assert "gguf/m-bbbb" in left and "gguf/m-aaaa" not in left and "gguf/gone-cccc" not in left
    assert "kernels/decode-2222.so" in left and "kernels/decode-1111.so" not in left
    assert not any(e.stale for e in cache_entries())
    assert main(["cache", "clear", "gguf/m-bbbb"]) == 0
    assert not os.path.exists(os.path.join(fake_cache, "gguf", "m-bbbb"))
    assert main(["cache", "clear", "gguf/../unrelated.txt"]) == 2
    assert "no cache entry" in capsys.readouterr().err
    assert main(["cache", "clear", "--all"]) == 0
    assert cache_entries() == [] and os.path.exists(os.path.join(fake_cache, "unrelated.txt"))


# -- the server's start-up log ----------------------------------------------------------------
def test_start_log_names_every_data_parallel_replica_pid():
    from pagedserve.entrypoints.openai.run_server import engine_pids

    class One:
        engine_pid = 11

        def replica_status(self):
            return None

    class Two(One):
        def replica_status(self):
            return [{"engine": 0, "pid": 11, "node": "localhost"}, {"engine": 1, "pid": 12, "node": "10.0.0.2"}]

    assert engine_pids(One()) == "engine core pid 11"
    assert engine_pids(Two()) == "2 engine replicas, 0: pid 11, 1: pid 12 on 10.0.0.2"
