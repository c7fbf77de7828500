"""Faults: a SIGKILL at three points of every stage of the micro pipeline, two `dvc repro` at once
in one repo, and a full disk during extract, all through real DVC, real stage processes and a
real (tmpfs) filesystem; nothing is faked but the moment of the kill.

Counts (all survived): 8 stages x 3 kill points = 24 kills, each followed by a `dvc repro` that
gives the uninterrupted run's bytes; 1 second `dvc repro` at once, refused, the first one
completing unharmed; 1 full disk during extract (exit 2, the path named, no traceback, nothing
published; with space back the same bytes). Fast, without DVC: a killed atomic writer (directory
and file) publishes nothing and the next writer removes what it left; a stage process dies with
its launcher; torchrun's workers die with torchrun, bound or still importing; a full disk in
three writers (Python's, JSON, safetensors') is one error naming the output.

Every stage (verifier, configs, dataset, vocab, extract, train, export, smoke) runs as
`dvc repro --no-run-cache <stage>` and its whole process group gets SIGKILL at each of:
  start    0.25 s after DVC started the stage's command (interpreter start-up and imports);
  mid      after 60% of the CPU seconds the uninterrupted reference spent on the stage (DVC's
           and the stage's): past the imports, and before the end on any load, since a run
           takes at least its CPU time (should it end first all the same, again at 30%, 15%);
  publish  everything written, just before the stage's main output is renamed into place (the
           hook in tests/helpers/site/sitecustomize.py holds the writer there); for configs
           four of its five files are published by then, for smoke its plots, not its metrics.
After each kill: no process of the run survives (torchrun starts its workers in sessions of
their own; without runtime.bind_to_launcher they went on training and published after DVC was
dead; one killed while still importing now exits at the stage runner's first line), every
output of the stage is absent or byte-identical to the uninterrupted run's, and DVC ran nothing
but that stage. A last `dvc repro --no-run-cache <stage>` then executes it again (DVC found it
changed: it trusts nothing a kill left) and its outputs equal the uninterrupted run's, byte for
byte, with nothing left beside them.

Cost (about 4 min in the suite on a 2-core AMD EPYC, beside the TP-2 background run): the
uninterrupted reference runs stage by stage; before each segment a copy of it is the repo in
which that segment's stages are killed (smoke's kill points in two copies: SEGMENTS), so the
five kill chains run beside each other and the reference, with FAULT_PARAMS (one thread a
process, a smaller smoke stage) for runs that share two cores.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers.pipeline import (FAULT_TAG, MICRO_PARAMS, ROOT, STAGES, digest, digests, env,
                              fault_hold, get_param, kill_group, leftovers, make_repo, set_param,
                              sh, stage_outputs, start, tagged, wait_for)

POINTS = ("start", "mid", "publish")
START_DELAY = 0.25
# `mid` kills at this share of the reference's CPU seconds for the stage; should the stage have
# ended first all the same, again at the next share, forced (-f -s)
MID_FRACTIONS = (0.6, 0.3, 0.15)
# every run of a kill chain executes what DVC finds changed: a run that completed (a `mid` kill
# that came too late) would otherwise let DVC restore the stage from its run-cache
RUN = ("--no-run-cache",)
# the output whose publication the `publish` kill point holds (the stage's last big write)
HOLD = {"verifier": "artifacts/verifier", "configs": "configs/verifier_config.json",
        "dataset": "artifacts/dataset", "vocab": "artifacts/vocab", "extract": "artifacts/hidden",
        "train": "artifacts/train", "export": "artifacts/export", "smoke": "metrics/smoke.json"}
# (stages, kill points) of each kill chain, in the reference's order. The smoke stage, the
# longest to kill and finish, has two chains of its own (start and mid, then publish; each
# ends with a run to the end): they start only once the reference has run everything before
# smoke, so at the end they run alone, and two use both cores where one left one idle
SEGMENTS = ((("verifier", "configs"), POINTS), (("dataset", "vocab", "extract"), POINTS),
            (("train", "export"), POINTS), (("smoke",), POINTS[:2]), (("smoke",), POINTS[2:]))
TIMEOUT = 600  # seconds for one stage run; a micro stage takes 1-35 s
# The micro params, cheaper where that changes nothing a kill meets (the reference runs with
# the same params, so every comparison is like for like). Up to five of these runs share two
# cores: vLLM's CPU backend binds every engine's compute thread to CPU 0
# (vllm.cpu_omp_threads_bind: auto) and two-thread torch ops stall whenever a thread is
# descheduled, so side by side they wasted half the CPU; one thread each and no binding. The
# smoke stage, run four times here, measures one prompt at k = 3 only; keys the micro params do
# not have are left out.
FAULT_PARAMS = {"vllm.cpu_omp_threads_bind": "nobind", "verifier.embedded.threads": 1,
                "extract.threads": 1, "train.threads": 1, "smoke.threads": 1,
                "verifier.embedded.train_steps": 10, "smoke.num_prompts": 1, "smoke.max_tokens": 8,
                "smoke.k_sweep": [3], "smoke.timing_rounds": 1}
PLAN_FITS = "EAGLE3PIPE_FREE_BYTES"  # eagle3pipe.tools.plan's stand-in for the measured free disk
PROBE = "smoke"  # a second `dvc repro` starts while this stage's last run is inside its command
# what a copy of a repo leaves out: the per-sample store of the data stages (eagle3pipe.data.store),
# so that every copy starts with a cold one, as a fresh clone does
NOT_COPIED = shutil.ignore_patterns(".eagle3pipe")


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-Urm", "sh", "-c",
                           "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                           "mount -t tmpfs -o size=64k tmpfs /tmp"],
                          capture_output=True).returncode == 0


UNSHARE = _unshare_works()
needs_unshare = pytest.mark.skipif(
    not UNSHARE, reason="a small real filesystem needs `unshare -Urm` (user and mount namespaces) "
    "to mount a tmpfs without root; this kernel or sandbox refuses them")


# ---------------------------------------------------------------------------------------------
# The stage runs and their kills


def _ran(log: Path) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", log.read_text()) if log.exists() else []


def executed(runlog: Path) -> list[str]:
    """The stages whose commands executed, in order, once each: every process that runs a
    stage's command records it (the train stage's command and the torchrun worker it becomes
    the parent of both do)."""
    return list(dict.fromkeys(runlog.read_text().split())) if runlog.exists() else []


def _stage_started(log: Path):
    """The moment DVC printed the stage's command (it starts it right after)."""
    return lambda: log.exists() and re.search(r"^> ", log.read_text(), re.M) and time.monotonic()


def _lock_state(repo: Path) -> tuple[int, bytes] | None:
    lock = repo / "dvc.lock"
    return (lock.stat().st_mtime_ns, lock.read_bytes()) if lock.exists() else None


def kill_at(repo: Path, stage: str, point: str, delay: float = START_DELAY,
            forced: bool = False) -> dict:
    """One `dvc repro <stage>` killed (its whole process group) at `point`, `delay` seconds
    after DVC started the stage's command (`publish`: once it holds); what it left.

    `completed`: DVC wrote dvc.lock before the kill, so it recorded the stage's run and a later
    `dvc repro` without -f would skip it (DVC's process can still be alive then, hashing or
    exiting: its being alive does not say the stage had not ended)."""
    tag = uuid.uuid4().hex
    lock_before = _lock_state(repo)
    log = repo.parent / f"{repo.name}.{stage}.{point}.log"
    held = repo.parent / f"{repo.name}.{stage}.held"
    held.unlink(missing_ok=True)
    extra = {FAULT_TAG: tag}
    if point == "publish":
        extra |= fault_hold(repo / "src", repo / HOLD[stage], held)
    cmd = ("dvc", "repro", *RUN, *(("-f", "-s") if forced else ()), stage)
    proc = start(repo, *cmd, env_extra=extra, log=log)
    try:
        t0 = wait_for(f"{stage} started", _stage_started(log), timeout=TIMEOUT, proc=proc,
                      log=log)
        if point == "publish":
            wait_for(f"{stage} held before publishing {HOLD[stage]}", held.exists,
                     timeout=TIMEOUT, proc=proc, log=log)
        else:
            time.sleep(max(0.0, t0 + delay - time.monotonic()))
        t_kill = time.monotonic() - t0
        alive = proc.poll() is None
    finally:  # a torchrun worker killed while importing exits at the runner's first line
        survivors = kill_group(proc, tag, grace=60)
    completed = _lock_state(repo) != lock_before
    outs = stage_outputs(repo, stage)
    return {"stage": stage, "point": point, "cmd": " ".join(cmd), "t_kill": round(t_kill, 2),
            "running": alive and not completed, "completed": completed,
            "survivors": survivors, "ran": _ran(log),
            "outputs": digests(repo, outs), "leftovers": leftovers(repo, outs), "log": str(log)}


def finish(repo: Path, stage: str, probe: bool = False, forced: bool = False) -> dict:
    """`dvc repro <stage>` to the end; with `probe`, a second `dvc repro` of the whole pipeline
    in the same repo while the first is inside the stage's command."""
    tag = uuid.uuid4().hex
    log = repo.parent / f"{repo.name}.{stage}.final.log"
    cmd = ("dvc", "repro", *RUN, *(("-f", "-s") if forced else ()), stage)
    proc = start(repo, *cmd, env_extra={FAULT_TAG: tag}, log=log)
    second = None
    try:
        if probe:
            t0 = wait_for(f"{stage} started", _stage_started(log), timeout=TIMEOUT, proc=proc,
                          log=log)
            time.sleep(max(0.0, t0 + 1.0 - time.monotonic()))
            lock = repo / "dvc.lock"
            before = lock.read_bytes() if lock.exists() else None
            r = sh(repo, "dvc", "repro", check=False)
            second = {"rc": r.returncode, "output": r.stdout + r.stderr,
                      "first_running": proc.poll() is None, "lock_existed": before is not None,
                      "lock_untouched": (lock.read_bytes() if lock.exists() else None) == before}
        rc = proc.wait(timeout=TIMEOUT)
    finally:
        kill_group(proc, tag)
    outs = stage_outputs(repo, stage)
    return {"rc": rc, "cmd": " ".join(cmd), "log": log.read_text()[-6000:], "ran": _ran(log),
            "executed": executed(repo / ".runlog"),
            "outputs": digests(repo, outs), "leftovers": leftovers(repo, outs),
            "second": second}


class Reference:
    """The uninterrupted run, stage by stage: what each executed and its CPU seconds (DVC's
    and the stage's processes'), as the reference finishes each."""

    CPU_OF = ("import resource, subprocess, sys\n"
              "r = subprocess.run(sys.argv[2:])\n"
              "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
              "open(sys.argv[1], 'w').write(str(ru.ru_utime + ru.ru_stime))\n"
              "sys.exit(r.returncode)\n")

    def __init__(self, repo: Path):
        self.repo, self.cpu = repo, {}
        self.done = {s: threading.Event() for s in STAGES}

    def run(self, stage: str) -> None:
        runlog, cpu = self.repo / ".runlog", self.repo.parent / f"{self.repo.name}.{stage}.cpu"
        runlog.unlink(missing_ok=True)
        try:
            sh(self.repo, sys.executable, "-c", self.CPU_OF, str(cpu), "dvc", "repro", stage)
            ran = executed(runlog)
            assert ran == [stage], f"the reference's `dvc repro {stage}` executed {ran}"
            self.cpu[stage] = float(cpu.read_text())
        finally:  # a failed reference fails the chains waiting for it at once, not at a timeout
            self.done[stage].set()

    def cpu_of(self, stage: str) -> float:
        assert self.done[stage].wait(2 * TIMEOUT), f"the reference never finished {stage}"
        assert stage in self.cpu, f"the reference's `dvc repro {stage}` failed"
        return self.cpu[stage]


def kill_chain(repo: Path, stages: tuple[str, ...], ref: Reference,
               probe: str | None = None, points: tuple[str, ...] = POINTS) -> dict:
    """Each stage in turn: killed at each of `points`, then run to the end (for the stage
    `probe` with a second `dvc repro` at once); finals: one per stage, each naming it."""
    kills, finals, t0 = [], [], time.monotonic()
    for stage in stages:
        # once a run of the stage has completed (DVC recorded it in dvc.lock), DVC holds it up
        # to date: the runs after it are forced
        forced = False
        for point in points:
            if point == "mid":
                for attempt, fraction in enumerate(MID_FRACTIONS):
                    rec = kill_at(repo, stage, point, fraction * ref.cpu_of(stage), forced)
                    forced = forced or rec["completed"]
                    if rec["running"]:
                        break
                rec["attempts"] = attempt + 1
            else:
                rec = kill_at(repo, stage, point, forced=forced)
                forced = forced or rec["completed"]
            kills.append(rec)
        finals.append({"stage": stage,
                       **finish(repo, stage, probe=stage == probe, forced=forced)})
    return {"kills": kills, "finals": finals, "seconds": round(time.monotonic() - t0)}


# ---------------------------------------------------------------------------------------------
# A full disk during extract: a tmpfs mounted over artifacts/ in a mount namespace


def full_disk_extract(repo: Path) -> dict:
    """A copy of the reference after extract, on a tmpfs (in a mount namespace) with room for
    all of it but extract's output and a third of that: `dvc repro -f -s extract` fails; then,
    with room again, the same command succeeds. The stage runner's check of the free disk
    before any compute (eagle3pipe.tools.plan) is told there is room, so that the disk fills while the
    stage writes, as when something else takes the space during the run."""
    room = digest_size(repo / "artifacts/hidden") // 3
    small, out = repo.parent / f"{repo.name}.small", repo.parent / f"{repo.name}.out"
    small.mkdir()
    out.mkdir()
    script = f"""
        set -u
        mount -t tmpfs -o size=256m tmpfs {small} || exit 90
        cp -a {repo}/. {small}/ && rm -rf {small}/artifacts/hidden && cd {small} || exit 91
        used=$(df -B1 --output=used . | tail -n 1)
        mount -o remount,size=$((used + {room})) {small} || exit 92
        {PLAN_FITS}=1000000000000 dvc repro -f -s extract > {out}/full.log 2>&1
        echo $? > {out}/rc1
        ls -A artifacts > {out}/artifacts_after; ls -A metrics > {out}/metrics_after
        find . -name '*.tmp' -not -path './.git/*' > {out}/tmp_after
        mount -o remount,size=256m {small}
        dvc repro -f -s extract > {out}/room.log 2>&1; echo $? > {out}/rc2
        cp -a artifacts/hidden {out}/hidden && cp metrics/extract.json {out}/extract.json
    """
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=repo, env=env(repo),
                       capture_output=True, text=True, timeout=2 * TIMEOUT)
    assert r.returncode == 0, f"namespace script failed ({r.returncode}): {r.stderr[-3000:]}"
    read = lambda name: (out / name).read_text()  # noqa: E731
    return {"rc1": int(read("rc1")), "rc2": int(read("rc2")), "room": room,
            "full_log": read("full.log"), "room_log": read("room.log"),
            "artifacts_after": read("artifacts_after").split(),
            "metrics_after": read("metrics_after").split(), "tmp_after": read("tmp_after").split(),
            "hidden": digest(out / "hidden"), "metrics": digest(out / "extract.json")}


def _children_cpu() -> float:
    """CPU seconds of the waited-for processes (the stages of a killed run are not counted)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def digest_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# The run: reference segment by segment, a kill chain per segment beside it


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    ref = make_repo(base / "reference")
    for key, value in FAULT_PARAMS.items():
        with contextlib.suppress(KeyError):
            get_param(ref, key)
            set_param(ref, key, value)
    sh(ref, "git", "commit", "-qam", "fault params")
    t0, cpu0 = time.monotonic(), _children_cpu()
    timing = Reference(ref)
    with ThreadPoolExecutor(len(SEGMENTS) + 1) as pool:
        chains, disk = [], None
        for i, (seg, points) in enumerate(SEGMENTS):
            repo = base / f"chain{i}"
            shutil.copytree(ref, repo, symlinks=True, ignore=NOT_COPIED)
            chains.append(pool.submit(kill_chain, repo, seg, timing, points=points,
                                      probe=PROBE if PROBE in seg and "publish" in points
                                      else None))
            if i + 1 < len(SEGMENTS) and SEGMENTS[i + 1][0] == seg:
                continue  # the next chain kills the same stages: copied from the same point
            for stage in seg:
                timing.run(stage)
            if "extract" in seg and UNSHARE:
                repo = base / "full_disk"
                shutil.copytree(ref, repo, symlinks=True, ignore=NOT_COPIED)
                disk = pool.submit(full_disk_extract, repo)
        outs = {s: stage_outputs(ref, s) for s in STAGES}
        reference = {s: digests(ref, outs[s]) for s in STAGES}
        runs = [c.result() for c in chains]
        disk = disk.result() if disk else None
    result = {"reference": reference, "kills": [k for r in runs for k in r["kills"]],
              "finals": [f for r in runs for f in r["finals"]], "disk": disk,
              "seconds": round(time.monotonic() - t0),
              "cpu_seconds": round(_children_cpu() - cpu0), "load": os.getloadavg(),
              "chain_seconds": [r["seconds"] for r in runs],
              "reference_cpu_seconds": {k: round(v, 1) for k, v in timing.cpu.items()}}
    (base / "faults.json").write_text(json.dumps(result, indent=1, default=str))
    return result


@pytest.mark.slow
def test_every_stage_killed_at_every_point_then_repro_gives_the_uninterrupted_bytes(faults):
    kills, finals, ref = faults["kills"], faults["finals"], faults["reference"]
    assert [(k["stage"], k["point"]) for k in kills] == \
        [(s, p) for s in STAGES for p in POINTS]  # 8 stages x 3 points = 24 kills
    for k in kills:
        where = f"{k['stage']} killed at {k['point']} ({k['t_kill']} s; {k['log']})"
        assert k["running"], f"{where}: the run had already ended"
    assert sorted({f["stage"] for f in finals}) == sorted(STAGES), [f["stage"] for f in finals]
    for f in finals:
        stage = f["stage"]
        assert f["rc"] == 0, f"{stage}: dvc repro after the kills failed:\n{f['log']}"
        # DVC executed the killed stage again (it trusted nothing the kills left) and only it
        assert f["ran"] == [stage] and f["executed"] == [stage], (stage, f["ran"], f["executed"])
        assert f["outputs"] == ref[stage], f"{stage}: outputs differ from the uninterrupted run"
        assert None not in ref[stage].values(), (stage, ref[stage])
        assert f["leftovers"] == [], f"{stage}: left beside its outputs: {f['leftovers']}"


@pytest.mark.slow
def test_no_kill_leaves_a_partial_output_or_a_process(faults):
    ref = faults["reference"]
    for k in faults["kills"]:
        where = f"{k['stage']} killed at {k['point']} ({k['t_kill']} s; {k['log']})"
        assert k["survivors"] == {}, f"{where}: processes outlived the kill: {k['survivors']}"
        assert k["ran"] == [k["stage"]], f"{where}: DVC ran {k['ran']}"
        for path, h in k["outputs"].items():  # metrics/train/ too: dvclive writes a temporary
            assert h in (None, ref[k["stage"]][path]), f"{where}: {path} is partial"
    held = {k["stage"]: k["outputs"] for k in faults["kills"] if k["point"] == "publish"}
    for stage, outs in held.items():  # held just before publishing: the main output is absent
        assert outs[HOLD[stage]] is None, (stage, outs)
    # what the holds left published: a consistent part, each file whole
    assert sum(h is not None for h in held["configs"].values()) == 4, held["configs"]
    plots = "plots/smoke_acceptance.json"
    assert held["smoke"][plots] == ref["smoke"][plots], held["smoke"]


@pytest.mark.slow
def test_a_second_repro_at_once_is_refused_and_the_first_completes(faults):
    [f] = [f for f in faults["finals"] if f["second"] is not None]
    second = f["second"]
    assert second["rc"] != 0 and second["first_running"], second
    # DVC holds a read/write lock on every output of the running stage (and its repo lock
    # between stages); the second run names the busy output and the process that holds it
    assert re.search(r"is busy, it is being blocked by|Unable to acquire lock", second["output"]), \
        second["output"]
    assert "Running stage" not in second["output"], second["output"]
    assert second["lock_existed"] and second["lock_untouched"], second
    assert f["rc"] == 0 and f["executed"] == [PROBE]
    assert f["outputs"] == faults["reference"][PROBE]


@pytest.mark.slow
@needs_unshare
def test_a_full_disk_during_extract_names_the_path_and_publishes_nothing(faults):
    d, ref = faults["disk"], faults["reference"]["extract"]
    log = d["full_log"]
    assert d["rc1"] != 0, log[-3000:]
    assert "exited with 2" in log, log[-3000:]
    assert "extract: error: no space left on device writing artifacts/hidden" in log, log[-3000:]
    assert "fix: free space on that filesystem" in log, log[-3000:]
    assert "Traceback" not in log, log[-6000:]
    # nothing of extract was published or left on the full filesystem, its metrics neither
    assert "hidden" not in d["artifacts_after"], d["artifacts_after"]
    assert not [n for n in d["artifacts_after"] if n.startswith(".")], d["artifacts_after"]
    assert d["tmp_after"] == [], d["tmp_after"]
    assert "extract.json" not in d["metrics_after"], d["metrics_after"]
    # space back: the same command succeeds with the uninterrupted run's bytes
    assert d["rc2"] == 0, d["room_log"][-3000:]
    assert d["hidden"] == ref["artifacts/hidden"]
    assert d["metrics"] == ref["metrics/extract.json"]


# ---------------------------------------------------------------------------------------------
# The writers and the runner, fast


HOLDING_WRITER = """
import sys
from pathlib import Path
from eagle3pipe.runtime import atomic as runtime, jsonio
out = Path(sys.argv[1])
with runtime.atomic_dir(out / "d") as t:
    (t / "f").write_text("new")
runtime.write_text_atomic(out / "f.json", "new")
"""


def _python(code: str, *args: str, env_extra: dict | None = None, **kw) -> subprocess.Popen:
    e = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=e, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.parametrize("target", ["d", "f.json"])
def test_a_killed_writer_publishes_nothing_and_the_next_writer_removes_its_leftovers(
        tmp_path, target):
    from eagle3pipe.runtime import atomic as runtime

    (tmp_path / "d").mkdir()
    (tmp_path / "d/f").write_text("old")
    (tmp_path / "f.json").write_text("old")
    held, tag = tmp_path / "held", uuid.uuid4().hex
    p = _python(HOLDING_WRITER, str(tmp_path),
                env_extra={FAULT_TAG: tag, **fault_hold(ROOT / "src", tmp_path / target, held)})
    wait_for("the writer held", held.exists, timeout=60, proc=p)
    assert kill_group(p, tag) == {}
    # the held output is the old one, whole; the dead writer's temporary sits beside it
    assert (tmp_path / ("d/f" if target == "d" else target)).read_text() == "old"
    left = leftovers(tmp_path, [target])
    assert len(left) == 1 and re.fullmatch(
        rf"\.{re.escape(target)}\.{p.pid}-{runtime.HOST}\.\w+\.tmp", left[0])
    # a live writer's temporary is not touched, a dead one's is removed by the next writer
    live = subprocess.Popen(["sleep", "30"])
    try:
        mine = tmp_path / f".{target}.{live.pid}-{runtime.HOST}.abc.tmp"
        mine.mkdir()
        if target == "d":
            with runtime.atomic_dir(tmp_path / "d") as t:
                (t / "f").write_text("newer")
            assert (tmp_path / "d/f").read_text() == "newer"
        else:
            runtime.write_text_atomic(tmp_path / "f.json", "newer")
            assert (tmp_path / "f.json").read_text() == "newer"
            assert oct((tmp_path / "f.json").stat().st_mode & 0o777) == \
                oct(0o666 & ~runtime._UMASK)  # an ordinary file's mode, not mkstemp's 0600
        assert leftovers(tmp_path, [target]) == [mine.name]
    finally:
        live.kill()
        live.wait()


LAUNCHER = """
import subprocess, sys, time
for bound in ("1", ""):
    # as torchrun starts its workers: in a session of their own
    subprocess.Popen([sys.executable, "-c", sys.argv[1], bound], start_new_session=True)
time.sleep(120)
"""
CHILD = """
import os, sys, time
from eagle3pipe.runtime import atomic as runtime, jsonio
if sys.argv[1]:
    runtime.bind_to_launcher()
open(os.environ["MARK"] + sys.argv[1], "w").close()
time.sleep(120)
"""


def test_a_stage_process_dies_with_its_launcher(tmp_path):
    tag = uuid.uuid4().hex
    p = _python(LAUNCHER, CHILD, env_extra={FAULT_TAG: tag, "MARK": str(tmp_path / "up")})
    try:
        wait_for("both children up", lambda: (tmp_path / "up1").exists() and
                 (tmp_path / "up").exists(), timeout=60, proc=p)
        os.kill(p.pid, signal.SIGKILL)  # the launcher alone, as when torchrun is killed
        p.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(tagged(tag)) > 1:
            time.sleep(0.05)
        left = tagged(tag)
        # the bound child died with it; the unbound one (its last argument empty) did not
        assert len(left) == 1 and not next(iter(left.values())).endswith(" 1 "), left
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


TORCHRUN_WORKER = """
import os, sys, time
rank = int(os.environ["LOCAL_RANK"])
if rank == 1:
    time.sleep(3)  # still importing when torchrun is killed
from eagle3pipe.runtime import atomic as runtime, jsonio
runtime.bind_to_launcher()
open(os.path.join(os.environ["MARK"], f"bound{rank}"), "w").close()
time.sleep(120)
"""


@pytest.mark.integration
def test_torchrun_workers_die_with_torchrun_bound_or_still_importing(tmp_path):
    """torchrun starts each worker in a session of its own: a SIGKILL of torchrun's process
    group does not reach them. The bound worker dies with torchrun (PDEATHSIG); the one still
    importing exits when it reaches the stage runner's first line."""
    (tmp_path / "worker.py").write_text(TORCHRUN_WORKER)
    tag = uuid.uuid4().hex
    torchrun = str(Path(sys.executable).parent / "torchrun")
    e = {**os.environ, "PYTHONPATH": str(ROOT / "src"), FAULT_TAG: tag, "MARK": str(tmp_path)}
    p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2",
                          str(tmp_path / "worker.py")], env=e, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("worker 0 bound", (tmp_path / "bound0").exists, timeout=120, proc=p)
        assert not (tmp_path / "bound1").exists()
        assert kill_group(p, tag, grace=30) == {}
        assert not (tmp_path / "bound1").exists()
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


FULL_STAGE = """
import sys
from eagle3pipe.runtime import atomic as runtime, jsonio
from eagle3pipe.stages import runner as stage

def run(params, p):
    mode = p.dataset.name
    if mode == "write":  # Python's own writer: OSError ENOSPC
        with runtime.atomic_dir(p.out) as t:
            (t / "big").write_bytes(b"0" * (1 << 20))
    elif mode == "json":  # the metrics / config writer
        jsonio.write_json(p.out, {"x": "0" * (1 << 20)})
    else:  # safetensors' Rust writer: SafetensorError, not an OSError
        import torch
        from safetensors.torch import save_file
        with runtime.atomic_dir(p.out) as t:
            save_file({"w": torch.zeros(1 << 18)}, str(t / "model.safetensors"))

stage.main("vocab", run, paths=("dataset", "verifier_config", "out"))
"""


@pytest.mark.integration
@needs_unshare
def test_a_full_disk_is_one_error_naming_the_output(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    (tmp_path / "stage.py").write_text(FULL_STAGE)
    runs = []
    for mode in ("write", "json", "safetensors"):
        runs.append(
            f"{sys.executable} {tmp_path}/stage.py --params {MICRO_PARAMS} --dvc-yaml "
            f"{ROOT / 'dvc.yaml'} --dataset {mode} --verifier-config x --out {mnt}/out "
            f"> {tmp_path}/{mode}.log 2>&1; echo $? > {tmp_path}/{mode}.rc; "
            f"ls -A {mnt} > {tmp_path}/{mode}.ls")
    script = f"mount -t tmpfs -o size=256k tmpfs {mnt} || exit 90\n" + "\n".join(runs)
    e = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", script], env=e, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for mode in ("write", "json", "safetensors"):
        log = (tmp_path / f"{mode}.log").read_text()
        assert (tmp_path / f"{mode}.rc").read_text().strip() == "2", (mode, log)
        assert f"vocab: error: no space left on device writing {mnt}/out (" in log, (mode, log)
        assert "fix: free space on that filesystem" in log and "Traceback" not in log, log
        assert (tmp_path / f"{mode}.ls").read_text().split() == [], (mode, "left on the disk")
