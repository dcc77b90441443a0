"""The package's shape: imports point down the layers, no import circle, no class built from
mixins (``tools/import_contract.py``, which ``make lint`` also runs)."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import import_contract  # noqa: E402


def test_package_keeps_the_import_contract():
    assert import_contract.check(os.path.join(ROOT, "pagedserve")) == []


def test_contract_catches_upward_imports_circles_and_mixins(tmp_path):
    pkg = tmp_path / "pagedserve"
    for sub in ("core", "engine", "model", "ops"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from pagedserve.engine import b\n")  # upward, inside a function
    (pkg / "engine" / "b.py").write_text("from pagedserve.core import a\nclass A: pass\nclass B: pass\nclass C(A, B): pass\n")
    (pkg / "model" / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedserve.engine import b\n")
    (pkg / "ops" / "k.py").write_text("class XMixin: pass\nclass K(XMixin): pass\n")
    got = import_contract.check(str(pkg))
    assert "upward import: pagedserve.core.a (layer core) imports pagedserve.engine.b (layer engine)" in got
    assert "import circle: pagedserve.core.a <-> pagedserve.engine.b" in got
    assert any(p.startswith("class built from mixins: pagedserve.engine.b.C") for p in got)
    assert any(p.startswith("class built from mixins: pagedserve.ops.k.K") for p in got)
    assert not any("pagedserve.model.m" in p for p in got)  # TYPE_CHECKING imports do not count
