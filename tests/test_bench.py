"""bench/ stays runnable and its record stays comparable. These are not timed: they run the
benchmark's code paths once at a tiny size (so an API change in src/ cannot silently break
`make bench`) and check the committed bench/results.json carries the fields the issue asks for."""
import json
import math
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import compute  # noqa: E402
import run as bench_run  # noqa: E402

from eagle3pipe import params  # noqa: E402


def test_committed_results_carry_the_comparable_fields():
    res = json.loads((ROOT / "bench/results.json").read_text())
    for key in bench_run.HEADLINES:
        v = res[key]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (key, v)
    assert res["bytes_per_token_vs_min"] >= 1.0
    assert isinstance(res["cpu_count"], int) and res["cpu_count"] >= 1
    datetime.fromisoformat(res["date"])
    assert res["command"].startswith("python bench/run.py")


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
