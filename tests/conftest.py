"""Shared fixtures: a micro embedded verifier (real tokenizer, real tiny Llama) built once; the
session's cold micro-pipeline pair; the verifier families' runs, started with the session in the
background; and a session check that the suite leaves the checkout's tracked files as it found
them. (The shared helpers that are not fixtures: the package tests/helpers/.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import types
from pathlib import Path

import pytest

from helpers.micro import MICRO_EMBEDDED, ROOT
from helpers.pipeline import Background, make_repo, repro, sh, start_repro, stop_repro

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def private_store(tmp_path_factory, monkeypatch):
    """Each test's in-process stages keep their per-sample store (eagle3pipe.data.store) in a
    directory of its own, never the project's; pipeline.env() drops the variable, so that each
    temporary DVC repo uses its own `.eagle3pipe/data/store`."""
    from eagle3pipe.data import store

    monkeypatch.setenv(store.STORE_ENV, str(tmp_path_factory.mktemp("store")))


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
# The one cold run of the micro pipeline through real DVC (slow tests)

@pytest.fixture(scope="session")
def cold_pair(tmp_path_factory):
    """Two fresh repos of the micro pipeline, cold-run at the same time, once per session
    (tests/test_pipeline.py, tests/test_serve.py): the first (committed after its run) is the
    one the other tests change and serve, each leaving it as committed; the second, still
    running in the background, is compared with it by
    test_two_cold_clones_give_identical_lock_hashes."""
    base = tmp_path_factory.mktemp("pipe")
    repo, second = make_repo(base / "repo"), make_repo(base / "second")
    bg = start_repro(second)
    try:
        ran = repro(repo)
        sh(repo, "git", "add", "-A")
        sh(repo, "git", "commit", "-q", "-m", "cold run")
        yield repo, ran, second, bg
    finally:
        stop_repro(bg)


@pytest.fixture(scope="session")
def micro(cold_pair):
    """One cold run of the micro pipeline, committed: (repo, the stages that ran)."""
    return cold_pair[:2]


# ---------------------------------------------------------------------------------------------
# The verifier families' runs (tests/test_families.py), started at the session's start

@pytest.fixture(scope="session")
def family_checkpoints(micro_verifier, tmp_path_factory) -> dict[str, Path]:
    from helpers import checkpoints

    base = tmp_path_factory.mktemp("families")
    return {f: checkpoints.build(f, base / f, micro_verifier) for f in checkpoints.FAMILIES}


@pytest.fixture(scope="session")
def family_runs(family_checkpoints, tmp_path_factory):
    """Each family's micro pipeline through `dvc repro`, in the background (helpers.pipeline.
    Background), one at a time until tests/test_families.py widens it."""
    from helpers import checkpoints

    root = tmp_path_factory.mktemp("family-runs")
    bg = Background({f: checkpoints.family_repo(root, f, family_checkpoints[f])
                     for f in checkpoints.FAMILIES})
    yield bg
    bg.stop()


@pytest.fixture(scope="session", autouse=True)
def _start_family_runs_early(request):
    """Starts family_runs with the session when any selected test reads them: they run on
    the core the single-process tests before them leave idle."""
    if any("family_runs" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("family_runs")


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
