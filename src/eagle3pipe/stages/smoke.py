"""The `smoke` stage: real vLLM loads the verifier with each exported EAGLE-3 draft format,
speculates greedily on evaluation prompts, and measures what speculation buys in decode speed.

For each format (artifacts/export/vllm, the flat config; artifacts/export/speculators, the
nested one) it
  1. runs the engine-less load check (vllm_load.check_draft: vLLM's own model class and weight
     loader, every parameter accounted for) -- a missing or trimmed tensor fails here, by name;
  2. generates with `speculative_config={"method": "eagle3", "model": <export>, ...}` and
     asserts the output token ids equal the non-speculative greedy output (lossless);
  3. reads vLLM's spec-decode counters: mean acceptance length = 1 + accepted / drafts, and the
     per-position acceptance rates;
and measures vLLM's `ngram` (prompt lookup) method on the same prompts with the same k as a
baseline. It fails when the draft's mean acceptance length is below smoke.min_acceptance_length
or below smoke.min_gain_over_ngram times ngram's. What it reads, and how k and the prompts are
chosen: eagle3pipe.stages.smoke_inputs.

Speed (eagle3pipe.engines.speed): every engine of a run lives in this process at once (engine.engines).
After each engine's first generation (the counted one: lossless check and acceptance counters,
on a fresh engine), `smoke.timing_rounds` rounds follow in which the non-speculative engine and
every speculative engine of a k generate the whole prompt set once each, in alternating order
(A B C, C B A, ...), so that other work on the machine slows every method alike.

Outputs: metrics/smoke.json is deterministic (counts and 4-decimal floats, no timings);
wall-clock figures go to metrics/smoke_timing.json, and the plot data to plots/ (acceptance per
position and per k: deterministic; speedup per k: timing).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from eagle3pipe.config.schema import Params
from eagle3pipe.config.view import StageView
from eagle3pipe.engines import engine
from eagle3pipe.engines.acceptance import (
    ROUND,
    acceptance,
    counter_delta,
    counter_sum,
    mismatches,
    read_counters,
)
from eagle3pipe.engines.speed import REFERENCE, CpuMeter, Pass, timing_of
from eagle3pipe.runtime.jsonio import dumps, write_json
from eagle3pipe.runtime.kernels import kernels
from eagle3pipe.runtime.seeds import seed_everything
from eagle3pipe.stages import estimate as E
from eagle3pipe.stages.runner import Paths
from eagle3pipe.stages.smoke_inputs import (
    FORMATS,
    NGRAM,
    SWEPT,
    Inputs,
    SmokeError,
    check_loads,
    default_where,
    read_inputs,
)
from eagle3pipe.verifier import preflight

log = logging.getLogger("eagle3pipe.stages.smoke")

# the stage's other outputs, beside its --metrics and --plots paths (dvc.yaml names them too)
TIMING_NAME = "smoke_timing.json"
K_ACCEPTANCE_NAME = "smoke_k_acceptance.json"
K_SPEEDUP_NAME = "smoke_k_speedup.json"


# ---------------------------------------------------------------------------------------------
# engines


@dataclass
class EngineRun:
    name: str
    token_ids: list[list[int]]
    counters: dict[str, Any] = field(default_factory=dict)  # summed over domains
    start_s: float = 0.0
    generate_s: float = 0.0
    domain_counters: dict[str, dict] = field(default_factory=dict)
    domain_tokens: dict[str, int] = field(default_factory=dict)


def generate(llm, inp: Inputs, s, *, counted: bool) -> Pass:
    """The prompt set through one engine, one greedy batch per domain, each batch timed; with
    `counted`, vLLM's spec-decode counter deltas per domain (valid for the engine started
    last: see engine.Engines.start)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, seed=s.seed)
    ids: list[list[int]] = [[] for _ in inp.prompts]
    out = Pass(ids, {}, {})
    for domain, idx in inp.domains.items():
        before = read_counters(llm) if counted else None
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=inp.prompts[i].ids) for i in idx],
                           sampling, use_tqdm=False)
        out.seconds[domain] = time.perf_counter() - t0
        for i, r in zip(idx, res):
            ids[i] = list(r.outputs[0].token_ids)
        out.tokens[domain] = sum(len(ids[i]) for i in idx)
        if counted:
            out.counters[domain] = counter_delta(before, read_counters(llm))
    return out


def speculative_configs(s, inp: Inputs, k: int | None = None,
                        names: tuple[str, ...] | None = None) -> dict[str, dict]:
    """The speculative engines at k (default: the serving k), by name: each exported format's
    draft, then vLLM's ngram; `names` keeps only those."""
    k = inp.k if k is None else k
    out: dict[str, dict] = {fmt: {"method": "eagle3", "model": str(d),
                                  "num_speculative_tokens": k}
                            for fmt, d in inp.exports.items()}
    out[NGRAM] = {"method": "ngram", "num_speculative_tokens": k,
                  "prompt_lookup_min": s.ngram_prompt_lookup_min,
                  "prompt_lookup_max": s.ngram_prompt_lookup_max}
    return {n: c for n, c in out.items() if names is None or n in names}


def label(name: str) -> str:
    return name if name in (NGRAM, REFERENCE) else f"eagle3 ({name})"


@dataclass
class Measured:
    """What the engines produced: the reference, the counted run of every speculative engine
    by (name, k), and every timed pass by (name, k) (the reference's by the k of its round)."""
    reference: EngineRun
    runs: dict[tuple[str, int], EngineRun]
    timed: dict[tuple[str, int], list[Pass]]
    seconds: dict[str, float]
    other_cpu_share: float | None = None  # other processes' CPU share during the timed rounds


def groups(s, inp: Inputs) -> list[tuple[int, dict[str, dict]]]:
    """(k, speculative configs) of each round group: every method at the serving k, then the
    swept methods at each other k of the sweep."""
    out = [(inp.k, speculative_configs(s, inp))]
    out += [(k, speculative_configs(s, inp, k, SWEPT)) for k in inp.sweep if k != inp.k]
    return out


def run_engines(s, inp: Inputs, *, progress: bool = True) -> Measured:
    """All engines in this process: the non-speculative reference stays up for the whole run;
    each group of speculative engines (one k) starts, makes its counted pass, then
    smoke.timing_rounds rounds alternate the reference and the group's engines."""
    plan = groups(s, inp)
    rounds = s.timing_rounds
    total = 1 + sum(len(g) + rounds * (len(g) + 1) for _, g in plan)
    runs: dict[tuple[str, int], EngineRun] = {}
    timed: dict[tuple[str, int], list[Pass]] = {}
    seconds = {"engine_start": 0.0, "counted": 0.0, "timed": 0.0}
    bar = tqdm(total=total, desc="smoke: generate", unit="pass", disable=not progress,
               mininterval=1.0)
    meter = CpuMeter()

    def start(pool, name, k, spec):
        t0 = time.perf_counter()
        llm = pool.start(spec)
        dt = time.perf_counter() - t0
        seconds["engine_start"] += dt
        log.info("%s (k=%s): engine start %.1f s", label(name), k if spec else "-", dt)
        return llm, dt

    with engine.engines(inp.settings, inp.model_dir, threads=s.threads, stats=True) as pool:
        ref_llm, ref_start = start(pool, REFERENCE, 0, None)
        t0 = time.perf_counter()
        first = generate(ref_llm, inp, s, counted=False)
        seconds["counted"] += time.perf_counter() - t0
        bar.update()
        reference = EngineRun(REFERENCE, first.token_ids, start_s=ref_start,
                              generate_s=sum(first.seconds.values()),
                              domain_tokens=first.tokens)
        for k, specs in plan:
            llms = {}
            for name, spec in specs.items():
                llm, dt = start(pool, name, k, spec)
                t0 = time.perf_counter()
                p = generate(llm, inp, s, counted=True)  # before the next start (its counters)
                seconds["counted"] += time.perf_counter() - t0
                bar.update()
                runs[(name, k)] = EngineRun(name, p.token_ids, counter_sum(list(p.counters.values())),
                                            dt, sum(p.seconds.values()), p.counters, p.tokens)
                llms[name] = llm
            order = [(REFERENCE, ref_llm), *llms.items()]
            t0 = time.perf_counter()
            meter.resume()
            for r in range(rounds):
                for name, llm in (order if r % 2 == 0 else order[::-1]):
                    timed.setdefault((name, k), []).append(generate(llm, inp, s, counted=False))
                    bar.update()
            meter.pause()
            seconds["timed"] += time.perf_counter() - t0
            for llm in llms.values():
                pool.stop(llm)
    bar.close()
    return Measured(reference, runs, timed, seconds, meter.other_share())


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
               domains: dict[str, dict] | None = None) -> dict:
    """metrics/smoke.json: counts, acceptance and verdicts, the thresholds; no timings."""
    out = {
        "num_speculative_tokens": inp.k,
        "num_prompts": len(inp.prompts),
        "max_tokens": s.max_tokens,
        "prompts": inp.source,
        "tokens_generated_non_speculative": sum(map(len, reference.token_ids)),
        "engine": engine.numeric(inp.settings),
        "kernels": kernels(vllm=True),
        "formats": {fmt: results[fmt] for fmt in inp.exports},
        NGRAM: results[NGRAM],
        "mean_acceptance_length": {name: results[name]["mean_acceptance_length"]
                                   for name in results},
        "thresholds": {"min_acceptance_length": s.min_acceptance_length,
                       "min_gain_over_ngram": s.min_gain_over_ngram},
        "passed": passed,
    }
    if sweep:
        out["k_sweep"] = sweep
    if domains is not None:
        out["domains"] = domains
    return out


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


def measure(s, settings: dict, *, export_dir: str | Path, verifier_dir: str | Path,
            plots_path: str | Path, outputs: Outputs | None = None, progress: bool = True,
            where: Callable[[str], str] = default_where) -> dict:
    """Runs the smoke test; `s` is the params' `smoke` section, `settings` the `vllm:` one
    (engine.settings_of). Writes the plot data (and the timing file when `outputs` names one)
    and returns the metrics; raises SmokeError (with .metrics) when a check fails."""
    t_stage = time.perf_counter()
    engine.environment(settings)  # before anything imports vLLM
    seed_everything(s.seed, s.threads)
    inp = read_inputs(s, settings, export_dir, verifier_dir, where)
    # one freeze of the imports' objects for the load checks and every engine
    with engine.frozen_heap():
        check_loads(s, inp)
        limit = preflight.eagle3_limit(inp.verifier.config, inp.verifier.config_path,
                                       preflight.on_cpu())
        if limit:  # the verifier stage's preflight reported it up front
            raise SmokeError(f"{limit.file}: {limit.key}: {limit.message} (the exports passed "
                             "vLLM's engine-less load check)", fix=limit.fix)
        m = run_engines(s, inp, progress=progress)
    main = {name: r for (name, k), r in m.runs.items() if k == inp.k}
    sources = [p.source for p in inp.prompts]
    results, failures = judge(s, inp.k, m.reference, main, inp.tokenizer.decode, sources)
    sweep, sweep_failures = judge_sweep(inp, m, inp.tokenizer.decode)
    failures += sweep_failures
    domains = domain_metrics(inp, m) if s.prompts is not None else None
    metrics = metrics_of(s, inp, m.reference, results, passed=not failures, sweep=sweep,
                         domains=domains)
    log.info("engine starts: %s", ", ".join(
        f"{n} {r.start_s:.1f} s" for n, r in [(REFERENCE, m.reference), *main.items()]))
    if failures:
        raise SmokeError("smoke test failed:\n" + "\n".join(f"  - {f}" for f in failures),
                         metrics)
    out = outputs or Outputs(Path(plots_path))
    write_json(out.plots, plot_rows(results))
    timing = timing_of(s, inp, m, swept=SWEPT, stage_seconds=time.perf_counter() - t_stage,
                       metrics_sha256=hashlib.sha256(
                           dumps(metrics).encode()).hexdigest())
    # the per-k plots hold every k of the sweep, or the serving k alone (smoke.k_sweep: []):
    # dvc.yaml declares the acceptance one as an output, so it is always written
    by_k = sweep or {str(inp.k): {n: results[n] for n in SWEPT}}
    speed_by_k = timing.get("k_sweep") or {str(inp.k): {n: timing["methods"][n] for n in SWEPT}}
    if out.k_acceptance:
        write_json(out.k_acceptance,
                           sweep_rows(by_k, lambda r: r["mean_acceptance_length"]))
    if out.k_speedup:
        write_json(out.k_speedup,
                           sweep_rows(speed_by_k, lambda r: r["speedup"]["median"]))
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
    """The stage (eagle3pipe.stages.runner.main): paths.export, .verifier -> paths.plots, and
    beside paths.metrics and paths.plots the timing file and the k sweep's plots (Outputs.beside,
    the names dvc.yaml gives them); returns the metrics (the runner writes paths.metrics)."""
    return measure(params.smoke, engine.settings_of(params.vllm), export_dir=paths.export,
                   verifier_dir=paths.verifier, plots_path=paths.plots,
                   outputs=Outputs.beside(paths.metrics, paths.plots), progress=paths.progress,
                   where=params.where)


def estimate(params: Params, f: E.Figures) -> E.Estimate:
    """Every engine (no speculation, one per exported layout, ngram) one after another."""
    s, v = params.smoke, params.vllm
    engines = 2 + len(FORMATS)
    e = E.engine_estimate("smoke", v, f, s.num_prompts * s.max_tokens * engines, None,
                          extra=f.draft_bytes // v.tensor_parallel_size)
    e.notes.append(f"{engines} engines one after another, {s.num_prompts} prompts x "
                   f"{s.max_tokens} tokens each")
    return e
