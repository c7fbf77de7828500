"""The library modules a stage script runs: the transitive closure of its eagle3pipe imports,
and the command that writes them into dvc.yaml.

    eagle3pipe deps            exit 1 and list the differences if dvc.yaml is stale
    eagle3pipe deps --write    rewrite each stage's src/eagle3pipe/* deps from the closure

dvc.yaml lists exactly these (a test asserts equality), so a code change reruns exactly the
stages whose code changed. config/ (params, cross_check, schema, view, dvcfile), errors.py and
the packages' __init__.py are left out on purpose: they only validate, limit which keys a stage
reads or name an error type; the values a stage reads are tracked by DVC as params, key by key. The stage
script is the `stages/<name>.py` its `cmd` runs. No stage's closure reaches tools/.

The REFUSE_ONLY packages (eagle3pipe.estimates) are not followed either: the stage runner
imports them only to log a stage's estimate and refuse, before any compute, an output the free
disk cannot hold; they never change an output byte, so editing one must rerun no stage. The
closure refuses (an Error naming the file and line) an import of one from any module but
REFUSE_ONLY_GATE (the runner), so no stage can come to compute its bytes with one unnoticed.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from ruamel.yaml import YAML

from eagle3pipe.errors import Error, Problem

EXEMPT = {"src/eagle3pipe/config/params.py", "src/eagle3pipe/config/cross_check.py",
          "src/eagle3pipe/config/schema.py",
          "src/eagle3pipe/config/view.py", "src/eagle3pipe/config/dvcfile.py",
          "src/eagle3pipe/errors.py"}
LIB = "src/eagle3pipe/"
# package -> why it is refuse-only: never a code dep of any stage, imported only by the gate
REFUSE_ONLY = {"eagle3pipe.estimates": "the stage runner's estimate: log lines and a refusal "
                                       "before any compute; it never changes an output byte"}
REFUSE_ONLY_GATE = "src/eagle3pipe/stages/runner.py"


def refuse_only(module: str) -> str | None:
    """The REFUSE_ONLY package `module` belongs to, or None."""
    return next((p for p in REFUSE_ONLY if module == p or module.startswith(p + ".")), None)


def closure(script: str | Path, root: str | Path = ".") -> list[str]:
    root = Path(root)
    seen: set[Path] = set()
    todo = [root / script]
    while todo:
        here = todo.pop()
        for node in ast.walk(ast.parse(here.read_text())):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagle3pipe"):
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names if a.name.startswith("eagle3pipe")]
            for m in mods:
                if refuse_only(m):
                    _check_gate(here.relative_to(root), node.lineno, m)
                    continue
                f = root / "src" / (m.replace(".", "/") + ".py")
                if f.is_file() and f not in seen:
                    seen.add(f)
                    todo.append(f)
    return sorted(str(p.relative_to(root)) for p in seen
                  if str(p.relative_to(root)) not in EXEMPT and p.name != "__init__.py")


def _check_gate(importer: Path, line: int, module: str) -> None:
    """Refuses an import of a REFUSE_ONLY package from anywhere but REFUSE_ONLY_GATE."""
    if str(importer) != REFUSE_ONLY_GATE:
        package = refuse_only(module)
        raise Error(problems=[Problem(
            str(importer), line, module, f"refuse-only ({REFUSE_ONLY[package]}): no stage's "
            f"code deps list {package}, so only {REFUSE_ONLY_GATE} may import it",
            f"move what {importer} needs out of {package} into a module the stage's deps list")])


def script_of(cmd: str) -> str:
    m = re.search(r"stages/[\w-]+\.py", cmd)
    if not m:
        raise ValueError(f"dvc.yaml: cmd {cmd!r} runs no stages/<name>.py script")
    return m.group(0)


def sync(dvc_yaml: str | Path = "dvc.yaml", *, write: bool = False) -> list[str]:
    """The stale entries of dvc.yaml (as 'stage: +dep' / 'stage: -dep'); with write, fixes them
    in place (comments and order of everything else kept)."""
    path = Path(dvc_yaml)
    yaml = YAML(typ="rt")
    yaml.width = 4096
    yaml.indent(mapping=2, sequence=4, offset=2)
    doc = yaml.load(path.read_text())
    diffs = []
    for name, body in doc["stages"].items():
        deps = body["deps"]
        listed = [d for d in deps if isinstance(d, str) and d.startswith(LIB)]
        want = closure(script_of(body["cmd"]), path.parent)
        diffs += [f"{name}: +{d}" for d in want if d not in listed]
        diffs += [f"{name}: -{d}" for d in listed if d not in want]
        if write and listed != want:
            at = next((i for i, d in enumerate(deps) if d in listed), 1)
            for d in listed:
                deps.remove(d)
            for i, d in enumerate(want):
                deps.insert(at + i, d)
    if write and diffs:
        with path.open("w") as fh:
            yaml.dump(doc, fh)
    return diffs
