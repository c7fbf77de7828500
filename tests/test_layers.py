"""The packages are layers: a module imports only from its own layer or the ones below it, every
import read (function-local ones included), so a concern is found by its folder and a setting
is followed through the code without climbing back up. A stage's package is its own: another
stage never imports it, and tools import only its public names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# lowest first; a package may import from its own layer and the ones before it
LAYERS = [("errors", "runtime"), ("config",), ("verifier",), ("draft",), ("data",), ("engines",),
          ("hidden",), ("estimates",), ("stages",), ("tools",)]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, eagle3pipe module, names imported from it) for every import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagle3pipe"):
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names
                    if a.name.startswith("eagle3pipe")]
    return out


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "errors"


def violations(root: Path) -> list[str]:
    """Every import that runs up the layers, or into another stage's package, or to a stage's
    private name from tools: 'file:line: importer -> module'."""
    found = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        here = package(mod)
        for line, target, names in imports(f):
            there = package(target)
            where = f"{rel}:{line}: {mod} -> {target}"
            if RANK.get(there, -1) > RANK.get(here, -1):
                found.append(f"{where} (up: {here} is below {there})")
            t, m = target.split("."), mod.split(".")
            if there == "stages" == here and len(t) > 2 and t[2] != "runner" \
                    and (len(m) < 3 or m[2] != t[2]):
                found.append(f"{where} (another stage's package)")
            if here == "tools" and there == "stages":
                found += [f"{where} ({n}: a stage's private name)" for n in names
                          if n.startswith("_")]
    return found


def test_every_package_has_a_layer():
    pkgs = {p.name for p in (SRC / "eagle3pipe").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert pkgs <= set(RANK), f"packages without a layer: {sorted(pkgs - set(RANK))}"


def test_no_import_runs_up_the_layers():
    assert violations(SRC) == []


@pytest.mark.parametrize("importer, source, why", [
    ("eagle3pipe/data/x.py", "def f():\n    from eagle3pipe.engines import engine\n", "up"),
    ("eagle3pipe/verifier/x.py", "import eagle3pipe.stages.runner\n", "up"),
    ("eagle3pipe/stages/smoke/x.py", "from eagle3pipe.stages.train import run\n", "another stage"),
    ("eagle3pipe/tools/x.py", "from eagle3pipe.stages.extract.run import _metrics\n", "private"),
])
def test_the_scan_finds_each_kind(tmp_path, importer, source, why):
    """Controls: each kind of violation, written into a scratch tree, is found (also when the
    import is function-local); the same tree without it is clean."""
    f = tmp_path / importer
    f.parent.mkdir(parents=True)
    f.write_text(source)
    [found] = violations(tmp_path)
    assert why in found and f"{importer}:" in found
    f.write_text("from eagle3pipe.errors import Error\n")
    assert violations(tmp_path) == []
