"""The `smoke` stage: real vLLM loads the verifier with each exported EAGLE-3 draft format,
speculates greedily on evaluation prompts, and measures what speculation buys in decode speed.

For each format (artifacts/export/vllm, the flat config; artifacts/export/speculators, the
nested one) it
  1. runs the engine-less load check (vllm_load.check_draft: vLLM's own model class and weight
     loader, every parameter accounted for) -- a missing or trimmed tensor fails here, by name;
     then the forward check (eagle3pipe.engines.forward_check): vLLM's draft class and
     speculators' Eagle3DraftModel give the same logits at every speculative step on seeded
     inputs -- a switch (norm_before_fc, fc_norm, norm_output, the layer type) that one of them
     ignores or reads otherwise fails here, with the step and the figure;
  2. generates with `speculative_config={"method": "eagle3", "model": <export>, ...}` and
     asserts the output token ids equal the non-speculative greedy output (lossless);
  3. reads vLLM's spec-decode counters: mean acceptance length = 1 + accepted / drafts, and the
     per-position acceptance rates;
and measures vLLM's `ngram` (prompt lookup) method on the same prompts with the same k as a
baseline. It fails when the draft's mean acceptance length is below smoke.min_acceptance_length
or below smoke.min_gain_over_ngram times ngram's. What it reads, and how k and the prompts are
chosen: eagle3pipe.stages.smoke.inputs.

The engines and the order they run in: eagle3pipe.stages.smoke.engines; speed:
eagle3pipe.stages.smoke.speed. Training and serving must agree: the draft's acceptance in vLLM on the
training data's eval split beside the trainer's estimate on it (eagle3pipe.stages.smoke.agreement);
a gap above smoke.max_train_serve_gap fails the stage, and the figure is in metrics/smoke.json.

Outputs: metrics/smoke.json is deterministic (counts and 4-decimal floats, no timings);
wall-clock figures go to metrics/smoke_timing.json, and the plot data to plots/ (acceptance per
position and per k: deterministic; speedup per k: timing).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eagle3pipe.config.view import StageView
from eagle3pipe.engines import engine
from eagle3pipe.errors import ParamsAt
from eagle3pipe.stages.smoke.acceptance import ROUND, acceptance, mismatches
from eagle3pipe.stages.smoke.speed import REFERENCE, timing_of
from eagle3pipe.runtime.jsonio import dumps, write_json
from eagle3pipe.runtime.kernels import kernels
from eagle3pipe.runtime.device import vllm_on_cpu
from eagle3pipe.runtime.seeds import seed_everything
from eagle3pipe.stages.smoke import agreement
from eagle3pipe.stages.runner import Paths
from eagle3pipe.stages.smoke.engines import EngineRun, Measured, run_engines
from eagle3pipe.stages.smoke.inputs import (
    NGRAM,
    SWEPT,
    Inputs,
    SmokeError,
    check_forwards,
    check_loads,
    read_inputs,
)
from eagle3pipe.engines import preflight
log = logging.getLogger("eagle3pipe.stages.smoke")

# the stage's other outputs, beside its --metrics and --plots paths (dvc.yaml names them too)
TIMING_NAME = "smoke_timing.json"
K_ACCEPTANCE_NAME = "smoke_k_acceptance.json"
K_SPEEDUP_NAME = "smoke_k_speedup.json"


# ---------------------------------------------------------------------------------------------
# metrics


def judge(s, k: int, reference: EngineRun, runs: dict[str, EngineRun], detok: Callable,
          sources: list[str] | None = None) -> tuple[dict[str, dict], list[str]]:
    """Each run's acceptance with its verdicts (`lossless`; the drafts' `gain_over_ngram`),
    and every failure: outputs that differ, then the drafts' thresholds."""
    results = {name: acceptance(r.counters, k, sum(map(len, r.token_ids)))
               for name, r in runs.items()}
    failures = []
    for name, r in runs.items():
        diff = mismatches(reference.token_ids, r.token_ids, detok, sources=sources)
        results[name]["lossless"] = not diff
        if diff:
            failures.append(f"{name}: speculative output differs from the non-speculative "
                            "greedy output (speculative decoding must be lossless):\n"
                            + "\n".join(f"    {d}" for d in diff))
    ngram_len = results[NGRAM]["mean_acceptance_length"]
    for fmt in (name for name in runs if name != NGRAM):
        r = results[fmt]
        r["gain_over_ngram"] = round(r["mean_acceptance_length"] / ngram_len, ROUND)
        failures += threshold_failures(s, fmt, r, k, ngram_len)
    return results, failures


def threshold_failures(s, fmt: str, r: dict, k: int, ngram_len: float) -> list[str]:
    """A draft's failures against smoke.min_acceptance_length and smoke.min_gain_over_ngram."""
    failures = []
    if r["num_drafts"] == 0:
        failures.append(f"{fmt}: vLLM proposed no drafts at all: the draft never ran")
    if r["mean_acceptance_length"] < s.min_acceptance_length:
        failures.append(
            f"{fmt}: mean acceptance length {r['mean_acceptance_length']} (k={k}) is below "
            f"smoke.min_acceptance_length {s.min_acceptance_length}; per-position acceptance "
            f"{r['acceptance_rate_per_position']}. An untrained or broken draft sits near "
            "1.0; train longer or check the export")
    if r["gain_over_ngram"] < s.min_gain_over_ngram:
        failures.append(
            f"{fmt}: mean acceptance length {r['mean_acceptance_length']} is "
            f"{r['gain_over_ngram']}x ngram's {ngram_len}, below "
            f"smoke.min_gain_over_ngram {s.min_gain_over_ngram}: prompt lookup alone "
            "speculates as well as this draft")
    return failures


def judge_sweep(inp: Inputs, m: Measured, detok: Callable) -> tuple[dict[str, dict],
                                                                     list[str]]:
    """Acceptance per k of the sweep ({"<k>": {method: acceptance + lossless}}) and its
    failures: an output that differs from the non-speculative one at any k."""
    sweep: dict[str, dict] = {}
    failures = []
    sources = [p.source for p in inp.prompts]
    for k in inp.sweep:
        row = {}
        for name in SWEPT:
            r = m.runs[(name, k)]
            row[name] = acceptance(r.counters, k, sum(map(len, r.token_ids)))
            diff = mismatches(m.reference.token_ids, r.token_ids, detok, sources=sources)
            row[name]["lossless"] = not diff
            if diff and k != inp.k:  # the serving k's are reported by judge()
                failures.append(f"{name} at k={k} (smoke.k_sweep): speculative output differs "
                                "from the non-speculative greedy output:\n"
                                + "\n".join(f"    {d}" for d in diff))
        sweep[str(k)] = row
    return sweep, failures


def domain_metrics(inp: Inputs, m: Measured) -> dict[str, dict]:
    """Acceptance by domain at the serving k: {domain: {num_prompts, method: acceptance}}."""
    out = {}
    for domain, idx in inp.domains.items():
        row: dict[str, Any] = {"num_prompts": len(idx)}
        for (name, k), r in m.runs.items():
            if k == inp.k:
                row[name] = acceptance(r.domain_counters[domain], k, r.domain_tokens[domain])
        out[domain] = row
    return out


def metrics_of(s, inp: Inputs, reference: EngineRun, results: dict[str, dict], *,
               passed: bool, sweep: dict[str, dict] | None = None,
               domains: dict[str, dict] | None = None, agreed: dict | None = None) -> dict:
    """metrics/smoke.json: counts, acceptance and verdicts, the thresholds; no timings."""
    out = {
        "num_speculative_tokens": inp.k,
        "num_prompts": len(inp.prompts),
        "max_tokens": s.max_tokens,
        "prompts": inp.source,
        "tokens_generated_non_speculative": sum(map(len, reference.token_ids)),
        "engine": engine.numeric(inp.settings, inp.model_dir),
        "kernels": kernels(vllm=True),
        "formats": {fmt: results[fmt] for fmt in inp.exports},
        NGRAM: results[NGRAM],
        "mean_acceptance_length": {name: results[name]["mean_acceptance_length"]
                                   for name in results},
        "thresholds": {"min_acceptance_length": s.min_acceptance_length,
                       "min_gain_over_ngram": s.min_gain_over_ngram,
                       "max_train_serve_gap": s.max_train_serve_gap},
        "passed": passed,
    }
    if agreed is not None:
        out["train_serve_agreement"] = agreed
    if sweep:
        out["k_sweep"] = sweep
    if domains is not None:
        out["domains"] = domains
    return out


def agreement_of(s, k: int, run: EngineRun, prompts: list, trained: list[float],
                 source: str) -> tuple[dict, str | None]:
    """The draft's acceptance on the eval split beside the trainer's (agreement)."""
    served = acceptance(run.counters, k, sum(map(len, run.token_ids)))
    equal = sum(got == p.reply for got, p in zip(run.token_ids, prompts))
    return agreement.compare(served, trained, k, tolerance=s.max_train_serve_gap,
                             prompts=len(prompts), replies_equal=equal, source=source)


def plot_rows(results: dict[str, dict]) -> list[dict]:
    """Wide rows, one per draft position, a column per format: dvc plots draws one line each."""
    n = max(len(r["acceptance_rate_per_position"]) for r in results.values())
    rows = []
    for i in range(n):
        row = {"position": i + 1}
        for fmt in sorted(results):
            rates = results[fmt]["acceptance_rate_per_position"]
            row[fmt] = rates[i] if i < len(rates) else 0.0
        rows.append(row)
    return rows


def sweep_rows(sweep: dict[str, dict], value: Callable[[dict], float]) -> list[dict]:
    """Wide rows, one per k, a column per swept method (`value` of each entry)."""
    return [{"k": int(k), **{name: value(row[name]) for name in sorted(row)}}
            for k, row in sorted(sweep.items(), key=lambda kv: int(kv[0]))]


def speedup_rows(timing: dict, k: int) -> list[dict]:
    """plots/smoke_k_speedup.json: per k of the sweep (or the serving k alone), the swept
    methods' median speedup at the smoke batch and, as `<method>_batch_1`, at batch 1."""
    def by_k(t: dict) -> dict:
        return t.get("k_sweep") or {str(k): {n: t["methods"][n] for n in SWEPT}}

    rows = sweep_rows(by_k(timing), lambda r: r["speedup"]["median"])
    if "batch_1" in timing:
        one = by_k(timing["batch_1"])
        for row in rows:
            row.update({f"{n}_batch_1": one[str(row["k"])][n]["speedup"]["median"]
                        for n in sorted(SWEPT)})
    return rows


# ---------------------------------------------------------------------------------------------
# the stage


@dataclass
class Outputs:
    """Where the stage writes besides the metrics the runner writes."""
    plots: Path  # per-position acceptance
    timing: Path | None = None  # metrics/smoke_timing.json
    k_acceptance: Path | None = None  # plots/smoke_k_acceptance.json
    k_speedup: Path | None = None  # plots/smoke_k_speedup.json

    @classmethod
    def beside(cls, metrics: str | Path | None, plots: str | Path) -> "Outputs":
        """The stage's outputs by their names in dvc.yaml: the timing file beside --metrics,
        the k plots beside --plots."""
        plots = Path(plots)
        return cls(plots, Path(metrics).parent / TIMING_NAME if metrics else None,
                   plots.parent / K_ACCEPTANCE_NAME, plots.parent / K_SPEEDUP_NAME)


def measure(s, settings: dict, *, template_kwargs: dict, export_dir: str | Path,
            verifier_dir: str | Path, dataset_dir: str | Path, train_metrics: str | Path,
            plots_path: str | Path, outputs: Outputs | None = None, progress: bool = True,
            at: ParamsAt = ParamsAt()) -> dict:
    """Runs the smoke test; `s` is the params' `smoke` section, `settings` the `vllm:` one
    (engine.settings_of), `template_kwargs` dataset.chat_template_kwargs (the prompts rendered
    as the dataset stage's), `dataset_dir` and `train_metrics` the dataset stage's output and
    the trainer's metrics file (the agreement check). Writes the plot data (and the timing
    file when `outputs` names one); the metrics, or SmokeError (with .metrics)."""
    t_stage = time.perf_counter()
    engine.environment(settings)  # before anything imports vLLM
    seed_everything(s.seed, s.threads)
    inp = read_inputs(s, settings, template_kwargs, export_dir, verifier_dir, at)
    eval_prompts = agreement.read_eval(dataset_dir, s.agreement_prompts,
                                       inp.verifier.info.vocab_size, settings["max_model_len"],
                                       inp.k)
    trained = agreement.read_training(train_metrics)
    # the imports' objects out of the collector's walks for the load checks and every engine
    # (the first engine's start adds what the checks imported: engine.refreeze)
    with engine.frozen_heap():
        check_loads(s, inp)
        limit = preflight.eagle3_limit(inp.verifier.config, inp.verifier.config_path,
                                       vllm_on_cpu())
        if limit:  # the verifier stage's preflight reported it up front
            raise SmokeError(f"{limit.file}: {limit.key}: {limit.message} (the exports passed "
                             "vLLM's engine-less load check)", fix=limit.fix)
        forwards = check_forwards(s, inp)
        m = run_engines(s, inp, eval_prompts, progress=progress)
    main = {name: r for (name, k), r in m.runs.items() if k == inp.k}
    sources = [p.source for p in inp.prompts]
    results, failures = judge(s, inp.k, m.reference, main, inp.tokenizer.decode, sources)
    sweep, sweep_failures = judge_sweep(inp, m, inp.tokenizer.decode)
    failures += sweep_failures
    domains = domain_metrics(inp, m) if s.prompts is not None else None
    agreed, gap_failure = agreement_of(s, inp.k, m.agreement, eval_prompts, trained,
                                       str(Path(dataset_dir) / agreement.EVAL_SPLIT))
    failures += [gap_failure] if gap_failure else []
    metrics = metrics_of(s, inp, m.reference, results, passed=not failures, sweep=sweep,
                         domains=domains, agreed=agreed)
    metrics["forward_check"] = forwards
    log.info("engine starts: %s", ", ".join(
        f"{n} {r.start_s:.1f} s" for n, r in [(REFERENCE, m.reference), *main.items()]))
    if failures:
        raise SmokeError("smoke test failed:\n" + "\n".join(f"  - {f}" for f in failures),
                         metrics)
    out = outputs or Outputs(Path(plots_path))
    write_json(out.plots, plot_rows(results))
    timing = timing_of(s, inp, m, swept=SWEPT, stage_seconds=time.perf_counter() - t_stage,
                       metrics_sha256=hashlib.sha256(dumps(metrics).encode()).hexdigest())
    # the per-k plots hold every k of the sweep, or the serving k alone (smoke.k_sweep: []):
    # dvc.yaml declares the acceptance one as an output, so it is always written
    by_k = sweep or {str(inp.k): {n: results[n] for n in SWEPT}}
    if out.k_acceptance:
        write_json(out.k_acceptance, sweep_rows(by_k, lambda r: r["mean_acceptance_length"]))
    if out.k_speedup:
        write_json(out.k_speedup, speedup_rows(timing, inp.k))
    if out.timing:
        write_json(out.timing, timing)
    report(inp, metrics, timing)
    return metrics


def report(inp: Inputs, metrics: dict, timing: dict) -> None:
    """The log's summary: acceptance and speedup per method, the k sweep's recommendation."""
    for name, length in sorted(metrics["mean_acceptance_length"].items()):
        t = timing["methods"][name]
        log.info("%s: mean acceptance length %s at k=%d; %s output tokens/s (non-speculative "
                 "%s), speedup %sx (per round %s-%s)", name, length, inp.k,
                 t["output_tokens_per_s"]["median"],
                 timing["output_tokens_per_s"][REFERENCE], t["speedup"]["median"],
                 t["speedup"]["min"], t["speedup"]["max"])
    one = timing.get("batch_1")
    if one:
        log.info("batch 1 (%d prompts one at a time), speedup at k=%d: %s", one["num_prompts"],
                 inp.k, ", ".join(f"{n} {v}x" for n, v in sorted(one["speedup"].items())))
    if timing["machine"]["busy_warning"]:
        log.warning("%s", timing["machine"]["busy_warning"])
    best = timing.get("best_k")
    if best:
        for name in SWEPT:
            log.info("k sweep %s: %s; best speedup %sx at k=%d (serving default k=%d, "
                     "draft.num_speculative_tokens)", name, ", ".join(
                         f"k={k} {row[name]['speedup']['median']}x (acceptance "
                         f"{metrics['k_sweep'][k][name]['mean_acceptance_length']})"
                         for k, row in timing["k_sweep"].items()),
                     best[name]["speedup"], best[name]["k"], inp.k)


def run(params: StageView, paths: Paths) -> dict:
    """The stage (eagle3pipe.stages.runner.main): paths.export, .verifier, .dataset,
    .train_metrics -> paths.plots, and
    beside paths.metrics and paths.plots the timing file and the k sweep's plots (Outputs.beside,
    the names dvc.yaml gives them); returns the metrics (the runner writes paths.metrics)."""
    return measure(params.smoke, engine.settings_of(params.vllm),
                   template_kwargs=params.dataset.chat_template_kwargs, export_dir=paths.export,
                   verifier_dir=paths.verifier, dataset_dir=paths.dataset,
                   train_metrics=paths.train_metrics, plots_path=paths.plots,
                   outputs=Outputs.beside(paths.metrics, paths.plots), progress=paths.progress,
                   at=params.params_at)
