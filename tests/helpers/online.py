"""Hidden states on demand (extract.mode online and hybrid) through `dvc repro`, the runs
tests/test_online.py reads: `run` trains a copy of the session's cold micro run (offline; its
DVC cache included, its per-sample store not) hybrid, hybrid again, online with the engine in
the train stage, and online from `eagle3pipe serve --hidden-states` in its own process (then
that server unreachable, unshared, restarted with other aux ids and killed mid-run). It runs
in the background with the session (conftest.py's `early`): its stages mostly keep one core
busy while the one-core modules before test_online.py run on the other."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .pipeline import env, fault_hold, repro, set_param, sh, start, wait_for

STORE = ".eagle3pipe/data/store"
RETRIES: list[str] = []  # the output of each server start that failed and was retried
WEIGHTS = "artifacts/train/model.safetensors"


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set(repo: Path, **params) -> None:
    for key, value in params.items():
        set_param(repo, key, value)
    sh(repo, "git", "commit", "-qam", json.dumps(params))


def _record(repo: Path) -> dict:
    return json.loads((repo / "metrics/train_store.json").read_text())


def _train_again(repo: Path, **extra_env) -> subprocess.CompletedProcess:
    """`dvc repro -f -s train` (the train stage alone, whatever DVC knows), its output kept."""
    return subprocess.run(["dvc", "repro", "-f", "-s", "train"], cwd=repo, text=True,
                          capture_output=True, env={**env(repo), **extra_env})


def _from_server(repo: Path) -> dict:
    """Online from `eagle3pipe serve --hidden-states` in its own process (its own engine), the
    trainer in the DVC stage; then the same with a store the server does not write to, and
    with no server."""
    port = _free_port()
    _set(repo, **{"extract.endpoint": f"127.0.0.1:{port}"})
    out = {"ran": repro(repo, "train")}  # the endpoint says where, not what: train is current
    server = _start_server(repo, port)
    try:
        r = _train_again(repo)
        assert r.returncode == 0, r.stderr[-3000:]
        out |= {"weights": (repo / WEIGHTS).read_bytes(), "record": _record(repo),
                "hidden": _bytes(repo / "artifacts/hidden"), "store": _bytes(repo / STORE /
                                                                              "hidden")}
        elsewhere = repo.parent / "not-shared"
        out["not shared"] = _train_again(repo, EAGLE3PIPE_STORE=str(elsewhere))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    out["restarted"] = _restarted_server(repo, port)
    out["killed"] = _killed_server(repo, port)
    out["no server"] = _train_again(repo)
    return out


def _killed_server(repo: Path, port: int) -> dict:
    """The server killed mid-run. One sample a pack (train.batch_tokens 16: 8 packs an epoch,
    more than the producer fetches ahead) and a checkpoint every step: an uninterrupted run
    first, then one held at its first checkpoint (step 1) while the vLLM server gets SIGKILL;
    released, it trains on what the producer fetched ahead, waits EAGLE3PIPE_SERVER_WAIT (3 s)
    for the pack it still needs and fails; with the server restarted, `dvc repro` resumes from
    the newest checkpoint."""
    _set(repo, **{"train.checkpoint_every": 1, "train.batch_tokens": 16})
    held, release = repo.parent / "held", repo.parent / "release"
    log = repo.parent / "killed.log"
    hold = fault_hold(repo / "src", repo / ".eagle3pipe/checkpoints/train/*/step-1", held,
                      release)
    server = _start_server(repo, port)
    try:
        whole = _train_again(repo)
        assert whole.returncode == 0, whole.stderr[-3000:]
        out = {"uninterrupted": (repo / WEIGHTS).read_bytes()}
        proc = start(repo, "dvc", "repro", "-f", "-s", "train", log=log,
                     env_extra={**hold, "EAGLE3PIPE_SERVER_WAIT": "3"})
        wait_for("the trainer held at step 1", held.exists, timeout=600, proc=proc, log=log)
    finally:  # the vLLM server dies; `eagle3pipe serve` then exits by itself
        os.killpg(server.vllm_pid, signal.SIGKILL)
        server.wait(timeout=120)
    release.touch()
    out |= {"code": proc.wait(timeout=600), "log": log.read_text(),
            "published": (repo / "artifacts/train").exists()}
    server = _start_server(repo, port)
    try:
        out["rerun"] = _train_again(repo)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    out["weights"] = (repo / WEIGHTS).read_bytes() if (repo / WEIGHTS).exists() else b""
    return out


def _start_server(repo: Path, port: int, retried: bool = False) -> subprocess.Popen:
    """`eagle3pipe serve --hidden-states` on `port`, once it is ready. A server that exits
    before it is ready is started once more (its output kept in RETRIES, which the test
    module prints): this helper only needs a server, test_serve.py tests starting one, and
    the suite's concurrent engines share the host's ports."""
    server = subprocess.Popen(
        [sys.executable, "-m", "eagle3pipe.tools.cli", "serve", "--hidden-states", "--port",
         str(port), "--quiet", "--timeout", "300"], cwd=repo, env=env(repo),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in server.stdout:
        lines.append(line)
        if "ready at" in line:  # the vLLM server runs in a process group of its own
            server.vllm_pid = int(re.search(r"server pid (\d+)", line)[1])
            return server
    said = f"the hidden-state server exited ({server.wait()}):\n" + "".join(lines[-30:])
    if retried:
        raise AssertionError(said)
    RETRIES.append(said)
    time.sleep(3)
    return _start_server(repo, port, retried=True)


def _restarted_server(repo: Path, port: int) -> subprocess.CompletedProcess:
    """The server restarted mid-run with other aux ids ([0, 2, 3] for [1, 2, 3]): the trainer
    read server.json when the run started, so server.json is put back as it was then, and only
    the entries themselves say what computed them."""
    cap, said = repo / "configs/capture.json", repo / STORE / "incoming/server.json"
    original, at_start = cap.read_text(), said.read_text()
    cap.write_text(json.dumps({**json.loads(original), "aux_layer_ids": [0, 2, 3]}))
    try:
        server = _start_server(repo, port)
        try:
            assert json.loads(said.read_text())["layer_ids"] == [0, 2, 3, 4]
            said.write_text(at_start)
            return _train_again(repo)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
    finally:
        cap.write_text(original)



def run(repo: Path) -> tuple[Path, dict]:
    """`repo`, a committed copy of the cold micro run (trained offline), trained hybrid, hybrid
    again, online with the engine in the stage, online from a server: (repo, what each did, in
    order)."""
    out = {"offline": {"weights": (repo / WEIGHTS).read_bytes(),
                       "hidden": _bytes(repo / "artifacts/hidden"), "store": 0}}
    _set(repo, **{"extract.mode": "hybrid"})
    ran = repro(repo, "train")
    out["hybrid"] = {"ran": ran, "weights": (repo / WEIGHTS).read_bytes(),
                     "hidden": _bytes(repo / "artifacts/hidden"),
                     "store": _bytes(repo / STORE / "hidden"), "record": _record(repo)}
    r = _train_again(repo)
    assert r.returncode == 0, r.stderr[-3000:]
    out["hybrid rerun"] = {"weights": (repo / WEIGHTS).read_bytes(), "record": _record(repo),
                           "log": r.stdout + r.stderr}
    shutil.rmtree(repo / STORE)  # online computes what it uses: nothing to reuse
    _set(repo, **{"extract.mode": "online"})
    ran = repro(repo, "train")
    out["online"] = {"ran": ran, "weights": (repo / WEIGHTS).read_bytes(),
                     "hidden": _bytes(repo / "artifacts/hidden"),
                     "store": _bytes(repo / STORE / "hidden"), "record": _record(repo)}
    out["server"] = _from_server(repo)
    return repo, out
