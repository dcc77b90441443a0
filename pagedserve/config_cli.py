"""Dataclass fields as command-line flags (the engine's config: ``EngineConfig.add_cli_args``):
each field's metadata (:func:`_flag`) gives its flag names, help and argparse extras, and which
command it belongs to. Torch-free."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

# Which commands a field's flag applies to (``_flag(..., only=...)``): every engine command, or
# only ``serve`` (the server's front: data parallelism, disaggregation, the API's model names),
# which the offline engine (generate, chat, bench throughput|latency|memory) has no use for.
CLI_USAGES = ("offline", "serve")


def _flag(help: str, *names: str, only: Optional[str] = None, **argparse_kwargs: Any) -> Any:
    """Field metadata: the CLI flag names (default ``--field-name``), help, argparse extras, and
    ``only``: the one usage of :data:`CLI_USAGES` the flag belongs to (None = all)."""
    assert only is None or only in CLI_USAGES, only
    return {"help": help, "names": names, "argparse": argparse_kwargs, "only": only}


def add_dataclass_flags(cls: type, parser: argparse.ArgumentParser, usage: Optional[str] = "offline", skip: tuple[str, ...] = ()) -> None:
    """Add the fields of ``cls`` (with :func:`_flag` metadata) for ``usage`` as flags in an
    "engine" group. ``usage``: "offline" (an engine in this process, as generate, chat and bench
    run), "serve" (every field, the server's own included) or None (every field, no check). A flag
    of another usage is left out of ``--help`` and, given anyway, is a one-line argparse error
    naming the command it belongs to. Fields named in ``skip`` get no flag."""
    assert usage is None or usage in CLI_USAGES, usage
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        names = list(meta["names"]) or ["--" + f.name.replace("_", "-")]
        is_bool = f.type in ("bool", bool)
        if usage is not None and meta["only"] not in (None, usage):
            if is_bool:
                names += ["--no-" + n[2:] for n in names if n.startswith("--")]
            parser.add_argument(
                *names,
                dest=argparse.SUPPRESS,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
                nargs=0 if is_bool else "?",
                action=_OtherUsageFlag,
                usage=meta["only"],
            )
            continue
        kwargs: dict[str, Any] = dict(dest=f.name, default=f.default, help=meta["help"], **meta["argparse"])
        if is_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "choices" not in kwargs:
            kwargs["type"] = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float}.get(str(f.type), str)
        group.add_argument(*names, **kwargs)


class _OtherUsageFlag(argparse.Action):
    """A flag of another command: hidden from ``--help``; given, a one-line argparse error (exit
    status 2) that names the command it belongs to."""

    def __init__(self, option_strings: list[str], dest: str, usage: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.usage = usage

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Optional[str] = None) -> None:
        why = {"serve": "this command runs one engine in this process"}[self.usage]
        parser.error(f"{option_string} is a flag of `pagedserve {self.usage}` only: {why}")
