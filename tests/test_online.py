"""Hidden states on demand (extract.mode online and hybrid, eagle3pipe.hidden.online), through
`dvc repro` on a copy of the session's cold micro run (offline, conftest.py's `micro`; its DVC
cache included, its per-sample store not): the trained draft is byte-identical in every mode,
with the engine inside the train stage and with the verifier as a separate server process on
localhost (`eagle3pipe serve --hidden-states`); online keeps no hidden state, hybrid keeps them
and a rerun computes none; a server that does not answer, one that writes where the trainer
cannot read, or one restarted with another capture mid-run, is one clear error. Disk used and
engine wait per mode are printed (pytest -s)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.pipeline import env, fault_hold, repro, set_param, sh, start, wait_for

pytestmark = pytest.mark.slow

STORE = ".eagle3pipe/data/store"
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


@pytest.fixture(scope="module")
def modes(micro, tmp_path_factory):
    """The micro pipeline trained offline (micro), then hybrid, hybrid again, online with the
    engine in the stage, online from a server: what each did, in order."""
    repo = tmp_path_factory.mktemp("online") / "repo"
    shutil.copytree(micro[0], repo, symlinks=True, ignore=shutil.ignore_patterns(".eagle3pipe"))
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
    for name, m in out.items():
        if "hidden" in m:
            print(f"{name}: artifacts/hidden {m['hidden']:,} B, store {m['store']:,} B"
                  + (f", engine wait {m['record']['engine_wait_seconds']} s" if "record" in m
                     else ""))
    return repo, out


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


def _start_server(repo: Path, port: int) -> subprocess.Popen:
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
    raise AssertionError(f"the hidden-state server exited ({server.wait()}):\n"
                         + "".join(lines[-30:]))


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


def test_the_trained_draft_is_byte_identical_in_every_mode(modes):
    _, out = modes
    for name in ("hybrid", "hybrid rerun", "online", "server"):
        assert out[name]["weights"] == out["offline"]["weights"], name


def test_a_mode_change_reruns_extract_and_train_and_the_endpoint_reruns_nothing(modes):
    _, out = modes
    assert out["hybrid"]["ran"] == {"extract", "train"}
    assert out["online"]["ran"] == {"extract", "train"}
    # extract reruns (it reads the extract section) and publishes the same manifest
    assert out["server"]["ran"] == {"extract"}


def test_online_keeps_no_hidden_states_and_hybrid_keeps_them_for_reruns(modes):
    _, out = modes
    offline, online, hybrid = out["offline"], out["online"], out["hybrid"]
    # offline publishes every token's states; on demand only the rows and the manifest
    assert online["hidden"] * 5 < offline["hidden"], (online["hidden"], offline["hidden"])
    assert hybrid["hidden"] == online["hidden"]
    assert online["store"] == 0 and online["record"]["deleted"] == online["record"]["computed"]
    assert online["record"]["computed"] == 16 and online["record"]["kept_in_store"] == 0
    # hybrid keeps what it computed (the extract stage's oracle samples too: 16 in all)
    assert hybrid["record"]["kept_in_store"] == hybrid["record"]["computed"] > 0
    assert hybrid["store"] >= offline["hidden"] * 0.9
    rerun = out["hybrid rerun"]
    assert rerun["record"]["computed"] == 0 and "every sample was in the store" in rerun["log"]
    assert "Starting to load model" not in rerun["log"]  # nothing missing: no engine started


def test_the_trainer_records_how_long_it_waited_for_the_engine(modes):
    _, out = modes
    for name in ("hybrid", "online", "server"):
        wait = out[name]["record"]["engine_wait_seconds"]
        assert isinstance(wait, float) and wait >= 0.0, (name, wait)
    assert out["server"]["record"]["computed"] == 16 and out["server"]["store"] == 0


def test_the_on_demand_engine_passes_the_oracle_before_any_training_step(modes):
    """In hybrid, online and from a server, the producer's engine went through the extract
    stage's oracle on the first pack, every slot at every position; a hybrid rerun starts no
    engine and checks none."""
    _, out = modes
    for name in ("hybrid", "online", "server"):
        o = out[name]["record"]["oracle"]
        assert o["samples"] >= 1 and o["positions_after_common_prefix"] > 0, (name, o)
        assert max(o["max_rel_error"].values()) <= o["tolerance"], (name, o)
    assert "oracle" not in out["hybrid rerun"]["record"]


def test_a_server_the_trainer_cannot_reach_or_read_is_a_clear_error(modes):
    repo, out = modes
    for case, words in (("not shared", "shared by the server and every training node"),
                        ("no server", "no vLLM server answers")):
        r = out["server"][case]
        assert r.returncode != 0, case
        err = r.stdout + r.stderr
        assert words in err and "fix: " in err, err[-3000:]
        assert "Traceback" not in err.split("train: error:")[0][-2000:], err[-3000:]
    # DVC removed the old output before the stage ran; the stage published nothing, partial
    # or whole (`dvc checkout` restores the old one from the cache)
    assert not (repo / "artifacts/train").exists()
    assert not list((repo / "artifacts").glob(".train*")), list((repo / "artifacts").iterdir())


def test_a_server_restarted_with_other_aux_ids_is_refused_at_its_first_entry(modes):
    """Every entry a server writes carries its capture identity; the trainer checks each one."""
    repo, out = modes
    r = out["server"]["restarted"]
    err = r.stdout + r.stderr
    assert r.returncode != 0, err[-3000:]
    assert "layer_ids: got [0, 2, 3, 4], the manifest needs [1, 2, 3, 4]" in err, err[-3000:]
    assert "fix: restart the server from this params.yaml" in err, err[-3000:]
    assert "Traceback" not in err.split("train: error:")[0][-2000:], err[-3000:]


def test_a_server_killed_mid_run_fails_after_the_wait_and_the_rerun_resumes(modes):
    _, out = modes
    k = out["server"]["killed"]
    assert k["code"] != 0, k["log"][-3000:]
    assert "unreachable for 3 s ($EAGLE3PIPE_SERVER_WAIT) after it had answered" in k["log"]
    assert "fix: check the server's log; restart it" in k["log"], k["log"][-3000:]
    assert "Traceback" not in k["log"].split("train: error:")[0][-2000:], k["log"][-3000:]
    assert not k["published"]  # nothing published, partial or whole
    rerun = k["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = re.search(r"train: resuming from \S+: step (\d+) of (\d+)",
                        rerun.stdout + rerun.stderr)
    assert resumed and 1 <= int(resumed[1]) < int(resumed[2]), (rerun.stdout + rerun.stderr)[-3000:]
    assert k["weights"] == k["uninterrupted"]  # as if nothing had happened
