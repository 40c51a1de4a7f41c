"""The library's layers: what each subpackage of fedcomp may import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fedcomp"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _package_imports(package: str) -> dict[str, set[str]]:
    folder = PACKAGE / package
    return {str(p.relative_to(PACKAGE.parent)): _imports(p) for p in folder.rglob("*.py")}


def _outside(imports: dict[str, set[str]], allowed: tuple[str, ...]) -> dict[str, set[str]]:
    """The fedcomp/app modules each file imports that are not under ``allowed``."""
    ours = ("fedcomp", "clients", "server", "strategies")
    bad = {}
    for path, modules in imports.items():
        wrong = {m for m in modules if m.split(".")[0] in ours
                 and not any(m == a or m.startswith(a + ".") for a in allowed)}
        if wrong:
            bad[path] = wrong
    return bad


@pytest.mark.parametrize(("package", "allowed"), [
    # Codecs and the wire format: the base everything else builds on.
    ("codecs", ("fedcomp.codecs", "fedcomp.errors")),
    # Data, models and training know nothing of compression or federation.
    ("tasks", ("fedcomp.tasks", "fedcomp.errors")),
    # The round logic never reaches up into the command line, sweeps or reports.
    ("federated", ("fedcomp.codecs", "fedcomp.errors", "fedcomp.privacy", "fedcomp.tasks",
                   "fedcomp.federated", "fedcomp.config", "fedcomp.presets")),
])
def test_each_layer_imports_only_the_layers_below_it(package, allowed):
    assert _outside(_package_imports(package), allowed) == {}


def test_only_the_adapter_imports_flower_and_nothing_imports_the_apps():
    for path in PACKAGE.rglob("*.py"):
        modules = _imports(path)
        if path.parent.name != "flower":
            assert not {m for m in modules if m.split(".")[0] == "flwr"}, path
        assert not {m for m in modules
                    if m.split(".")[0] in ("clients", "server", "strategies")}, path


def test_the_codec_core_loads_neither_torch_nor_flower():
    code = ("import sys, fedcomp, fedcomp.codecs.wire, fedcomp.codecs.policy, "
            "fedcomp.codecs.fuzzing, fedcomp.config; "
            "print(sorted(m for m in ('torch', 'flwr', 'opacus') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]"
