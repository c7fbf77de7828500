"""The per-sample store (eagle3pipe.data.store) through real DVC: a SIGKILLed extract or dataset
resumes with only the unfinished samples and publishes the same bytes as an uninterrupted run;
a grown prompt set computes only the new samples; new aux layer ids re-extract everything and
regenerate nothing; `eagle3pipe gc` and the stages' own size bound keep what dvc.lock,
experiments and the workspace refer to. What a run computed is read from
metrics/<stage>_store.json (store.record)."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from eagle3pipe.data.store import Store, table
from eagle3pipe.data.store_db import FILE
from helpers.pipeline import (FAULT_TAG, digest, env, get_param, kill_group, repro, set_param,
                              sh, start, wait_for)

pytestmark = pytest.mark.slow


def counts(repo: Path, stage: str) -> dict:
    return json.loads((repo / "metrics" / f"{stage}_store.json").read_text())


def entries(repo: Path, kind: str) -> int:
    """How many finished entries the store holds: committed rows of the dataset kind's
    database; hidden files (a writer's claim or temporary file beside them is not one)."""
    base = repo / ".eagle3pipe/data/store"
    if kind == "dataset":
        with table(base) as t:
            return t.usage()[0]
    return len(Store(kind, base).entries())


def empty(repo: Path, kind: str) -> None:
    base = repo / ".eagle3pipe/data/store"
    if kind == "dataset":
        for f in base.glob(f"{FILE}*"):  # the database, its -wal and -shm files
            f.unlink()
    else:
        shutil.rmtree(base / kind, ignore_errors=True)


@pytest.fixture(scope="module")
def repo(store_repo) -> Path:
    """The micro pipeline up to extract, 2 samples per engine call in both data stages (so a
    kill lands between samples), cold, committed (conftest.py's store_repo, run in the
    background; tests/helpers/store_repo.py)."""
    return store_repo


def test_a_cold_run_computes_everything_and_publishes_links(repo):
    n = get_param(repo, "dataset.num_samples")
    assert counts(repo, "dataset")["computed"] == n and counts(repo, "dataset")["reused"] == 0
    ex = counts(repo, "extract")
    assert ex["computed"] == ex["total"] == n and ex["published_as_links"] == n
    hs = repo / "artifacts/hidden/train/hidden_states/hs_0.safetensors"
    assert hs.stat().st_nlink >= 2  # the store entry and the published file: one copy on disk
    assert entries(repo, "hidden") == n and entries(repo, "dataset") == n


def kill_after_some(repo: Path, stage: str, kind: str, out: str) -> int:
    """Empties the stage's store part, starts `dvc repro -f -s stage`, SIGKILLs the run's
    process group once >= 2 samples are stored and before all are; returns how many were."""
    n = get_param(repo, "dataset.num_samples")
    for attempt in range(4):  # on a busy machine the run may finish before the kill lands
        empty(repo, kind)
        tag = f"store-kill-{stage}-{attempt}"
        proc = start(repo, "dvc", "repro", "-f", "-s", stage, env_extra={FAULT_TAG: tag})
        try:
            with contextlib.suppress(AssertionError):  # exited first: too late, try again
                wait_for("2 stored samples", lambda: entries(repo, kind) >= 2,
                         timeout=300, proc=proc, log=repo.parent / "repo.repro.log")
        finally:
            assert kill_group(proc, tag) == {}  # every process of the run is gone
        done = entries(repo, kind)
        if done < n:
            break
    assert 2 <= done < n, f"killed after {done} of {n}"
    assert not (repo / out).exists()  # nothing half published (-f removed the old output)
    return done


@pytest.mark.parametrize("stage,kind,out,marker", [
    ("extract", "hidden", "artifacts/hidden", "manifest.json"),
    ("dataset", "dataset", "artifacts/dataset", "store_keys.json")])
def test_a_data_stage_killed_half_way_resumes_with_the_rest_and_the_same_bytes(
        repo, stage, kind, out, marker):
    before = digest(repo / out)
    n = get_param(repo, "dataset.num_samples")
    done = kill_after_some(repo, stage, kind, f"{out}/{marker}")
    # DVC would restore the old output from its cache (the lock is unchanged): run for real
    assert repro(repo, "-f", "-s", stage) == {stage}
    assert counts(repo, stage)["computed"] == n - done
    assert counts(repo, stage)["reused"] == done
    assert digest(repo / out) == before


def test_growing_the_prompts_computes_only_the_new_samples(repo):
    n = get_param(repo, "dataset.num_samples")
    set_param(repo, "dataset.num_samples", n + 2)
    try:
        ran = repro(repo, "extract")
        assert {"dataset", "extract"} <= ran
        assert counts(repo, "dataset")["computed"] == 2
        assert counts(repo, "dataset")["reused"] == n
        assert counts(repo, "extract")["computed"] == 2
        assert counts(repo, "extract")["reused"] == n
    finally:
        set_param(repo, "dataset.num_samples", n)
        repro(repo, "extract")
        sh(repo, "git", "checkout", "--", ".")


def test_new_aux_layer_ids_reextract_everything_and_regenerate_nothing(repo):
    n = get_param(repo, "dataset.num_samples")
    sh(repo, "eagle3pipe", "gc")  # what earlier tests left unreferenced
    assert entries(repo, "hidden") == entries(repo, "dataset") == n
    old = get_param(repo, "draft.aux_layer_ids")
    set_param(repo, "draft.aux_layer_ids", [0, 2, 3])
    try:
        ran = repro(repo, "extract")
        assert "dataset" not in ran and "extract" in ran
        assert counts(repo, "extract")["computed"] == n
        hidden = entries(repo, "hidden")
        r = sh(repo, "eagle3pipe", "gc", "--dry-run")
        assert "would remove 0 unreferenced" in r.stdout, r.stdout  # workspace + dvc.lock
    finally:
        set_param(repo, "draft.aux_layer_ids", old)
        repro(repo, "extract")
        sh(repo, "git", "checkout", "--", ".")
    # the [0, 2, 3] entries are now referenced by nothing: gc would remove exactly those, and
    # so does a data stage run with the store bound below what the store holds
    r = sh(repo, "eagle3pipe", "gc", "--dry-run")
    assert f"would remove {n} unreferenced" in r.stdout, r.stdout
    r = subprocess.run(["dvc", "repro", "-f", "-s", "extract"], cwd=repo, capture_output=True,
                       text=True, env={**env(repo), "EAGLE3PIPE_STORE_MAX_BYTES": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"removed {n} unreferenced" in out and "$EAGLE3PIPE_STORE_MAX_BYTES=1" in out, out
    assert "alone take" in out and "over the bound 1 B" in out, out  # and says it cannot meet it
    assert entries(repo, "hidden") == hidden - n
    assert entries(repo, "dataset") == n
    assert counts(repo, "extract")["reused"] == n
    assert repro(repo, "extract") == set()


def test_gc_with_a_bound_below_the_referenced_entries_says_so(repo):
    r = sh(repo, "eagle3pipe", "gc", "--max-bytes", "1K", check=False)
    assert r.returncode == 2  # errors.EXIT_INPUT: the bound is an input to fix
    assert "referenced entries alone exceed --max-bytes 1,024" in r.stderr and "fix:" in r.stderr
    assert "removed 0 unreferenced" in r.stdout


def test_a_stage_refuses_an_output_that_cannot_fit_on_the_free_disk(repo):
    """The stage runner's check of the stage's own estimate (eagle3pipe.estimates.check)
    before any compute; the free-space figure is faked with $EAGLE3PIPE_FREE_BYTES."""
    before = digest(repo / "artifacts/dataset")
    r = subprocess.run(["dvc", "repro", "-f", "-s", "dataset"], cwd=repo, capture_output=True,
                       text=True, env={**env(repo), "EAGLE3PIPE_FREE_BYTES": "999"})
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "artifacts/dataset: dataset.num_samples: needs" in out and "999 B free" in out, out
    assert "fix: free disk there" in out and "Traceback" not in out
    assert "estimate (CPU): vLLM TP1" in out  # the stage's estimate opens its log
    assert not (repo / "artifacts/dataset").exists() or digest(repo / "artifacts/dataset") == before
    sh(repo, "dvc", "checkout", "-q", "dataset")


def test_a_conversation_source_is_content_addressed_turn_by_turn(repo):
    """dataset.source in conversations/ (a DVC dep of the stage): an edit reruns the dataset
    stage, which regenerates only the edited turn (the turns before it keep their prompts and
    replies), and leaves the stages after it to rerun; reverting restores from the run-cache."""
    src = repo / "conversations/chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"def f{i}(x):"},
                          {"role": "assistant", "content": "the dataset's reply, dropped"},
                          {"role": "user", "content": "and g?"}]} for i in range(3)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    set_param(repo, "dataset.source", "conversations/chat.jsonl")
    set_param(repo, "dataset.format", "messages")
    try:
        assert repro(repo, "dataset") == {"dataset"}
        assert (counts(repo, "dataset")["computed"], counts(repo, "dataset")["reused"]) == (6, 0)
        first, original = digest(repo / "artifacts/dataset"), src.read_text()
        rows[1]["messages"][2]["content"] = "and h?"  # conversation 2, its second user turn
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        status = sh(repo, "dvc", "status", "dataset").stdout
        assert "conversations" in status and "modified" in status, status
        assert repro(repo, "dataset") == {"dataset"}
        assert (counts(repo, "dataset")["computed"], counts(repo, "dataset")["reused"]) == (1, 5)
        assert "extract" in sh(repo, "dvc", "status").stdout  # what follows reruns next
        src.write_text(original)
        assert repro(repo, "dataset") == set()  # the run-cache: nothing executed
        assert digest(repo / "artifacts/dataset") == first
    finally:
        src.unlink(missing_ok=True)
        sh(repo, "git", "checkout", "--", ".")
        repro(repo, "dataset")
