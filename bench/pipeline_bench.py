"""Pipeline benchmarks through real DVC in temporary git repos (the test suite's harness,
tests/helpers/pipeline.py): cold repro per stage, no-op repro vs status, and a params-change
rebuild per stage."""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
from pathlib import Path

from common import interleave, log, rnd, timing_summary
from tests.helpers import pipeline  # common puts the repository root on sys.path

EVENT = re.compile(r"^(?:Running stage '(?P<run>[^']+)':"
                   r"|Stage '(?P<skip>[^']+)' didn't change, skipping"
                   r"|Stage '(?P<cached>[^']+)' is cached - skipping run)")
LOCK = re.compile(r"^Updating lock file ")


def _env(repo: Path) -> dict:
    e = pipeline.env(repo)
    e["PYTHONUNBUFFERED"] = "1"  # DVC's log lines arrive as they are written: we stamp them
    e["PYTHONWARNINGS"] = "ignore::DeprecationWarning,ignore::FutureWarning"  # as the Makefile
    return e


def timed(repo: Path, *cmd: str) -> tuple[float, list[tuple[float, str]]]:
    """Runs cmd in repo; returns (wall seconds, [(seconds since start, output line)]), stdout
    and stderr merged in order. Raises with the output's tail when it fails."""
    t0 = time.perf_counter()
    p = subprocess.Popen(list(cmd), cwd=repo, env=_env(repo), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
    lines = []
    assert p.stdout is not None
    for line in p.stdout:  # universal newlines: tqdm's \r updates become lines too
        lines.append((time.perf_counter() - t0, line.rstrip("\n")))
    rc = p.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = "\n".join(l for _, l in lines[-60:])
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}) in {repo}:\n{tail}")
    return wall, lines


def stage_breakdown(lines: list[tuple[float, str]], wall: float, stages) -> dict:
    """Per stage, from DVC's own log lines stamped as they arrived: a stage that ran costs the
    time from its "Running stage 'X':" line to DVC's next line of its own ("Updating lock
    file", or the next stage's line): its command plus DVC saving its outputs to the cache.
    A stage that did not run costs 0 s. Everything else (DVC start-up, every stage's change
    check, lock-file writes) is `dvc_overhead_s` = wall - sum of the stages."""
    events = []  # (t, kind, stage) for stage lines, (t, "lock", None) for lock lines
    for t, line in lines:
        m = EVENT.match(line)
        if m:
            kind = next(k for k in ("run", "skip", "cached") if m.group(k))
            events.append((t, kind, m.group(kind)))
        elif LOCK.match(line):
            events.append((t, "lock", None))
    per: dict[str, dict] = {s: {"status": "not_seen", "seconds": 0.0} for s in stages}
    for i, (t, kind, stage) in enumerate(events):
        if stage is None:
            continue
        entry = per.setdefault(stage, {})
        entry["status"] = {"run": "ran", "skip": "unchanged", "cached": "run_cache"}[kind]
        end = wall
        if kind == "run":
            end = next((t2 for t2, _, _ in events[i + 1:]), wall)
        entry["seconds"] = rnd(end - t if kind == "run" else 0.0)
    total = sum(v["seconds"] for v in per.values())
    return {"stages": per, "stage_seconds_total": rnd(total),
            "dvc_overhead_s": rnd(wall - total), "wall_s": rnd(wall)}


def timed_repro(repo: Path, *args: str) -> dict:
    """One `dvc repro` (the real command), broken down by stage; `ran` lists the stages whose
    commands really executed (EAGLE3PIPE_RUN_LOG, written by eagle3pipe.stages.runner)."""
    runlog = repo / ".runlog"
    runlog.unlink(missing_ok=True)
    wall, lines = timed(repo, "dvc", "repro", *args)
    ran = sorted(set(runlog.read_text().split())) if runlog.exists() else []
    res = stage_breakdown(lines, wall, pipeline.STAGES)
    res["ran"] = [s for s, v in res["stages"].items() if v["status"] == "ran"]
    # cross-check with the run log: every stage that reads params logs itself when it runs
    # (a stage without params may not)
    from eagle3pipe.config import dvcfile

    with_params = {s for s, body in dvcfile.stages(repo / "dvc.yaml").items()
                   if body.get("params")}
    if not set(res["ran"]) & with_params <= set(ran) <= set(res["ran"]):
        res["warning"] = f"DVC's log says {res['ran']} ran, the run log says {sorted(ran)}"
        log(f"WARNING {res['warning']}")
    return res


def cold_run(params_file: Path, work: Path, name: str) -> tuple[Path, dict]:
    """A fresh repo (tests/helpers/pipeline.make_repo: the project's files + params_file, committed,
    no DVC cache, no run cache), then what `make repro` runs: `dvc repro` and `eagle3pipe
    check` on both exports. Per-stage times, the total and the smoke metrics."""
    log(f"{name}: cold repro of {params_file} in {work / name} (per stage below)")
    repo = pipeline.make_repo(work / name, params=params_file)
    res = timed_repro(repo)
    check_wall, check_lines = timed(repo, "eagle3pipe", "check", "--checkpoint",
                                    "artifacts/export/vllm", "--checkpoint",
                                    "artifacts/export/speculators")
    res["check_s"] = rnd(check_wall)
    res["check_ok"] = any("check: OK" in l for _, l in check_lines)
    res["make_repro_s"] = rnd(res["wall_s"] + check_wall)
    res["params"] = str(params_file.relative_to(pipeline.ROOT)
                        if params_file.is_relative_to(pipeline.ROOT) else params_file)
    smoke = json.loads((repo / "metrics/smoke.json").read_text())
    mal = smoke.get("mean_acceptance_length", {})
    res["smoke"] = {"mean_acceptance_length": mal, "passed": smoke.get("passed"),
                    "num_speculative_tokens": smoke.get("num_speculative_tokens")}
    extract_m = json.loads((repo / "metrics/extract.json").read_text())
    res["extract_metrics"] = {k: extract_m.get(k) for k in
                              ("bytes_per_token", "min_bytes_per_token", "tokens")}
    for s in pipeline.STAGES:
        log(f"  {s:9s} {res['stages'][s]['status']:10s} {res['stages'][s]['seconds']:8.1f} s")
    log(f"  dvc overhead {res['dvc_overhead_s']:.1f} s, check {res['check_s']:.1f} s, "
        f"total {res['make_repro_s']:.1f} s")
    return repo, res


def noop_vs_status(repo: Path, repeats: int) -> dict:
    """A no-op `dvc repro` vs `dvc status` on the same up-to-date repo, interleaved, best of
    `repeats` after one warm-up each. The no-op repro must run no stage command."""
    def repro(*args: str):
        r = timed_repro(repo, *args)
        if r["ran"]:
            raise RuntimeError(f"no-op dvc repro {' '.join(args)} ran stages {r['ran']} in "
                               f"{repo}")

    def status():
        _, lines = timed(repo, "dvc", "status")
        if not any("up to date" in l for _, l in lines):
            raise RuntimeError(f"dvc status in {repo} is not clean: "
                               + " | ".join(l for _, l in lines[-10:]))

    # `dvc repro -P` (all pipelines) skips the second parse of dvc.yaml + dvc.lock that a plain
    # `dvc repro` does (DVC 3.67 collects the target stages, then builds the index again)
    times = interleave({"repro": repro, "repro_P": lambda: repro("-P"), "status": status},
                       repeats)
    return {"noop_repro": timing_summary(times["repro"]), "status": timing_summary(times["status"]),
            "noop_repro_P": timing_summary(times["repro_P"]),
            "noop_repro_P_vs_status": rnd(min(times["repro_P"]) / min(times["status"])),
            "noop_repro_vs_status": rnd(min(times["repro"]) / min(times["status"])),
            "noop_repro_vs_status_median": rnd(statistics.median(times["repro"])
                                               / statistics.median(times["status"])),
            "rounds": len(times["status"])}


def rebuild(repo: Path, key: str, value) -> dict:
    """Sets params key to value and times the `dvc repro` that follows, per stage; `expected`
    is eagle3pipe.tools.invalidation's invalidation row for the key (what the README's table promises)."""
    from eagle3pipe.tools import invalidation as graph

    expected = sorted(graph.invalidation_table(repo / "dvc.yaml", repo / "params.yaml",
                                               repo / "configs/verifier_config.json")[key])
    old = pipeline.get_param(repo, key)
    pipeline.set_param(repo, key, value)
    log(f"rebuild after {key}: {old} -> {value} in {repo}")
    res = timed_repro(repo)
    res.update(key=key, old=old, new=value,
               expected=[s for s in pipeline.STAGES if s in expected])
    res["matches_expected"] = res["ran"] == res["expected"]
    for s in pipeline.STAGES:
        log(f"  {s:9s} {res['stages'][s]['status']:10s} {res['stages'][s]['seconds']:8.1f} s")
    return res


def other_even(value: int) -> int:
    """Another even head_dim: half of it (>= 2), or double when it is already 2."""
    v = value // 2 if value >= 4 else value * 2
    return v + (v % 2)


IMPORTS = {
    "python": "pass",
    "torch": "import torch",
    "transformers_llama": "import torch, transformers; from transformers import LlamaForCausalLM",
    "speculators_eagle3": "import speculators.models.eagle3",
    "vllm": "import vllm",
}


def import_floor(repo: Path) -> dict:
    """Seconds a fresh interpreter needs to import what the stages import (best of 2): every
    stage command starts one, so this is a floor under each stage's time."""
    out = {}
    for name, code in IMPORTS.items():
        out[name] = rnd(min(timed(repo, "python", "-c", code)[0] for _ in range(2)))
    return out
