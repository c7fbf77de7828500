"""The library modules a stage script runs: the transitive closure of its eagle3pipe imports.

dvc.yaml must list every one of them as a dep of the stage (a test enforces it), so a code
change reruns exactly the stages whose code changed. params.py is left out on purpose: it only
validates; the values a stage reads are tracked by DVC as params, key by key.
"""
from __future__ import annotations

import ast
from pathlib import Path

EXEMPT = {"src/eagle3pipe/params.py", "src/eagle3pipe/__init__.py"}


def closure(script: str | Path, root: str | Path = ".") -> list[str]:
    root = Path(root)
    seen: set[Path] = set()
    todo = [root / script]
    while todo:
        for node in ast.walk(ast.parse(todo.pop().read_text())):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagle3pipe"):
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names if a.name.startswith("eagle3pipe")]
            for m in mods:
                f = root / "src" / (m.replace(".", "/") + ".py")
                if f.is_file() and f not in seen:
                    seen.add(f)
                    todo.append(f)
    return sorted(str(p.relative_to(root)) for p in seen
                  if str(p.relative_to(root)) not in EXEMPT)


if __name__ == "__main__":
    import sys
    for s in sys.argv[1:]:
        print(s, closure(s))
