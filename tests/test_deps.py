"""Exact code deps: no stage's import closure reaches eagle3pipe.tools, so editing a tool (how
`eagle3pipe plan` renders its table, say) reruns no stage, while editing a stage's own module
reruns that stage (DVC's own `dvc status` on a copy of this checkout)."""
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML

from eagle3pipe.config import dvcfile
from eagle3pipe.tools import deps

ROOT = Path(__file__).resolve().parents[1]
DVC = str(Path(sys.executable).with_name("dvc"))


def test_no_stage_closure_reaches_tools():
    for name, body in dvcfile.stages(ROOT / "dvc.yaml").items():
        closure = deps.closure(deps.script_of(body["cmd"]), ROOT)
        assert closure, name
        assert not [m for m in closure if m.startswith("src/eagle3pipe/tools/")], name


def _changed_deps(repo: Path) -> dict[str, set[str]]:
    """stage -> the code deps `dvc status` reports as modified (missing outputs are ignored)."""
    out = subprocess.run([DVC, "status", "--json"], cwd=repo, capture_output=True, text=True,
                         check=True).stdout
    changed: dict[str, set[str]] = {}
    for stage, entries in json.loads(out or "{}").items():
        for entry in entries:
            if isinstance(entry, dict):
                for path, state in (entry.get("changed deps") or {}).items():
                    if state == "modified" and path.endswith(".py"):
                        changed.setdefault(stage, set()).add(path)
    return changed


def test_editing_plan_rendering_reruns_no_stage(tmp_path):
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    # the lock as if `dvc repro` had just run on this code: each stage's code deps are the ones
    # dvc.yaml lists, with their current md5s
    yaml = YAML()
    lock = yaml.load((repo / "dvc.lock").read_text())
    for name, body in dvcfile.stages(repo / "dvc.yaml").items():
        deps_ = [d for d in lock["stages"][name].get("deps", []) if not d["path"].endswith(".py")]
        for path in (d for d in body["deps"] if d.endswith(".py")):
            data = (repo / path).read_bytes()
            deps_.append({"path": path, "hash": "md5", "md5": hashlib.md5(data).hexdigest(),
                          "size": len(data)})
        lock["stages"][name]["deps"] = sorted(deps_, key=lambda d: d["path"])
    with (repo / "dvc.lock").open("w") as fh:
        yaml.dump(lock, fh)
    before = _changed_deps(repo)
    assert before == {}
    plan = repo / "src/eagle3pipe/tools/plan.py"
    plan.write_text(plan.read_text().replace('("stage", 9)', '("stage", 10)'))
    assert _changed_deps(repo) == before  # a report's rendering: no stage reruns
    smoke = repo / "src/eagle3pipe/stages/smoke.py"
    smoke.write_text(smoke.read_text() + "\n# edited\n")
    after = _changed_deps(repo)
    assert after == {"smoke": {"src/eagle3pipe/stages/smoke.py"}}
