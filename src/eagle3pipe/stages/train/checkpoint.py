"""The train stage's checkpoints: what a crashed or stopped run resumes from (speculators'
Trainer keeps `checkpoints/<epoch>` with its `training_state.json` and resumes with
`resume_from_checkpoint`; speculators/train/checkpointer.py). Here a checkpoint is everything
the next steps depend on: the model's and AdamW's state, the schedule, the step, the RNG states
and the metrics written so far. The epoch plan is a function of the params (seeded per epoch),
so the step alone says where in it the run is, and the on-demand producer starts from the same
step (stages.train.run.demand_of).

Where: `.eagle3pipe/checkpoints/train/<key>/step-<n>/` (git-ignored, outside DVC's outputs),
written atomically (runtime.atomic_dir), the previous one removed only after the next is
published, so a run killed while writing one keeps the one before. The key is made of the
stage's own dependencies and params (stage_key): a changed input, code or setting never resumes,
it is another key. A published run removes its key's checkpoints; `eagle3pipe gc` removes the
keys the workspace no longer has (remove_stale).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ruamel.yaml import YAML

from eagle3pipe.config import dvcfile
from eagle3pipe.stages.train.batches import TrainInputError
from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.runtime.disk import disk_full, free_bytes
from eagle3pipe.runtime.distributed import all_reduce
from eagle3pipe.runtime.hashing import sha256_path
from eagle3pipe.runtime.units import human

log = logging.getLogger("eagle3pipe.stages.train")

ROOT = Path(".eagle3pipe/checkpoints/train")
STAGE = "train"
# what changes no byte of the trained draft: the checkpoints' own cadence
NOT_IN_KEY = frozenset({"checkpoint_every"})
STATE, META, METRICS = "state.pt", "checkpoint.json", "metrics"


def _locked_outs(dvc_lock: Path) -> dict[str, str]:
    """path -> content hash of every stage output dvc.lock records (DVC writes each stage's
    entry as soon as the stage has run, so an upstream output's is current by the time train
    runs)."""
    if not dvc_lock.is_file():
        return {}
    doc = YAML(typ="safe").load(dvc_lock.read_text()) or {}
    out = {}
    for body in (doc.get("stages") or {}).values():
        for o in body.get("outs") or []:
            out[o["path"]] = o.get("md5") or o.get("hash") or ""
    return out


def stage_key(train_params: dict[str, Any], dvc_yaml: str | Path) -> str:
    """sha256 over the train stage's dependencies as dvc.yaml lists them (an upstream output by
    the hash dvc.lock records for it, any other path by its bytes: the stage's code,
    drafts/) and its params section, less NOT_IN_KEY."""
    dvc_yaml = Path(dvc_yaml)
    base = dvc_yaml.parent
    locked = _locked_outs(base / "dvc.lock")
    parts = {}
    for dep in dvcfile.stage(STAGE, dvc_yaml).get("deps") or []:
        p = base / dep
        parts[dep] = locked.get(dep) or (sha256_path(p) if p.exists() else "absent")
    params = {k: v for k, v in train_params.items() if k not in NOT_IN_KEY}
    text = json.dumps({"deps": parts, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def key_of(train: Any, dvc_yaml: str | Path) -> str:
    """stage_key of a `train` params section (a TrainParams or a stage's view of it)."""
    from eagle3pipe.config.schema import TrainParams

    return stage_key({f.name: getattr(train, f.name) for f in dataclasses.fields(TrainParams)},
                     dvc_yaml)


class CheckpointError(TrainInputError):
    """A checkpoint could not be written (a full disk); the previous one stays usable."""


class Checkpoints:
    """The checkpoints of one key: save(), latest(), restore(), remove()."""

    def __init__(self, key: str, root: Path = ROOT):
        self.key, self.dir = key, Path(root) / key

    def latest(self) -> Path | None:
        steps = sorted((int(p.name.split("-")[1]), p) for p in self.dir.glob("step-*")
                       if p.is_dir() and (p / META).is_file())
        return steps[-1][1] if steps else None

    def save(self, s, metrics_dir: Path | None, saved: dict[str, Any]) -> Path:
        """The TrainState `s` at its step, the metrics files written so far and `saved` (what
        the loop needs back: its last evaluated point, the metrics' summary), atomically; then
        the older checkpoints are removed. A full disk is one CheckpointError naming the
        checkpoint, and the previous one stays whole (it is removed only after this one is
        published)."""
        target = self.dir / f"step-{s.step}"
        try:
            with atomic_dir(target, output=False) as tmp:
                # through Python's file object: a full disk then reaches us as the OSError
                # (torch's own writer reports it as "unexpected pos", naming no cause)
                with open(tmp / STATE, "wb") as f:
                    torch.save({"model": s.core.state_dict(), "opt": s.opt.state_dict(),
                                "sched": s.sched.state_dict(), "rng": _rng_state()}, f)
                if metrics_dir is not None:
                    shutil.copytree(metrics_dir, tmp / METRICS)
                (tmp / META).write_text(json.dumps({"step": s.step, "saved": saved},
                                                   indent=1) + "\n")
        except Exception as e:
            if not disk_full(e):
                raise
            raise self._no_space(target) from None
        for old in self.dir.glob("step-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        return target

    def _no_space(self, target: Path) -> "CheckpointError":
        fs, free = free_bytes(target)
        prev = self.latest()
        kept = (f"the previous checkpoint {prev} is whole: the next run resumes from it" if prev
                else "there is no earlier checkpoint of this run: the next run starts at step 0")
        return CheckpointError(
            f"train: no space left on device writing the checkpoint {target} ({fs} has "
            f"{human(free)} free now that the partial checkpoint is removed); {kept}; nothing "
            "was published", fix=f"free space on that filesystem, or put {ROOT.parts[0]}/ on a "
            "larger one (a symlink), then rerun `dvc repro train`")

    def restore(self, s, at: Path) -> dict[str, Any]:
        """Puts the checkpoint `at` back into the TrainState `s` (every rank); returns what
        save() was given as `saved`."""
        state = torch.load(at / STATE, map_location=s.d.device, weights_only=True)
        s.core.load_state_dict(state["model"])
        s.opt.load_state_dict(state["opt"])
        s.sched.load_state_dict(state["sched"])
        _set_rng_state(state["rng"])
        meta = json.loads((at / META).read_text())
        s.step = meta["step"]
        return meta["saved"]

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def restore_metrics(at: Path, live_dir: Path) -> None:
    """The metrics files the checkpoint `at` holds, into the run's metrics directory."""
    if (at / METRICS).is_dir():
        shutil.copytree(at / METRICS, live_dir, dirs_exist_ok=True)


def remove_stale(keep: str | None, root: Path = ROOT, *, dry_run: bool = False) -> list[Path]:
    """Removes every key's checkpoints but `keep`'s (the workspace's current key: a run of it
    may be in progress or waiting to resume); the removed directories."""
    gone = [p for p in sorted(Path(root).glob("*")) if p.is_dir() and p.name != keep]
    for p in gone if not dry_run else ():
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [x.tolist() if isinstance(x, np.ndarray) else x
                       for x in np.random.get_state()]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x):
    """random.getstate()'s nested tuples, which torch.load gives back as lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------------------------------------
# The loop's side: stopping on a signal, checkpointing after a step, resuming


class Stopped(TrainInputError):
    """SIGTERM or SIGINT stopped training; a checkpoint holds the steps done."""


@contextmanager
def stop_requests():
    """A flag SIGTERM and SIGINT set (from the main thread only, where signals are handled),
    checked after each step; the previous handlers come back on exit."""
    flag = {"signal": None}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def on_signal(signum, _frame):
        flag["signal"] = signal.Signals(signum).name
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _stop_now(s, flag: dict) -> bool:
    """True on every rank once any rank was asked to stop (all ranks stop at the same step)."""
    asked = torch.tensor([1.0 if flag["signal"] else 0.0], device=s.d.device)
    return all_reduce(asked, s.d).item() > 0 if s.d.world > 1 else bool(asked.item())


def after_step(s, flag: dict, metrics, checkpoints: Checkpoints | None, last: dict[str, Any],
               live_dir: Path | None) -> None:
    """After a step: a checkpoint every p.checkpoint_every steps (none after the last: the
    output follows), and one then Stopped when a signal asked to stop."""
    stop = _stop_now(s, flag)
    every = s.p.checkpoint_every
    if checkpoints is None or not (stop or (every and s.step % every == 0 and s.step < s.limit)):
        if stop:
            raise Stopped(f"train: stopped by {flag['signal'] or 'a peer'} at step {s.step} of "
                          f"{s.limit}; no checkpoint (run outside `dvc repro`)",
                          fix="rerun the stage")
        return
    at = checkpoints.dir / f"step-{s.step}"
    if s.d.main:
        at = checkpoints.save(s, live_dir, {"last": last, "summary": metrics.summary()})
        log.info("step %d/%d: checkpoint %s", s.step, s.limit, at)
    if stop:
        raise Stopped(f"train: stopped by {flag['signal'] or 'a peer'} at step {s.step} of "
                      f"{s.limit}; checkpoint {at}", fix="rerun `dvc repro`: it resumes from "
                      f"step {s.step}")


def resume(s, checkpoints: Checkpoints | None) -> tuple[Path, dict] | None:
    """The newest checkpoint put back into `s` on every rank: (its path, what it saved)."""
    if checkpoints is None:
        return None
    at = checkpoints.latest()
    found = torch.tensor([-1.0 if at is None else float(at.name.split("-")[1])],
                         device=s.d.device)
    if s.d.world > 1 and all_reduce(found.clone(), s.d).item() != found.item() * s.d.world:
        raise TrainInputError(f"{checkpoints.dir}: the ranks see different checkpoints",
                              fix="put the project (its .eagle3pipe/checkpoints) on a "
                              "filesystem every node shares, or remove that folder")
    if at is None:
        return None
    saved = checkpoints.restore(s, at)
    log.info("train: resuming from %s: step %d of %d", at, s.step, s.limit)
    return at, saved
