"""``pagedserve cache list|clear``: what pagedserve keeps on disk, and removing it (see
:data:`DESCRIPTION`; the folder is ``pagedserve.platform.cache_dir``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Optional

KNOWN_DIRS = ("gguf", "kernels", "bench")
DESCRIPTION = """\
The cache folder ($PAGEDSERVE_CACHE, default ~/.cache/pagedserve) holds:

  gguf/FILE-KEY      a GGUF checkpoint's config and tokenizer (a few MB; the weights are read from
                     the file itself; folders of older versions held a float32 copy), one per GGUF
                     file ever loaded; FILE-KEY.tmpPID is one being written, or left by a killed one
  kernels/LIB-KEY.so the compiled CPU kernels, one per source version, compiler flags and CPU
  kernels/obj/       the objects they are linked from (UNIT-KEY.o, its compiler log UNIT-KEY.log),
                     one per unit, source version, flags, compiler and CPU
  kernels/bench/     the kernel variants `pagedserve bench kernels` compares against
  bench/             the benchmarks' generated models

All of it is rebuilt when missing (a conversion takes about a minute, the kernels a minute or
two), so removing any of it is safe, only slower at the next start. `clear` removes the stale
entries: conversions whose GGUF file is gone or was converted again since, half-written
conversions of dead processes, kernel builds superseded by a newer build of the same library,
unit objects this checkout's kernels are not linked from (an older version's, another
compiler's or CPU's, a benchmark variant's), a build's leftovers; `clear --all` every entry;
`clear ENTRY ...` the entries named as `list` shows them. Other files in the cache folder are
left alone."""


@dataclass
class CacheEntry:
    """One removable thing in the cache.

    Attributes:
        name: its path relative to the cache folder (``gguf/...``, ``kernels/...``).
        path: its absolute path.
        size: bytes on disk (files, not following links).
        what: a short description (the GGUF file a conversion came from, ...).
        stale: why ``clear`` removes it, or None when it is in use or may be.
        also: files removed with it (a unit object's compiler log).
    """

    name: str
    path: str
    size: int
    what: str
    stale: Optional[str] = None
    also: tuple[str, ...] = ()


def _size(path: str) -> int:
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _gguf_entries(root: str) -> list[CacheEntry]:
    folder = os.path.join(root, "gguf")
    entries: list[CacheEntry] = []
    latest: dict[str, tuple[float, CacheEntry]] = {}  # source file -> its newest complete conversion
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        e = CacheEntry(f"gguf/{name}", path, _size(path), "converted model")
        entries.append(e)
        stem, dot, pid = name.rpartition(".tmp")
        if dot and pid.isdigit():
            e.what = f"conversion in progress (pid {pid})"
            if not _pid_alive(int(pid)):
                e.what, e.stale = "half-written conversion", "its process is gone"
            continue
        if not os.path.isdir(path):
            e.what, e.stale = "stray file", "not a conversion"
            continue
        complete = os.path.join(path, ".complete")
        if not os.path.exists(complete):
            e.what, e.stale = "incomplete conversion", "no .complete marker"
            continue
        try:
            with open(os.path.join(path, "source.json")) as fh:
                source = json.load(fh)["gguf"]
        except (OSError, ValueError, KeyError, TypeError):
            e.what = "converted model (source unknown)"
            continue
        e.what = f"converted from {source}"
        if not os.path.exists(source):
            e.stale = "its GGUF file is gone"
            continue
        mtime = os.path.getmtime(complete)
        prev = latest.get(source)
        if prev is None or mtime > prev[0]:
            if prev is not None:
                prev[1].stale = "the GGUF file was converted again since"
            latest[source] = (mtime, e)
        else:
            e.stale = "the GGUF file was converted again since"
    return entries


def _kernel_entries(root: str) -> list[CacheEntry]:
    folder = os.path.join(root, "kernels")
    entries: list[CacheEntry] = []
    newest: dict[str, tuple[float, CacheEntry]] = {}  # library -> its newest build
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name == "obj" and os.path.isdir(path) and not os.path.islink(path):
            entries += _object_entries(path)
            continue
        e = CacheEntry(f"kernels/{name}", path, _size(path), "compiled kernels")
        entries.append(e)
        if os.path.isdir(path):
            e.what = "kernel build files"
            if name.startswith("check-") and time.time() - os.path.getmtime(path) > 3600:  # --check-all-isas's scratch folder
                e.stale = "left by an interrupted kernel check"
            continue
        mtime = os.path.getmtime(path)
        lib, dash, key = name[:-3].rpartition("-") if name.endswith(".so") else ("", "", "")
        if not dash:  # a compiler's temporary output (tmpXXXX.so), or something else
            e.what = "partial kernel build"
            if time.time() - mtime > 3600:
                e.stale = "left by an interrupted build"
            continue
        e.what = f"compiled kernels: {lib}"
        prev = newest.get(lib)
        if prev is None or mtime > prev[0]:
            if prev is not None:
                prev[1].stale = "superseded by a newer build of the same library"
            newest[lib] = (mtime, e)
        else:
            e.stale = "superseded by a newer build of the same library"
    return entries


def _object_entries(folder: str) -> list[CacheEntry]:
    """``kernels/obj``: one entry for the folder (the objects in use, and what else is there) and
    one per stale object with its log: not among those this checkout's libraries are linked from
    (``build.object_stems``: these sources, flags, compiler and CPU; an older version's, a
    benchmark variant's), or a compile's temporary (tmpXXXX.o) left by an interrupted build."""
    try:
        from pagedserve.ops.cpu.build import object_stems

        current: Optional[set[str]] = object_stems()
    except Exception:  # the sources unreadable: call no object stale
        current = None
    files: dict[str, list[str]] = {}  # an object's stem -> its files (.o, .log)
    for name in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(name)
        files.setdefault(stem if ext in (".o", ".log") else name, []).append(name)
    kept = CacheEntry("kernels/obj", folder, 0, "compiled kernel units: the objects the libraries are linked from")
    stale: list[CacheEntry] = []
    for stem, names in files.items():
        paths = [os.path.join(folder, n) for n in sorted(names, key=lambda n: not n.endswith(".o"))]  # the .o first
        try:
            size, mtime = sum(_size(p) for p in paths), max(os.path.getmtime(p) for p in paths)
        except OSError:  # removed meanwhile
            continue
        unit, dash, key = stem.rpartition("-")
        why = None
        if dash and len(key) == 16 and all(c in "0123456789abcdef" for c in key) and all(n.endswith((".o", ".log")) for n in names):
            if current is not None and stem not in current:
                why = "not what this checkout's kernels are linked from (other sources, flags, compiler or CPU)"
            what = f"compiled kernel unit: {unit}"
        else:
            what = "partial unit build"
            if stem.startswith("tmp") and time.time() - mtime > 3600:
                why = "left by an interrupted build"
        if why:
            rel = f"kernels/obj/{os.path.basename(paths[0])}"
            stale.append(CacheEntry(rel, paths[0], size, what, why, tuple(paths[1:])))
        else:
            kept.size += size
    return [kept] + stale


def cache_entries(root: Optional[str] = None) -> list[CacheEntry]:
    """Every entry of the cache folder ``root`` (default: ``platform.cache_dir()``), in the known
    folders only."""
    if root is None:
        from pagedserve.platform import cache_dir

        root = cache_dir()
    entries: list[CacheEntry] = []
    for d in KNOWN_DIRS:
        folder = os.path.join(root, d)
        if not os.path.isdir(folder):
            continue
        if d == "gguf":
            entries += _gguf_entries(root)
        elif d == "kernels":
            entries += _kernel_entries(root)
        else:
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                entries.append(CacheEntry(f"{d}/{name}", path, _size(path), "benchmark model" if d == "bench" else "cached files"))
    return entries


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _remove(e: CacheEntry) -> None:
    for path in (e.path, *e.also):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def clear(root: Optional[str] = None, everything: bool = False, names: Optional[list[str]] = None) -> list[CacheEntry]:
    """Remove the stale entries, every entry (``everything``) or the ``names`` given (as
    ``list`` shows them); returns what was removed.

    Raises:
        ValueError: a name that is no entry of the cache.
    """
    entries = cache_entries(root)
    if names:
        by_name = {e.name: e for e in entries}
        unknown = [n for n in names if n.rstrip("/") not in by_name]
        if unknown:
            raise ValueError(f"no cache entry {', '.join(map(repr, unknown))} (`pagedserve cache list` shows them)")
        chosen = [by_name[n.rstrip("/")] for n in names]
    else:
        chosen = [e for e in entries if everything or e.stale]
    for e in chosen:
        _remove(e)
    return chosen


def cmd_cache(args: argparse.Namespace) -> int:
    from pagedserve.platform import cache_dir

    root = cache_dir()
    if args.cache_command == "list":
        entries = cache_entries(root)
        print(f"pagedserve cache: {root} (set PAGEDSERVE_CACHE to move it)")
        width = max([len(e.name) for e in entries] + [5])
        for e in entries:
            note = f"  [stale: {e.stale}]" if e.stale else ""
            print(f"  {human(e.size):>10}  {e.name:<{width}}  {e.what}{note}")
        total, stale = sum(e.size for e in entries), sum(e.size for e in entries if e.stale)
        print(
            f"  {human(total):>10}  total in {len(entries)} entries; {human(stale)} stale "
            "(`pagedserve cache clear` removes the stale entries, `--all` everything: it is rebuilt when needed)"
        )
        return 0
    if args.all and args.entries:
        raise ValueError("--all removes every entry: name no ENTRY with it")
    removed = clear(root, args.all, args.entries)
    for e in removed:
        print(f"removed {e.name} ({human(e.size)})")
    print(
        f"pagedserve cache: freed {human(sum(e.size for e in removed))} in {root}"
        + ("" if removed or args.all or args.entries else " (nothing stale; `--all` removes everything)")
    )
    return 0


def add_cache_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cache",
        help="the converted models and compiled kernels pagedserve keeps on disk: list, clear",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cache_command", required=True)
    sub.add_parser("list", help="each entry, its size and whether it is stale")
    c = sub.add_parser("clear", help="remove the stale entries (or --all, or the entries named)")
    c.add_argument("entries", nargs="*", metavar="ENTRY", help="entries to remove, as `pagedserve cache list` names them")
    c.add_argument("--all", action="store_true", help="remove every entry (converted models and kernels are rebuilt when needed)")
    p.set_defaults(func=cmd_cache)
    return p
