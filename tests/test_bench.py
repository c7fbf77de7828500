"""bench/ stays runnable and its record stays comparable. These are not timed: they run the
benchmark's code paths once at a tiny size (so an API change in src/ cannot silently break
`make bench`) and check the committed bench/results.json carries the fields the issue asks for."""
import json
import math
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import compute  # noqa: E402
import run as bench_run  # noqa: E402

from eagle3pipe.config import params  # noqa: E402


def test_committed_results_carry_the_comparable_fields():
    res = json.loads((ROOT / "bench/results.json").read_text())
    for key in bench_run.HEADLINES:
        v = res[key]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (key, v)
    assert res["bytes_per_token_vs_min"] >= 1.0
    assert isinstance(res["cpu_count"], int) and res["cpu_count"] >= 1
    datetime.fromisoformat(res["date"])
    assert res["command"].startswith("python bench/run.py")


@pytest.mark.integration
def test_scaling_point_runs_extract_and_train_paths(tmp_path):
    """One (hidden 32, 64 tokens) point of the scaling grid: random verifier, extract_split vs
    bare forward, a real speculators datapath, the train loop vs speculators' step, TSV + PNG."""
    draft = params.load(ROOT / "tests/micro/params.yaml").draft
    rows = compute.bench_scaling(tmp_path, draft, hiddens=(32,), seq_lens=(64,), vocab=256,
                                 tokens=512, batch_tokens=256, n_packs=1, repeats=1)
    assert len(rows) == 1
    row = rows[0]
    assert (row["hidden_size"], row["seq_len"]) == (32, 64)
    for key in ("extract_tokens_per_s", "forward_tokens_per_s", "extract_vs_forward",
                "train_tokens_per_s", "speculators_step_tokens_per_s",
                "train_vs_speculators_step"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    # hidden states of 3 aux layers + the last, bf16: at least (3 + 1) * 32 * 2 bytes/token
    assert row["bytes_per_token_vs_min"] >= 1.0
    tsv = compute.scaling_tsv(rows)
    header, line = tsv.splitlines()[:2]
    assert header.split("\t")[0] == "hidden_size" and line.split("\t")[0] == "32"
    if compute.scaling_png(rows, tmp_path / "scaling.png"):
        assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speedup_model_is_the_standard_formula():
    """speedup(k) = tau(k) t_v(1) / (t_fc + k t_d + t_v(k + 1)), tau(k) = 1 + the acceptance
    of positions 1..k; ngram's proposer costs nothing. Numbers given, not measured."""
    import speedup

    row = {"t_verify": {"1": 1.0, "2": 1.0, "3": 1.5}, "t_draft": 0.1, "t_fc": 0.0,
           "hidden": 8, "layers": 1, "verifier_params": 10}
    m = speedup.model(row, {"draft": [0.8, 0.6], "ngram": [0.5, 0.3]})
    assert m["draft"] == {"1": speedup.rnd(1.8 / 1.1), "2": speedup.rnd(2.4 / 1.7)}  # 4 digits
    assert m["ngram"] == {"1": 1.5, "2": 1.2}
    assert m["draft_best"] == {"k": 1, "speedup": m["draft"]["1"]}
    assert m["ngram_best"] == {"k": 1, "speedup": 1.5} and m["c"] == 0.1
    rows = [dict(row, verifier_params=10, model={"draft_best": {"speedup": 0.9},
                                                 "ngram_best": {"speedup": 1.2}}),
            dict(row, verifier_params=20, layers=2,
                 model={"draft_best": {"speedup": 1.1}, "ngram_best": {"speedup": 1.3}}),
            dict(row, verifier_params=30, layers=3,
                 model={"draft_best": {"speedup": 1.4}, "ngram_best": {"speedup": 1.3}})]
    c = speedup.crossover(rows[::-1])
    assert c["beats_no_speculation"]["layers"] == 2
    assert c["beats_ngram"]["layers"] == 3 and c["beats_both"]["layers"] == 3
    assert speedup.acceptance({"k_sweep": {"1": {"vllm": {"acceptance_rate_per_position": [0.9]},
                                                 "ngram": {"acceptance_rate_per_position": [0.5]}},
                                           "5": {"vllm": {"acceptance_rate_per_position": [1] * 5},
                                                 "ngram": {"acceptance_rate_per_position": [0] * 5}}
                                           }})[0] == {"draft": [1] * 5, "ngram": [0] * 5}
    # the measured speedups sit beside the model's rows of the measured size and batch only
    r1 = dict(row, batch=1, model=m)
    measured = {"batches": {"1": {"draft": 1.2, "ngram": 1.0}, "16": {"draft": 2, "ngram": 1}},
                "k": 2, "hidden": 8, "layers": 1}
    got = speedup.modelled_vs_measured([r1, dict(r1, layers=2)], measured)
    assert len(got) == 1 and got[0]["batch"] == 1 and got[0]["k"] == 2
    assert got[0]["draft"] == {"modelled": m["draft"]["2"], "measured": 1.2,
                               "measured_over_modelled": speedup.rnd(1.2 / m["draft"]["2"])}
    assert got[0]["ngram"]["measured_over_modelled"] == speedup.rnd(1.0 / 1.2)
    assert speedup.modelled_vs_measured([r1], None) == []


def test_speedup_point_times_real_forwards(tmp_path):
    """One tiny verifier size through the benchmark's code: a random Llama built from its
    config, the EAGLE-3 draft layer, per-forward times, the model, TSV and PNG."""
    import speedup

    draft = params.load(ROOT / "tests/micro/params.yaml").draft
    smoke = json.loads((ROOT / "metrics/smoke.json").read_text())
    res = speedup.run(((32, 1),), smoke=smoke, draft_params=draft, vocab=256, batches=[1, 2],
                      context=8, repeats=1, inner=1)
    assert [r["batch"] for r in res["rows"]] == [1, 2] and sorted(res["crossover"]) == ["1", "2"]
    row = res["rows"][1]
    ks = [int(k) for k in row["model"]["draft"]]
    assert ks == list(range(1, len(res["acceptance"]["draft"]) + 1))
    assert sorted(map(int, row["t_verify"])) == [1, *(k + 1 for k in ks)]
    for t in [*row["t_verify"].values(), row["t_draft"], row["t_fc"]]:
        assert math.isfinite(t) and t > 0
    assert row["verifier_params"] > row["draft_params"] > 0
    speedup.write(res, tmp_path)
    header, line = (tmp_path / "speedup.tsv").read_text().splitlines()
    assert header.startswith("verifier_params_m\thidden\tlayers\tdraft_speedup_b1\t")
    assert line.split("\t")[1:3] == ["32", "1"] and len(line.split("\t")) == 3 + 2 * 5
    assert json.loads((tmp_path / "speedup.json").read_text())["rows"][0]["layers"] == 1
    if (tmp_path / "speedup.png").exists():
        assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_the_gpu_check_runs_here_up_to_the_device(micro_verifier, tmp_path):
    """bench/gpu_check.py on CPU at the micro size: the train stage's loop trains (the loss
    falls, the acceptance rises); speculators' Trainer needs an accelerator, which is the one
    thing the GPU machine adds, and says so."""
    import gpu_check
    from helpers.training import make_inputs

    inp = make_inputs(micro_verifier, tmp_path / "inputs", n_train=8, n_eval=4)
    p = gpu_check._params("cpu")
    got = gpu_check.ours(p, inp, steps=3)
    assert got["loss_impl"] == "eager" and got["attention"] == "sdpa"
    assert len(got["losses"]) == 4 and got["losses"][-1] < got["losses"][0], got
    assert got["eval_after"]["loss"] < got["eval_before"]["loss"], got
    assert got["tokens"] > 0 and got["tokens_per_s"] > 0
    with pytest.raises(RuntimeError, match="accelerator"):
        gpu_check.speculators_trainer(p, inp, 3, tmp_path)
