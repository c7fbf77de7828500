"""The real micro pipeline through real DVC in temporary git repos: exactly-affected rebuilds,
run-cache restores, determinism across clones, and sharing outputs through a DVC remote. The
cold runs are conftest.py's session fixtures `micro` and `second`, run in the background
(tests/test_serve.py serves micro's exports, tests/test_parallel.py starts from it)."""
from __future__ import annotations

import functools
import json
import queue
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from eagle3pipe.tools import invalidation as graph

from helpers.pipeline import (STAGES, digest, get_param, lock_hashes, out_hashes,
                              repro, set_param, sh, unexplained_skips)

pytestmark = pytest.mark.slow

# representative keys, one per kind of row of eagle3pipe.tools.invalidation's table (which the README
# prints), and the value each is changed to; here real DVC must agree with the row. Keys with
# the same row as one listed (draft.num_key_value_heads, draft.intermediate_size, ...: head_dim's)
# take the same path through dvc.yaml; test_graph checks the table itself. The verifier's row
# (every stage) is the cold run's: test_cold_run_executes_every_stage_and_then_nothing.
# CHANGES run their whole row and its revert: between them every stage after the verifier
# reruns, is skipped only where its inputs came out byte-identical, and is restored from the
# run-cache. FIRST_STAGES' rows take the same path from their first stages on, so for them real
# DVC is asked only what is particular to the key: the stages that see the change, directly
# or through the files the configs stage rewrites (test_a_change_reaches_the_rows_first_stages).
CHANGES = [  # the longest rows first (the `changes` fixture runs them in this order)
    ("dataset.max_new_tokens", 20),  # every stage from dataset on
    ("draft.head_dim", 32),
    ("draft.num_speculative_tokens", 2),  # configs, export, smoke: training is untouched
    ("smoke.max_tokens", 12),
]
FIRST_STAGES = [
    ("draft.aux_layer_ids", [0, 2, 3]),  # configs/capture.json: extract
    ("draft.draft_vocab_size", 96),  # the vocab stage's own key, and the draft's configs
    ("train.learning_rate", 0.002),
    ("extract.dtype", "float32"),
]
ENGINE_BOUND = "vllm.gpu_memory_utilization"  # engine_bound_changes_no_output's job
REMOTE = "remote"  # remote_shares_outputs_and_run_cache's job


def first(key: str) -> str:
    """The job name of a FIRST_STAGES key."""
    return f"first:{key}"


def test_cold_run_executes_every_stage_and_then_nothing(micro):
    repo, ran = micro
    assert ran == set(STAGES)
    assert repro(repo) == set()
    metrics = json.loads((repo / "metrics/smoke.json").read_text())
    assert metrics  # the smoke stage's metrics exist (their content is tested in test_smoke)
    r = sh(repo, "eagle3pipe", "check", "--checkpoint", "artifacts/export/vllm",
           "--checkpoint", "artifacts/export/speculators")
    assert "check: OK" in r.stdout


# read only on another branch of the micro config: a JSONL source's bad-line policy, the hash mode
# of an external verifier checkpoint, multi-GPU-only settings, a smoke prompts file's format
# read only in some settings; extract.endpoint is declared by extract's section and read by the
# train stage's engine in online/hybrid modes (a run-only setting, config.view.RunSettings)
CONDITIONAL = {"dataset.on_bad_input", "verifier.hash_mode", "train.rdzv_endpoint",
               "extract.endpoint", "smoke.prompts_format"}


def test_no_stage_declares_a_key_it_never_reads(micro):
    """Every leaf key a stage declares in dvc.yaml was read by that stage in the cold run (the
    per-stage params view records every read), so no declared key reruns a stage for nothing."""
    from eagle3pipe.config import params as P
    from eagle3pipe.config.dvcfile import declared_params

    repo, _ = micro
    reads: dict[str, set[str]] = {}
    for line in (repo / ".params_reads").read_text().splitlines():
        rec = json.loads(line)
        reads.setdefault(rec["stage"], set()).update(rec["keys"])
    leaves = P.leaf_keys()
    for stage in STAGES:
        for d in declared_params(stage, repo / "dvc.yaml"):
            for leaf in (k for k in leaves if k == d or k.startswith(d + ".")):
                if leaf in CONDITIONAL or leaf == "draft.hidden_size":
                    continue  # draft.hidden_size: optional, read only to refuse a mismatch
                assert leaf in reads.get(stage, set()), \
                    f"stage {stage} declares {leaf} (via {d}) but never read it"


def change_and_revert(repo, key: str, value) -> None:
    """A -> B reruns exactly the table's row; B -> A executes nothing that matters (DVC's
    run-cache restores it) and gives back byte-identical outputs; the repo is left as
    committed."""
    expected = set(graph.invalidation_table(repo / "dvc.yaml", repo / "params.yaml",
                                            repo / "configs/verifier_config.json")[key])
    outputs = ("configs", "metrics", "plots", "artifacts/train", "artifacts/export",
               "artifacts/hidden", "artifacts/vocab", "artifacts/dataset")
    before = {p: digest(repo / p) for p in outputs}
    hashes = out_hashes(repo)
    old = get_param(repo, key)
    set_param(repo, key, value)
    try:
        ran = repro(repo)
        # exactly the row, except stages whose inputs all came out byte-identical
        assert ran <= expected, f"{key}: ran {sorted(ran)}, table says {sorted(expected)}"
        assert min(expected, key=list(STAGES).index) in ran, f"{key}: ran {sorted(ran)}"
        assert unexplained_skips(repo, expected, ran, hashes) == [], key
    finally:
        set_param(repo, key, old)
        restored = repro(repo)
        sh(repo, "git", "checkout", "--", ".")
    # Only `configs` may execute again on the way back: its outputs are committed to git
    # (cache: false) and DVC keeps no run-cache entry for a stage with uncached outputs other
    # than metrics/plots; it takes seconds and writes the same bytes. Training never reruns.
    assert restored <= {"configs"}, f"revert of {key} re-executed {sorted(restored)}"
    assert {p: digest(repo / p) for p in outputs} == before, f"revert of {key} changed outputs"


def engine_bound_changes_no_output(repo) -> None:
    """vllm.gpu_memory_utilization is in the table's engine row (every stage that starts vLLM
    declares the vllm: section, and configs renders the serving recipe from it), but it cannot
    change a number: the three engine stages rerun and write the same bytes, configs rewrites
    configs/serve/ only, which no stage reads, so nothing behind them runs; the repo is left
    as committed."""
    before, old = out_hashes(repo), get_param(repo, "vllm.gpu_memory_utilization")
    set_param(repo, "vllm.gpu_memory_utilization", old / 2)
    try:
        assert repro(repo) == {"configs", "dataset", "extract", "smoke"}
        assert {p for p, h in out_hashes(repo).items() if before.get(p) != h} <= {
            "configs/serve/vllm.json", "configs/serve/speculators.json",
            "configs/serve/sglang.json"}
    finally:
        set_param(repo, "vllm.gpu_memory_utilization", old)
        repro(repo)
        sh(repo, "git", "checkout", "--", ".")


def first_stages_see_the_change(repo, key: str, value) -> None:
    """After the change (and the configs stage, where the row starts with it) `dvc status`
    reports exactly the row's stages that declare the key or read a file under configs/ that
    changed, and configs/ changed exactly where the table predicts; the repo is left as
    committed."""
    from eagle3pipe.config import dvcfile, params as P

    verifier_config = repo / "configs/verifier_config.json"
    row = graph.invalidation_table(repo / "dvc.yaml", repo / "params.yaml", verifier_config)[key]
    predicted = (graph.changed_configs(P.load(repo / "params.yaml"), key, verifier_config)
                 if "configs" in row else set())
    stages = dvcfile.stages(repo / "dvc.yaml")
    set_param(repo, key, value)
    try:
        if "configs" in row:
            assert repro(repo, "-s", "configs") == {"configs"}
        changed = set(sh(repo, "git", "diff", "--name-only", "--", "configs").stdout.split())
        seen = set(json.loads(sh(repo, "dvc", "status", "--json").stdout))
    finally:
        sh(repo, "git", "reset", "-q", "--hard")
    assert json.loads(sh(repo, "dvc", "status", "--json").stdout) == {}
    assert changed == predicted, key

    def reads_it(stage: str) -> bool:
        deps = [d if isinstance(d, str) else next(iter(d)) for d in stages[stage].get("deps", [])]
        return (any(key == d or key.startswith(d + ".")
                    for d in dvcfile.declared_params(stage, repo / "dvc.yaml"))
                or any(f == d or f.startswith(d + "/") for f in changed for d in deps))

    assert seen == {s for s in row if s != "configs" and reads_it(s)}, (key, seen, row)
    assert seen, key


def remote_shares_outputs_and_run_cache(repo, tmp) -> None:
    """A DVC remote added to the repo (and committed) gets its outputs and run-cache; a clone
    that pulls them executes nothing, and after a draft change there and the configs stage,
    DVC finds training changed, not the data stages (the pulled outputs serve them; the
    head_dim row itself runs in change_and_revert)."""
    remote = tmp / "remote"
    sh(repo, "dvc", "remote", "add", "-f", "-d", "shared", str(remote))
    sh(repo, "dvc", "push", "--run-cache", "-q")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-q", "-m", "remote")
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    sh(clone, "dvc", "pull", "--run-cache", "-q")
    assert repro(clone) == set(), "after a pull nothing may execute"
    set_param(clone, "draft.head_dim", 32)
    assert repro(clone, "-s", "configs") == {"configs"}
    changed = set(json.loads(sh(clone, "dvc", "status", "--json").stdout))
    assert "train" in changed, changed
    assert not changed & {"verifier", "dataset", "vocab", "extract"}, changed


@pytest.fixture(scope="module")
def changes(micro, second, tmp_path_factory) -> dict[str, BaseException | None]:
    """The jobs that change a cold repo and leave it as committed, two at a time, each on
    whichever of the two cold repos is free (both hold the same bytes and their own
    run-cache; most of a micro stage is its interpreter's imports, on one core), the longest
    first so that the short ones fill the end: every change of CHANGES through
    change_and_revert, engine_bound_changes_no_output, remote_shares_outputs_and_run_cache
    (which leaves its remote committed) and FIRST_STAGES through first_stages_see_the_change.
    What each raised, by job name (a CHANGES key, ENGINE_BOUND, REMOTE, first(key))."""
    free: queue.Queue = queue.Queue()
    free.put(micro[0])
    free.put(second[0])
    tmp = tmp_path_factory.mktemp("remote")
    rows = {k: functools.partial(change_and_revert, key=k, value=v) for k, v in CHANGES}
    jobs = {**dict(list(rows.items())[:2]), ENGINE_BOUND: engine_bound_changes_no_output,
            REMOTE: functools.partial(remote_shares_outputs_and_run_cache, tmp=tmp),
            **dict(list(rows.items())[2:]),
            **{first(k): functools.partial(first_stages_see_the_change, key=k, value=v)
               for k, v in FIRST_STAGES}}

    def one(job) -> BaseException | None:
        repo = free.get()
        try:
            job(repo)
            return None
        except BaseException as e:  # re-raised by the job's own test
            return e
        finally:
            free.put(repo)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(one, jobs.values())))


@pytest.mark.parametrize("key,value", CHANGES, ids=[k for k, _ in CHANGES])
def test_change_reruns_exactly_the_table_row_and_revert_restores(changes, key, value):
    """change_and_revert on a cold repo (the changes run two at a time: the `changes`
    fixture)."""
    if changes[key] is not None:
        raise changes[key]


def test_an_engine_memory_bound_reruns_the_engines_and_changes_no_output(changes):
    """engine_bound_changes_no_output on a cold repo (run by the `changes` fixture)."""
    if changes[ENGINE_BOUND] is not None:
        raise changes[ENGINE_BOUND]


@pytest.mark.parametrize("key", [k for k, _ in FIRST_STAGES])
def test_a_change_reaches_the_rows_first_stages(changes, key):
    """first_stages_see_the_change on a cold repo (run by the `changes` fixture)."""
    if changes[first(key)] is not None:
        raise changes[first(key)]


def test_two_cold_clones_give_identical_lock_hashes(micro, second):
    repo, (other, ran) = micro[0], second
    assert ran == set(STAGES)
    a, b = lock_hashes(repo), lock_hashes(other)
    assert a.keys() == b.keys()
    assert {k for k in a if a[k] != b[k]} == set()


def test_remote_shares_outputs_and_run_cache(changes):
    """remote_shares_outputs_and_run_cache on a cold repo (run by the `changes` fixture)."""
    if changes[REMOTE] is not None:
        raise changes[REMOTE]


def test_speculators_train_reads_the_outputs_as_is(micro, tmp_path):
    """speculators' own trainer (`python -m speculators.train`) on the pipeline's outputs: its
    ArrowDataset over artifacts/hidden/train, its loader of artifacts/vocab/{d2t,t2d}.npy, the
    draft from the speculators config's transformer_layer_config and the capture's aux ids.
    On CPU it gets as far as its Trainer moving the model to the accelerator; on CUDA it trains."""
    import sys

    import torch

    repo, _ = micro
    spec = json.loads((repo / "configs/speculators/config.json").read_text())
    (tmp_path / "layer.json").write_text(json.dumps(spec["transformer_layer_config"]))
    aux = json.loads((repo / "configs/capture.json").read_text())["aux_layer_ids"]
    vocab = get_param(repo, "draft.draft_vocab_size")
    r = subprocess.run(
        [sys.executable, "-m", "speculators.train", "--speculator-type", "eagle3",
         "--verifier-name-or-path", "artifacts/verifier", "--draft-config",
         str(tmp_path / "layer.json"), "--draft-vocab-size", str(vocab),
         "--d2t-path", "artifacts/vocab/d2t.npy", "--t2d-path", "artifacts/vocab/t2d.npy",
         "--data-path", "artifacts/hidden/train", "--hidden-states-path",
         "artifacts/hidden/train/hidden_states", "--on-missing", "raise", "--epochs", "1",
         "--draft-attn-impl", "sdpa", "--save-path", str(tmp_path / "out"),
         "--total-seq-len", "256", "--hidden-states-dtype", "bfloat16",
         "--target-layer-ids", *map(str, aux)],
        cwd=repo, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    if torch.cuda.is_available():
        assert r.returncode == 0, out[-4000:]
    else:
        assert "Loading vocab mappings" in out and "trainer.py" in out, out[-4000:]
        assert "Cannot access accelerator device when none is available" in out, out[-4000:]
