"""Exact code deps: no stage's import closure reaches eagle3pipe.tools or the refuse-only
estimates (eagle3pipe.estimates, which the stage runner imports to log a stage's estimate and
refuse an output the free disk cannot hold), so editing a tool (how `eagle3pipe plan` renders its
table, say) or a memory/disk formula reruns no stage, while editing a stage's own module reruns
that stage (DVC's own `dvc status` on a copy of this checkout, its lock pinned to the current
code); only the runner may import the estimates."""
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from eagle3pipe.config import dvcfile
from eagle3pipe.errors import Error
from eagle3pipe.tools import deps

ROOT = Path(__file__).resolve().parents[1]
DVC = str(Path(sys.executable).with_name("dvc"))


def test_no_stage_closure_reaches_tools_or_the_estimates():
    for name, body in dvcfile.stages(ROOT / "dvc.yaml").items():
        closure = deps.closure(deps.script_of(body["cmd"]), ROOT)
        assert closure, name
        assert not [m for m in closure if m.startswith("src/eagle3pipe/tools/")], name
        assert not [m for m in closure if m.startswith("src/eagle3pipe/estimates/")], name
        assert "src/eagle3pipe/stages/runner.py" in closure, name  # which imports them


def test_only_the_runner_may_import_the_estimates(tmp_path):
    """A stage module that imports eagle3pipe.estimates could compute its bytes with it, which
    no code dep would then track: the closure refuses it, naming the file and line."""
    for d in ("src", "stages"):
        shutil.copytree(ROOT / d, tmp_path / d)
    vocab = tmp_path / "src/eagle3pipe/stages/vocab/run.py"
    text = vocab.read_text()
    at = text.index("\nfrom eagle3pipe.") + 1
    vocab.write_text(text[:at] + "from eagle3pipe.estimates import figures\n" + text[at:])
    line = text[:at].count("\n") + 1
    with pytest.raises(Error) as e:
        deps.closure("stages/vocab.py", tmp_path)
    assert str(e.value).startswith(f"src/eagle3pipe/stages/vocab/run.py:{line}: "
                                   "eagle3pipe.estimates: refuse-only"), str(e.value)
    assert "fix: move what" in str(e.value)
    assert deps.closure("stages/configs.py", tmp_path)  # the runner's own import is allowed


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


def _repo_at_current_code(tmp_path: Path) -> Path:
    """A git repo holding this checkout's files (tracked, and untracked but not ignored), with
    dvc.lock as if `dvc repro` had just run on this code: each stage's code deps are the ones
    dvc.yaml lists, with their current md5s (the committed lock may predate the code). No stage
    runs: `dvc status` needs only the deps' hashes."""
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
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
    assert _changed_deps(repo) == {}
    return repo


@pytest.mark.integration
def test_editing_plan_rendering_reruns_no_stage(tmp_path):
    repo = _repo_at_current_code(tmp_path)
    plan = repo / "src/eagle3pipe/tools/plan.py"
    plan.write_text(plan.read_text().replace('("stage", 9)', '("stage", 10)'))
    assert _changed_deps(repo) == {}  # a report's rendering: no stage reruns
    smoke = repo / "src/eagle3pipe/stages/smoke/run.py"
    smoke.write_text(smoke.read_text() + "\n# edited\n")
    assert _changed_deps(repo) == {"smoke": {"src/eagle3pipe/stages/smoke/run.py"}}


@pytest.mark.integration
def test_editing_an_estimate_reruns_no_stage(tmp_path):
    """Every module of eagle3pipe.estimates edited (a formula's constant, and a line in each):
    `dvc status` reports no stage changed, although every stage runs the runner, which imports
    them; the same edit in the vocab stage's module reports the vocab stage."""
    from eagle3pipe.stages import runner

    assert runner.check_estimate.__module__ == "eagle3pipe.estimates.check"
    repo = _repo_at_current_code(tmp_path)
    package = repo / "src/eagle3pipe/estimates"
    figures = package / "figures.py"
    text = figures.read_text()
    assert text.count("ADAMW_BYTES_PER_PARAM = 4 + 4 + 8") == 1
    figures.write_text(text.replace("ADAMW_BYTES_PER_PARAM = 4 + 4 + 8",
                                    "ADAMW_BYTES_PER_PARAM = 4 + 4 + 8 + 4"))
    modules = sorted(package.glob("*.py"))
    assert {m.name for m in modules} >= {"check.py", "figures.py", "size.py", "stages.py"}
    for m in modules:
        m.write_text(m.read_text() + "\nEDITED = 1\n")
    assert _changed_deps(repo) == {}
    vocab = repo / "src/eagle3pipe/stages/vocab/run.py"
    vocab.write_text(vocab.read_text() + "\nEDITED = 1\n")
    assert _changed_deps(repo) == {"vocab": {"src/eagle3pipe/stages/vocab/run.py"}}
