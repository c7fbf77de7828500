"""vLLM's own parallelism in every stage that runs the verifier, and several training processes,
all through `dvc repro` on the micro pipeline: tensor_parallel_size 2 on this CPU (one core per
rank, VLLM_CPU_OMP_THREADS_BIND "0|1") for dataset, extract and smoke, and train under torchrun
with train.nproc_per_node 2 (gloo; the stage's command becomes torchrun). The repo is a copy of
the session's cold micro run, run in the background (tests/helpers/parallel.py): the parallel
settings rerun every stage that reads them, and the verifier, which reads none, stays the cold
run's."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from helpers.pipeline import repro

pytestmark = pytest.mark.slow

# the stages that read vllm.* or train.* (dvc.yaml); vocab reruns only if the TP-2 dataset's
# bytes differ from the cold run's
PARALLEL_STAGES = {"configs", "dataset", "extract", "train", "export", "smoke"}


@pytest.fixture(scope="module")
def parallel(early):
    """helpers.parallel's run (the session's background job `parallel`): (repo, the stages that
    ran)."""
    run = early.wait("parallel")
    assert run.rc == 0, f"dvc repro in {run.repo} failed ({run.rc}):\n{run.log[-8000:]}"
    return run.repo, run.ran


def test_every_stage_that_reads_them_runs_at_tp2_with_two_training_processes(parallel):
    repo, ran = parallel
    assert PARALLEL_STAGES <= ran and "verifier" not in ran, ran
    extract = json.loads((repo / "metrics/extract.json").read_text())
    assert extract["engine"] == "vllm" and extract["tensor_parallel_size"] == 2
    assert max(extract["oracle"]["max_rel_error"].values()) < 0.01, extract["oracle"]
    dataset = json.loads((repo / "metrics/dataset.json").read_text())
    assert dataset["engine"]["tensor_parallel_size"] == 2
    smoke = json.loads((repo / "metrics/smoke.json").read_text())
    assert smoke["engine"]["tensor_parallel_size"] == 2
    # lossless at TP 2: speculative vs non-speculative output of the same TP-2 verifier
    assert all(smoke["formats"][f]["lossless"] for f in ("vllm", "speculators"))
    assert smoke["ngram"]["lossless"] and smoke["passed"]
    # the stage's command became torchrun, which ran two workers: each records its run
    assert "cmd: python stages/train.py" in (repo / "dvc.lock").read_text()
    assert (repo / ".runlog").read_text().split().count("train") == 1 + 2


def test_two_process_training_gives_the_same_weights_on_rerun(parallel):
    repo, _ = parallel
    weights = repo / "artifacts/train/model.safetensors"
    first = weights.read_bytes()
    assert repro(repo, "-f", "-s", "train") == {"train"}
    assert weights.read_bytes() == first
    assert sorted(load_file(str(weights)))  # a real checkpoint, not an empty file
