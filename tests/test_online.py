"""Hidden states on demand (extract.mode online and hybrid, eagle3pipe.hidden.online), through
`dvc repro` on a copy of the session's cold micro run (offline, conftest.py's `micro`; its DVC
cache included, its per-sample store not): the trained draft is byte-identical in every mode,
with the engine inside the train stage and with the verifier as a separate server process on
localhost (`eagle3pipe serve --hidden-states`); online keeps no hidden state, hybrid keeps them
and a rerun computes none; a server that does not answer, one that writes where the trainer
cannot read, or one restarted with another capture mid-run, is one clear error. Disk used and
engine wait per mode are printed (pytest -s)."""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def modes(early):
    """helpers.online.run on a copy of the cold micro run, run in the background with the
    session: (repo, what each mode did)."""
    from helpers.online import RETRIES

    done = early.wait("online")
    assert done.rc == 0, f"the on-demand runs in {done.repo} failed:\n{done.log[-8000:]}"
    for said in RETRIES:
        print(f"a server start failed and was retried: {said}")
    for name, m in done.value[1].items():
        if "hidden" in m:
            print(f"{name}: artifacts/hidden {m['hidden']:,} B, store {m['store']:,} B"
                  + (f", engine wait {m['record']['engine_wait_seconds']} s" if "record" in m
                     else ""))
    return done.value


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
