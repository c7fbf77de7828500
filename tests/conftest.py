"""Shared fixtures: a micro embedded verifier (real tokenizer, real tiny Llama) built once; the
pipeline runs the slow tests read (two cold micro runs, the store's, the verifier families'),
started with the session in the background; and a session check that the suite leaves the
checkout's tracked files as it found them. (The shared helpers that are not fixtures: the package tests/helpers/.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import types
from pathlib import Path

import pytest

from helpers.micro import MICRO_EMBEDDED, ROOT
from helpers.pipeline import Background, Call, make_repo, sh

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs two things at once on two cores (a pipeline run in the background beside a
# test, two runs while a test waits). GNU OpenMP's threads (torch's, and vLLM's CPU engines')
# spin for a while after each parallel region by default; side by side that spin takes the
# other process's core. PASSIVE makes them sleep instead: it changes no computed byte (the same
# threads do the same work in the same order), and two micro pipelines side by side take 90 s
# instead of 110 (train 22 -> 11 s, smoke 28 -> 21 s; 2-core AMD EPYC). Set before anything
# imports torch (libgomp reads it when it loads); every stage process inherits it
# (helpers.pipeline.env copies this environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def private_store(tmp_path_factory, monkeypatch):
    """Each test's in-process stages keep their per-sample store (eagle3pipe.data.store) in a
    directory of its own, never the project's; pipeline.env() drops the variable, so that each
    temporary DVC repo uses its own `.eagle3pipe/data/store`."""
    from eagle3pipe.runtime import environment

    monkeypatch.setenv(environment.STORE, str(tmp_path_factory.mktemp("store")))


@pytest.fixture(scope="session")
def micro_verifier(tmp_path_factory) -> Path:
    """A real HF checkpoint dir (config.json, model.safetensors, tokenizer with chat template)."""
    from eagle3pipe.verifier import embedded

    out = tmp_path_factory.mktemp("micro") / "verifier"
    embedded.build(types.SimpleNamespace(**MICRO_EMBEDDED), out, progress=False)
    return out


@pytest.fixture
def micro_verifier_copy(micro_verifier, tmp_path) -> Path:
    """A private copy a test may modify."""
    dst = tmp_path / "verifier"
    shutil.copytree(micro_verifier, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# The pipeline runs the slow tests read, started with the session in the background
#
# Most of a micro stage is one core importing torch, transformers, speculators or vLLM, and most
# of the suite's other tests run on one core: so the runs that need no test's help (the store's
# run up to extract, the families' runs, the two cold micro runs, then test_online.py's modes,
# test_switch_pipelines.py's variants and test_parallel.py's TP 2 run on copies of the cold run)
# start with the session, one at a time in that order, on the core the other tests leave idle,
# and two at a time while a test waits for one (helpers.pipeline.Background). The modules that
# read them run last (pytest_collection_modifyitems), those that run on one core first, so that
# the runs keep the second core busy until the modules that use both (faults, the change
# scenarios) come.

LAST = ("test_store.py", "test_families.py", "test_serve.py", "test_online.py",
        "test_switch_pipelines.py", "test_faults.py",
        "test_parallel.py", "test_pipeline.py")
EARLY = {"store_repo": ("store",), "family_runs": ("families",), "micro": ("cold",),
         "second": ("second",), "modes": ("cold", "online"), "variants": ("cold", "switch"),
         "parallel": ("cold", "parallel")}


def pytest_collection_modifyitems(session, config, items):
    """The modules of LAST after every other, in LAST's order (each keeps its own order)."""
    rank = {name: i + 1 for i, name in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, 0))


@pytest.fixture(scope="session", autouse=True)
def early(request, tmp_path_factory):
    """The background runs the selected tests read (EARLY: fixture -> runs), started now; the
    on-demand modes (helpers.online) and the switched variants (helpers.switched) on copies of
    the cold run once it ends."""
    from helpers import checkpoints, online, parallel, store_repo as store, switched

    wanted = {run for item in request.session.items
              for fixture, runs in EARLY.items() if fixture in getattr(item, "fixturenames", ())
              for run in runs}
    jobs: dict = {}
    if "store" in wanted:
        jobs["store"] = (store.prepare(tmp_path_factory.mktemp("store") / "repo"), ("extract",))
    if "families" in wanted:
        ckpts = request.getfixturevalue("family_checkpoints")
        root = tmp_path_factory.mktemp("family-runs")
        jobs |= {f"family:{f}": checkpoints.family_repo(root, f, ckpts[f])
                 for f in checkpoints.FAMILIES}
    base = tmp_path_factory.mktemp("pipe")
    jobs |= {name: make_repo(base / name) for name in ("cold", "second") if name in wanted}
    if "online" in wanted:
        jobs["online"] = Call(online.run, "cold", tmp_path_factory.mktemp("online") / "repo")
    if "switch" in wanted:
        jobs |= switched.jobs(tmp_path_factory.mktemp("switch"))
    if "parallel" in wanted:
        jobs["parallel"] = parallel.job(tmp_path_factory.mktemp("parallel"))
    bg = Background(jobs)
    yield bg
    bg.stop()


def _committed(early, name: str) -> tuple[Path, set[str]]:
    """The background run `name`, finished, its outputs committed: (repo, the stages that ran)."""
    run = early.wait(name)
    assert run.rc == 0, f"dvc repro in {run.repo} failed ({run.rc}):\n{run.log[-8000:]}"
    sh(run.repo, "git", "add", "-A")
    sh(run.repo, "git", "commit", "-q", "-m", "cold run")
    return run.repo, run.ran


@pytest.fixture(scope="session")
def micro(early):
    """One cold run of the micro pipeline, committed: (repo, the stages that ran). The tests
    that change it (tests/test_pipeline.py) leave it as committed; test_parallel and test_serve
    start from it."""
    return _committed(early, "cold")


@pytest.fixture(scope="session")
def second(early):
    """A second cold repo of the micro pipeline, run on its own and committed: (repo, the
    stages that ran); test_two_cold_clones_give_identical_lock_hashes compares it with micro."""
    return _committed(early, "second")


@pytest.fixture(scope="session")
def store_repo(early) -> Path:
    """tests/helpers/store_repo.py's repo after `dvc repro extract`, committed."""
    repo, ran = _committed(early, "store")
    assert ran == {"verifier", "configs", "dataset", "extract"}
    return repo


@pytest.fixture(scope="session")
def family_checkpoints(micro_verifier, tmp_path_factory) -> dict[str, Path]:
    from helpers import checkpoints

    base = tmp_path_factory.mktemp("families")
    return {f: checkpoints.build(f, base / f, micro_verifier) for f in checkpoints.FAMILIES}


@pytest.fixture(scope="session")
def family_runs(early) -> dict[str, tuple[Path, int, str]]:
    """family -> (repo, dvc repro's exit code, its log): each family's micro pipeline through
    `dvc repro`, run in the background."""
    from helpers import checkpoints

    return {f: tuple(early.wait(f"family:{f}"))[:3] for f in checkpoints.FAMILIES}


# ---------------------------------------------------------------------------------------------
# The suite leaves the checkout as it found it: a tracked file that was clean when the session
# started and is modified, staged or deleted when it ends was changed by a test (a developer's
# uncommitted edits, dirty at the start, are not compared). The run then fails, naming them.

_DIRTY_AT_START = pytest.StashKey[set]()


def _dirty_tracked() -> set[str] | None:
    """Tracked files of ROOT that differ from HEAD (`git status --porcelain`, untracked files
    left out); None where ROOT is not a git checkout."""
    r = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=no"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return None
    out, entries = set(), iter(r.stdout.split("\0"))
    for entry in entries:
        if not entry:
            continue
        out.add(entry[3:])
        if entry[0] in "RC":  # a rename or copy: its source path follows
            out.add(next(entries, ""))
    return out


def pytest_sessionstart(session):
    session.stash[_DIRTY_AT_START] = _dirty_tracked()


def pytest_sessionfinish(session, exitstatus):
    dirty_at_start = session.stash.get(_DIRTY_AT_START, None)
    now = _dirty_tracked() if dirty_at_start is not None else None
    if now is None:
        return
    changed = sorted(now - dirty_at_start)
    if not changed:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    title = "tracked files changed by the suite"
    lines = [f"the suite changed {len(changed)} tracked file(s) of {ROOT} that were clean when "
             "it started (a test writes into the checkout; `git diff` shows what):"]
    lines += [f"  {f}" for f in changed]
    if tr is None:
        print("\n".join([title, *lines]))
    else:
        tr.write("\n")
        tr.write_sep("=", title, red=True, bold=True)
        for line in lines:
            tr.write_line(line, red=True)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
