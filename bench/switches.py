"""The draft-switch ablation on the embedded default (docs/experiments.md, "EAGLE-3.1's norms and
the Qwen3 layer"): each variant is `dvc exp run --temp` of the committed pipeline with the
switches set, so only configs, train, export and smoke rerun (the verifier, dataset and hidden
states come from DVC's cache). The smoke stage's timing is cut to one round and no k sweep
(which changes no acceptance figure); its pass/fail thresholds are opened so a weaker variant
still reports its figures. Prints one Markdown row per variant and seed, from each
experiment's metrics/smoke.json and metrics/smoke_timing.json.

    python bench/switches.py [--seeds 0 1 2] [--variants eagle3 nbf+out ...]
"""
from __future__ import annotations

import argparse
import json
import subprocess

VARIANTS = {
    "eagle3": {},
    "nbf+out": {"draft.norm_before_fc": "true", "draft.norm_output": "true"},
    "fcn+out": {"draft.fc_norm": "true", "draft.norm_output": "true"},
    "qwen3": {"draft.draft_arch": "qwen3"},
    "qwen3+nbf+out": {"draft.draft_arch": "qwen3", "draft.norm_before_fc": "true",
                      "draft.norm_output": "true"},
    "qwen3+fcn+out": {"draft.draft_arch": "qwen3", "draft.fc_norm": "true",
                      "draft.norm_output": "true"},
}
# one timed round, no k sweep, thresholds open: acceptance figures are unchanged by these
QUICK_SMOKE = {"smoke.timing_rounds": "1", "smoke.k_sweep": "[]",
               "smoke.min_acceptance_length": "1.0", "smoke.min_gain_over_ngram": "0.0",
               "smoke.max_train_serve_gap": "1.0"}


def run(name: str, seed: int) -> None:
    sets = {**VARIANTS[name], **QUICK_SMOKE, "train.seed": str(seed)}
    cmd = ["dvc", "exp", "run", "--temp", "-n", f"{name}-s{seed}"]
    for k, v in sets.items():
        cmd += ["-S", f"{k}={v}"]
    subprocess.run(cmd, check=True)


def rows() -> list[str]:
    """One Markdown row per experiment of `dvc exp show --json --all-commits` (the seeds may
    have run on several commits of the same outputs), from the metrics files of its git commit
    (exp show flattens away the per-position lists)."""
    shown = json.loads(subprocess.run(["dvc", "exp", "show", "--json", "--all-commits"],
                                      check=True, capture_output=True, text=True).stdout)
    out = []
    for commit in shown:
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                if rev.get("rev") and rev.get("name"):
                    smoke, timing = (_at(rev["rev"], f) for f in
                                     ("metrics/smoke.json", "metrics/smoke_timing.json"))
                    if smoke:
                        out.append(row(rev["name"], smoke, timing))
    return sorted(out)


def _at(rev: str, path: str) -> dict:
    got = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return json.loads(got.stdout) if got.returncode == 0 else {}


def row(name: str, smoke: dict, timing: dict) -> str:
    f = smoke["formats"]
    pos = ", ".join(f"{p:.3f}" for p in f["vllm"]["acceptance_rate_per_position"])
    agree = smoke.get("train_serve_agreement") or {}
    served = (agree.get("serving") or {}).get("tokens_per_step", float("nan"))
    trained = (agree.get("training") or {}).get("tokens_per_step", float("nan"))
    fast = (timing.get("speedup") or {}).get("vllm", float("nan"))
    one = ((timing.get("batch_1") or {}).get("speedup") or {}).get("vllm", float("nan"))
    return (f"| {name} | {f['vllm']['mean_acceptance_length']:.3f} | "
            f"{f['speculators']['mean_acceptance_length']:.3f} | {pos} | {served:.3f} / "
            f"{trained:.3f} | {fast:.2f}x | {one:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--show", action="store_true", help="only print the rows of finished runs")
    a = ap.parse_args()
    if not a.show:
        for seed in a.seeds:
            for name in a.variants:
                run(name, seed)
    print("| variant | vllm export | speculators export | per position (vllm) | eval split "
          "served / trained | speedup, batch 16 | speedup, batch 1 |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows()))


if __name__ == "__main__":
    main()
