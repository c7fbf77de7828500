"""Checkpoint and resume of the train stage (eagle3pipe.stages.train.checkpoint): a run stopped
by SIGTERM, or dead from an exception, leaves a checkpoint; the next run of the same key resumes
from it and ends with the bytes of a run never stopped (weights, metrics.json and every plot
file). Real speculators Eagle3DraftModel on real hidden states of the micro verifier; the key
over a real dvc.yaml and dvc.lock."""
from __future__ import annotations

import os
import signal
import subprocess
import types
from pathlib import Path

import pytest

from eagle3pipe.stages.train import run as trainmod
from eagle3pipe.stages.train import checkpoint as ck
from helpers.training import MICRO_TRAIN, make_inputs

EVERY = 3


@pytest.fixture(scope="module")
def inputs(micro_verifier, tmp_path_factory):
    return make_inputs(micro_verifier, tmp_path_factory.mktemp("resume_inputs"))


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _train(inp, root: Path, checkpoints: ck.Checkpoints | None):
    p = types.SimpleNamespace(**{**MICRO_TRAIN, "checkpoint_every": EVERY})
    return trainmod.train(p, inp.draft_config, inp.verifier, inp.hidden, inp.vocab,
                          root / "train", metrics_dir=root / "metrics", progress=False,
                          checkpoints=checkpoints)


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """A run never stopped, checkpointing as it goes: its outputs, its checkpoints removed."""
    root = tmp_path_factory.mktemp("uninterrupted")
    c = ck.Checkpoints("k", root / "ck")
    last = _train(inputs, root, c)
    assert not c.dir.exists(), "a published run's checkpoints are removed"
    return types.SimpleNamespace(root=root, last=last, out=_outputs(root))


def _outputs(root: Path) -> dict[str, bytes]:
    return {**_files(root / "train"),
            **{f"metrics/{k}": v for k, v in _files(root / "metrics").items()}}


def _failing_step(monkeypatch, at: int, action):
    """trainmod.step, with `action(s)` run once right after step `at`."""
    real = trainmod.step

    def step(s, idx):
        out = real(s, idx)
        if s.step == at:
            action(s)
        return out
    monkeypatch.setattr(trainmod, "step", step)
    return real


@pytest.mark.integration
def test_sigterm_saves_then_the_rerun_resumes_to_the_same_bytes(inputs, reference, tmp_path,
                                                                monkeypatch, caplog):
    c = ck.Checkpoints("k", tmp_path / "ck")
    real = _failing_step(monkeypatch, 5, lambda s: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(ck.Stopped) as e:
        _train(inputs, tmp_path, c)
    assert "stopped by SIGTERM at step 5" in str(e.value) and \
        "fix: rerun `dvc repro`: it resumes from step 5" in str(e.value)
    assert c.latest().name == "step-5" and [p.name for p in c.dir.iterdir()] == ["step-5"]
    assert not (tmp_path / "train").exists() and not (tmp_path / "metrics").exists()
    monkeypatch.setattr(trainmod, "step", real)
    with caplog.at_level("INFO", logger="eagle3pipe.stages.train"):
        last = _train(inputs, tmp_path, c)
    assert "resuming from" in caplog.text and "step 5 of" in caplog.text
    assert _outputs(tmp_path) == reference.out
    assert last == reference.last
    assert not c.dir.exists()


@pytest.mark.integration
def test_a_crash_resumes_from_the_newest_checkpoint(inputs, reference, tmp_path, monkeypatch,
                                                    caplog):
    c = ck.Checkpoints("k", tmp_path / "ck")

    def crash(s):
        raise RuntimeError("the node died")
    real = _failing_step(monkeypatch, 2 * EVERY + 1, crash)
    with pytest.raises(RuntimeError):
        _train(inputs, tmp_path, c)
    assert c.latest().name == f"step-{2 * EVERY}"
    monkeypatch.setattr(trainmod, "step", real)
    with caplog.at_level("INFO", logger="eagle3pipe.stages.train"):
        _train(inputs, tmp_path, c)
    assert f"step {2 * EVERY} of" in caplog.text
    assert _outputs(tmp_path) == reference.out


@pytest.mark.integration
def test_a_half_written_checkpoint_is_never_resumed(inputs, tmp_path):
    """A checkpoint is published whole (runtime.atomic_dir): a directory without its
    checkpoint.json, as a kill mid-write would leave beside it, is not a checkpoint."""
    c = ck.Checkpoints("k", tmp_path / "ck")
    (c.dir / "step-9").mkdir(parents=True)
    (c.dir / "step-9" / ck.STATE).write_bytes(b"partial")
    assert c.latest() is None


def _repo(tmp_path: Path) -> Path:
    """A dvc.yaml whose train stage depends on code, an upstream output and drafts/, and the
    dvc.lock recording that output's hash."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src/train.py").write_text("x = 1\n")
    (tmp_path / "drafts").mkdir()
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  train:\n    cmd: python src/train.py\n    deps:\n      - src/train.py\n"
        "      - artifacts/hidden\n      - drafts\n    params:\n      - train\n")
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  extract:\n    cmd: x\n    outs:\n    - path: artifacts/hidden\n"
        "      hash: md5\n      md5: aaaa.dir\n")
    return tmp_path


FULL_CHECKPOINT = """
import json, sys, types
import torch
from eagle3pipe.errors import Error
from eagle3pipe.stages.train import checkpoint as ck

torch.manual_seed(0)
core = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(core.parameters())
core(torch.ones(2, 256)).sum().backward()
opt.step()
s = types.SimpleNamespace(core=core, opt=opt, step=3, d=types.SimpleNamespace(device="cpu"),
                          sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0))
c = ck.Checkpoints("k", sys.argv[1])
first = c.save(s, None, {"n": 3})
kept = core.weight.detach().clone()
with torch.no_grad():
    core.weight.add_(1.0)
s.step = 6
try:
    c.save(s, None, {"n": 6})
    err = None
except Error as e:
    err = str(e)
left = sorted(p.name for p in c.dir.iterdir())
s.step = 0
saved = c.restore(s, c.latest())
print(json.dumps({"err": err, "left": left, "latest": str(c.latest()), "first": str(first),
                  "saved": saved, "step": s.step, "same": bool(torch.equal(core.weight, kept))}))
"""


@pytest.mark.integration
@pytest.mark.skipif(subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode
                    != 0, reason="a small real filesystem needs `unshare -Urm`")
def test_a_full_disk_while_checkpointing_is_one_error_and_the_previous_checkpoint_resumes(
        tmp_path):
    """On a real (tmpfs) filesystem with room for one checkpoint, not for the next beside it."""
    import json
    import sys

    from helpers.micro import ROOT

    (tmp_path / "ck.py").write_text(FULL_CHECKPOINT)
    mnt = tmp_path / "small"
    mnt.mkdir()
    # one checkpoint: the weights and AdamW's two moments, 3 x 256 KiB
    script = (f"mount -t tmpfs -o size=1100k tmpfs {mnt} || exit 90\n"
              f"{sys.executable} {tmp_path}/ck.py {mnt}")
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    err = got["err"]
    assert err and err.startswith(f"train: no space left on device writing the checkpoint "
                                  f"{mnt}/k/step-6 ("), got
    assert f"the previous checkpoint {mnt}/k/step-3 is whole: the next run resumes from it" \
        in err and "fix: free space on that filesystem" in err, err
    # nothing partial beside it; the previous one resumes: its step, its weights, its record
    assert got["left"] == ["step-3"] and got["latest"] == got["first"], got
    assert (got["step"], got["saved"], got["same"]) == (3, {"n": 3}, True), got


def test_the_key_follows_every_input_and_param_but_the_cadence(tmp_path):
    repo = _repo(tmp_path)
    params = dict(MICRO_TRAIN, checkpoint_every=4)
    key = ck.stage_key(params, repo / "dvc.yaml")
    assert ck.stage_key({**params, "checkpoint_every": 9}, repo / "dvc.yaml") == key
    assert ck.stage_key({**params, "learning_rate": 1e-3}, repo / "dvc.yaml") != key
    (repo / "src/train.py").write_text("x = 2\n")
    code = ck.stage_key(params, repo / "dvc.yaml")
    assert code != key
    (repo / "drafts/previous").mkdir()
    (repo / "drafts/previous/config.json").write_text("{}")
    draft = ck.stage_key(params, repo / "dvc.yaml")
    assert draft != code
    lock = (repo / "dvc.lock").read_text()
    (repo / "dvc.lock").write_text(lock.replace("aaaa.dir", "bbbb.dir"))
    assert ck.stage_key(params, repo / "dvc.yaml") != draft


def test_gc_removes_every_other_keys_checkpoints(tmp_path):
    for key in ("old", "current"):
        (tmp_path / key / "step-3").mkdir(parents=True)
    gone = ck.remove_stale("current", tmp_path)
    assert [p.name for p in gone] == ["old"] and [p.name for p in tmp_path.iterdir()] == \
        ["current"]


# ---- through dvc repro on the micro pipeline


def _steps(repo: Path) -> int:
    rows = (repo / "metrics/train/plots/metrics/train/loss.tsv").read_text().splitlines()
    return int(rows[-1].split("\t")[0])


@pytest.mark.slow
def test_dvc_repro_killed_at_half_of_training_resumes_to_the_same_weights(micro, tmp_path):
    """A copy of the session's cold micro run: `dvc repro -f -s train` SIGKILLed (its whole
    process group) once a checkpoint at half of training or later exists; the next `dvc repro`
    (train's dvc.lock entry and run-cache removed, as after a first run that never finished:
    nothing to check out) reruns train, which
    resumes from that step (its log says so) and publishes the cold run's weights and metrics,
    byte for byte; no checkpoint is left."""
    import shutil
    import uuid

    from ruamel.yaml import YAML

    from helpers.pipeline import FAULT_TAG, digest, get_param, kill_group, sh, start, wait_for

    repo = tmp_path / "repo"
    shutil.copytree(micro[0], repo, symlinks=True)
    want = {p: digest(repo / p) for p in ("artifacts/train", "metrics/train")}
    half, every = _steps(repo) // 2, get_param(repo, "train.checkpoint_every")
    root = repo / ck.ROOT
    tag = uuid.uuid4().hex

    def at_half():
        return [p for p in root.glob("*/step-*")
                if (p / ck.META).is_file() and int(p.name.split("-")[1]) >= half]
    proc = start(repo, "dvc", "repro", "-f", "-s", "train", env_extra={FAULT_TAG: tag})
    held = wait_for(f"a checkpoint at step >= {half} (every {every})", at_half, timeout=900,
                    proc=proc, log=repo.parent / f"{repo.name}.repro.log")
    assert kill_group(proc, tag) == {}
    step = int(held[0].name.split("-")[1])
    assert not (repo / "artifacts/train").exists()
    # as after a first run that never finished: neither dvc.lock nor DVC's run-cache has a
    # train entry to check out
    shutil.rmtree(repo / ".dvc/cache/runs")
    y = YAML()
    lock = y.load((repo / "dvc.lock").read_text())
    del lock["stages"]["train"]
    with open(repo / "dvc.lock", "w") as fh:
        y.dump(lock, fh)
    r = sh(repo, "dvc", "repro", "train")
    log = r.stdout + r.stderr
    assert "resuming from" in log and f"step {step} of" in log, log[-3000:]
    assert {p: digest(repo / p) for p in want} == want
    assert not any(root.glob("*/step-*")), "a published run's checkpoints are removed"

