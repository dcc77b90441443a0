#!/usr/bin/env python3
"""The import contract of the ``pagedserve`` package: imports point down the layers, no
module imports itself back through others (a circle), and no class is assembled from partial
classes that share one ``self`` (a ``*Mixin`` base, or two or more of the package's own classes
as bases): collaborators are objects.

Every import counts, module-level or inside a function (a function-level import is still a
dependency); imports under ``if TYPE_CHECKING:`` do not. The package root
(``pagedserve/__init__.py``, the public facade) is outside the layers.

usage: python tools/import_contract.py [PACKAGE_DIR]   (default: pagedserve). Exit 1 on any
violation, listing each (the importing module, the imported one, and their layers).
"""

from __future__ import annotations

import ast
import os
import sys

# Top to bottom: a module may import its own layer's modules and those of any layer below it.
LAYERS: list[tuple[str, ...]] = [
    ("entrypoints",),  # CLI, OpenAI/Anthropic servers, the PD proxy
    ("bench",),  # the benchmark CLI
    ("engine",),  # LLMEngine / AsyncLLM, the core's process and clients
    ("metrics",),  # Prometheus metrics of an engine
    ("executor",),  # TP executor, launchers, worker processes
    ("worker",),  # Worker, ModelRunner, input batch
    ("distributed",),  # parallel state, TP sharding, kv_transfer, DP router
    ("model",),  # model files, weights, families, attention backends, sampler
    ("ops",),  # CPU kernels (C) and their wrappers
    ("messages",),  # typed messages between processes and their codec
    ("core",),  # torch-free: requests, block pool, KV cache manager, scheduler
    ("platform", "config", "config_cli", "kv_transfer_config", "spec_decode_config", "pooler_config", "lora_request", "sampling_params", "outputs"),
]


def _modname(path: str, root: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(tree: ast.AST, mod: str, is_pkg: bool) -> set[str]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    pkg = mod if is_pkg else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _layer(mod: str, top: str) -> int | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    return -1


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def check(root: str) -> list[str]:
    """Every violation of the contract in the package at ``root``, as a line of text."""
    top = os.path.basename(os.path.normpath(root))
    trees: dict[str, tuple[ast.AST, bool]] = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                with open(p, encoding="utf-8") as fh:
                    trees[_modname(p, os.path.normpath(root))] = (ast.parse(fh.read()), f == "__init__.py")
    graph = {m: {t for t in _imports(tree, m, pkg) if t in trees and t != m} for m, (tree, pkg) in trees.items()}
    problems = []
    for m, targets in sorted(graph.items()):
        lm = _layer(m, top)
        if lm is None:
            continue
        if lm == -1:
            problems.append(f"{m}: in no layer (add its top-level name to LAYERS in tools/import_contract.py)")
            continue
        for t in sorted(targets):
            lt = _layer(t, top)
            if lt is not None and lt != -1 and lt < lm:
                problems.append(f"upward import: {m} (layer {LAYERS[lm][0]}) imports {t} (layer {LAYERS[lt][0]})")
    for comp in _circles({m: {t for t in ts if _layer(t, top) is not None} for m, ts in graph.items() if _layer(m, top) is not None}):
        problems.append("import circle: " + " <-> ".join(comp))
    own = {node.name for tree, _ in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for m, (tree, _) in sorted(trees.items()):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                if any(b.endswith("Mixin") for b in bases) or sum(b in own for b in bases) >= 2:
                    problems.append(f"class built from mixins: {m}.{node.name}({', '.join(bases)})")
    return problems


def main(argv: list[str]) -> int:
    root = argv[1] if len(argv) > 1 else "pagedserve"
    problems = check(root)
    for line in problems:
        print(line)
    print(f"import contract: {len(problems)} violation(s)" if problems else "import contract: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
