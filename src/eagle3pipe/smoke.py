"""The `smoke` stage: real vLLM loads the verifier with each exported EAGLE-3 draft format and
speculates greedily on held-out prompts.

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
or below smoke.min_gain_over_ngram times ngram's.

k is the exported speculators config's serving default (proposal method `speculative_tokens`),
so the stage reads no draft params. Metrics are deterministic: counts and 4-decimal floats, no
timings (timings go to the log).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagle3pipe import engine, preflight, runtime, vllm_load
from eagle3pipe.errors import Error
from eagle3pipe.verifier import Verifier

log = logging.getLogger("eagle3pipe.smoke")

FORMATS = ("vllm", "speculators")  # artifacts/export/<format>/
NGRAM = "ngram"
COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_position": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
ROUND = 4


class SmokeError(Error, RuntimeError):
    """A draft that does not load, is not lossless, or does not speculate well enough.
    `metrics` holds what was measured (None when the run stopped before the engines)."""

    def __init__(self, message: str, metrics: dict | None = None, *, fix: str = ""):
        super().__init__(message, fix)
        self.metrics = metrics


# ---------------------------------------------------------------------------------------------
# inputs


def export_dirs(export_dir: str | Path) -> dict[str, Path]:
    out = {}
    for fmt in FORMATS:
        d = Path(export_dir) / fmt
        missing = [n for n in ("config.json", "model.safetensors") if not (d / n).is_file()]
        if missing:
            raise SmokeError(f"{d}: {', '.join(missing)} missing; the export stage writes "
                             f"{export_dir}/{{vllm,speculators}}/{{config.json,model.safetensors}}"
                             " (run `dvc repro export`)")
        out[fmt] = d
    return out


def speculative_tokens(export_dir: str | Path) -> int:
    """k: the serving default the export rendered into the speculators config (the
    default proposal method's `speculative_tokens`)."""
    path = Path(export_dir) / "speculators" / "config.json"
    cfg = runtime.read_json_object(path, SmokeError, "run `dvc repro export`",
                                   "exported speculators config")
    try:
        sc = cfg["speculators_config"]
        methods = sc["proposal_methods"]
        default = sc.get("default_proposal_method")
        method = next((m for m in methods if m.get("proposal_type") == default), methods[0])
        k = method["speculative_tokens"]
    except (KeyError, IndexError, TypeError):
        raise SmokeError(f"{path}: no speculators_config.proposal_methods[*].speculative_tokens;"
                         " it is rendered from draft.num_speculative_tokens by the configs "
                         "stage (run `dvc repro configs export`)") from None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SmokeError(f"{path}: speculative_tokens must be a positive integer, got {k!r}")
    return k


def build_prompts(tok, num_prompts: int, seed: int) -> list[list[int]]:
    """Held-out corpus snippets as user turns, formatted with the verifier's chat template
    (add_generation_prompt=True) and tokenized once, so vLLM adds no second BOS."""
    from eagle3pipe import corpus

    try:
        texts = corpus.snippets("heldout", num_prompts, seed=seed)
    except RuntimeError as e:
        raise SmokeError(f"smoke.num_prompts: {e}") from None
    out = []
    for text in texts:
        s = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                    add_generation_prompt=True)
        out.append(list(tok(s, add_special_tokens=False)["input_ids"]))
    return out


@dataclass
class Inputs:
    """What every engine of a smoke run shares."""
    exports: dict[str, Path]  # format -> artifacts/export/<format>
    k: int  # num_speculative_tokens
    model_dir: Path  # the verifier's weights
    tokenizer: Any
    prompts: list[list[int]]
    settings: dict  # the run's vLLM engine settings (engine.settings_of)
    verifier: Verifier


def read_inputs(s, settings: dict, export_dir: str | Path, verifier_dir: str | Path) -> Inputs:
    """The exports, k, the verifier and the tokenized prompts; vllm.max_model_len must fit the
    longest prompt, its generation and one speculative step past it."""
    exports = export_dirs(export_dir)
    k = speculative_tokens(export_dir)
    # fails fast on a vanished or changed external checkpoint
    v = Verifier(verifier_dir, trust_remote_code=settings["trust_remote_code"])
    tok = v.tokenizer()
    prompts = build_prompts(tok, s.num_prompts, s.seed)
    longest = max(map(len, prompts))
    log.info("verifier %s, k=%d, %d prompts (longest %d tokens), max_tokens %d",
             v.model_dir, k, len(prompts), longest, s.max_tokens)
    need = longest + s.max_tokens + k + 1
    if need > settings["max_model_len"]:
        raise SmokeError(f"vllm.max_model_len {settings['max_model_len']} is shorter than the "
                         f"longest smoke prompt ({longest} tokens) + smoke.max_tokens "
                         f"({s.max_tokens}) + k + 1 = {need}",
                         fix=f"raise vllm.max_model_len to at least {need} or lower "
                         "smoke.max_tokens")
    return Inputs(exports, k, v.model_dir, tok, prompts, settings, v)


# ---------------------------------------------------------------------------------------------
# load checks


def check_loads(s, inp: Inputs) -> None:
    """The engine-less load check of every format (before any engine starts); raises
    SmokeError listing every problem."""
    problems = []
    for fmt, d in inp.exports.items():
        rep = vllm_load.check_draft(inp.settings, inp.model_dir, d,
                                    num_speculative_tokens=inp.k)
        log.info("%s: engine-less load check (%s) %s in %.1f s%s", fmt,
                 rep.architecture or "?", "ok" if rep.ok else "FAILED", rep.seconds,
                 "; shared verifier embedding" if rep.shared_embedding else "")
        problems += rep.problems
    if problems:
        raise SmokeError("engine-less vLLM load check failed (each would start an engine "
                         "silently broken, or fail inside it):\n"
                         + "\n".join(f"  - {p}" for p in problems))


# ---------------------------------------------------------------------------------------------
# engines


@dataclass
class EngineRun:
    name: str
    token_ids: list[list[int]]
    counters: dict[str, Any] = field(default_factory=dict)
    start_s: float = 0.0
    generate_s: float = 0.0


def _counters(llm) -> dict[str, Any]:
    """vLLM V1's spec-decode counters (summed over label sets, e.g. engine index)."""
    from vllm.v1.metrics.reader import Counter, Vector

    wanted = {v: k for k, v in COUNTERS.items()}
    out: dict[str, Any] = {"accepted_per_position": []}
    for m in llm.get_metrics():
        key = wanted.get(m.name)
        if key is None:
            continue
        if isinstance(m, Vector):
            cur = out.get(key) or []
            vals = list(m.values)
            cur = cur + [0] * (len(vals) - len(cur))
            out[key] = [a + b for a, b in zip(cur, vals + [0] * (len(cur) - len(vals)))]
        elif isinstance(m, Counter):
            out[key] = out.get(key, 0) + int(m.value)
    return out


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for k in COUNTERS:
        a, b = after.get(k, 0 if k != "accepted_per_position" else []), before.get(k)
        if isinstance(a, list):
            b = b or []
            out[k] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        else:
            out[k] = a - (b or 0)
    return out


def run_engine(name: str, inp: Inputs, s, speculative_config: dict | None) -> EngineRun:
    """One in-process vLLM engine on the verifier: greedy generation on the prompts and the
    spec-decode counter deltas, with the run's engine settings (as every stage's engine)."""
    t0 = time.perf_counter()
    with engine.engine(inp.settings, inp.model_dir, threads=s.threads,
                       speculative_config=speculative_config, stats=True) as llm:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter() - t0
        log.info("%s: engine start %.1f s", name, start)
        before = _counters(llm)
        t1 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in inp.prompts],
                            SamplingParams(temperature=0.0, max_tokens=s.max_tokens,
                                           seed=s.seed),
                            use_tqdm=True)
        gen = time.perf_counter() - t1
        counters = _delta(before, _counters(llm))
    ids = [list(o.outputs[0].token_ids) for o in outs]
    log.info("%s: generated %d tokens in %.1f s", name, sum(map(len, ids)), gen)
    return EngineRun(name, ids, counters, start, gen)


def speculative_configs(s, inp: Inputs) -> dict[str, dict]:
    """The speculative engines, by name: each exported format's draft, then vLLM's ngram."""
    out: dict[str, dict] = {fmt: {"method": "eagle3", "model": str(d),
                                  "num_speculative_tokens": inp.k}
                            for fmt, d in inp.exports.items()}
    out[NGRAM] = {"method": "ngram", "num_speculative_tokens": inp.k,
                  "prompt_lookup_min": s.ngram_prompt_lookup_min,
                  "prompt_lookup_max": s.ngram_prompt_lookup_max}
    return out


def run_engines(s, inp: Inputs) -> tuple[EngineRun, dict[str, EngineRun]]:
    """The non-speculative reference, then every speculative engine, one after another."""
    reference = run_engine("non-speculative", inp, s, None)
    runs = {}
    for name, spec in speculative_configs(s, inp).items():
        label = NGRAM if name == NGRAM else f"eagle3 ({name})"
        runs[name] = run_engine(label, inp, s, spec)
    return reference, runs


# ---------------------------------------------------------------------------------------------
# metrics


def acceptance(counters: dict, k: int, tokens_generated: int) -> dict:
    """Mean acceptance length (1 + accepted / drafts) and per-position acceptance rates."""
    drafts = int(counters.get("drafts", 0))
    accepted = int(counters.get("accepted_tokens", 0))
    per_pos = list(counters.get("accepted_per_position") or [])
    per_pos = (per_pos + [0] * k)[:k]
    return {
        "mean_acceptance_length": round(1.0 + accepted / drafts, ROUND) if drafts else 1.0,
        "acceptance_rate_per_position": [round(a / drafts, ROUND) if drafts else 0.0
                                         for a in per_pos],
        "num_drafts": drafts,
        "num_draft_tokens": int(counters.get("draft_tokens", 0)),
        "num_accepted_tokens": accepted,
        "tokens_generated": int(tokens_generated),
    }


def mismatches(reference: list[list[int]], got: list[list[int]], detok: Callable | None = None,
               limit: int = 3) -> list[str]:
    """Prompts whose speculative output differs from the non-speculative one."""
    out = []
    for i, (a, b) in enumerate(zip(reference, got)):
        if a == b:
            continue
        j = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        msg = (f"prompt {i}: first difference at output token {j}: non-speculative "
               f"{a[j:j + 4]} vs speculative {b[j:j + 4]} (lengths {len(a)} / {len(b)})")
        if detok is not None:
            msg += f"; non-speculative text {detok(a[max(0, j - 8):j + 8])!r}, speculative " \
                   f"{detok(b[max(0, j - 8):j + 8])!r}"
        out.append(msg)
    if len(reference) != len(got):
        out.append(f"{len(reference)} non-speculative outputs vs {len(got)} speculative")
    more = len(out) - limit
    return out[:limit] + ([f"... and {more} more prompts"] if more > 0 else [])


def judge(s, k: int, reference: EngineRun, runs: dict[str, EngineRun], detok: Callable
          ) -> tuple[dict[str, dict], list[str]]:
    """Each run's acceptance with its verdicts (`lossless`; the drafts' `gain_over_ngram`),
    and every failure: outputs that differ, then the drafts' thresholds."""
    results = {name: acceptance(r.counters, k, sum(map(len, r.token_ids)))
               for name, r in runs.items()}
    failures = []
    for name, r in runs.items():
        diff = mismatches(reference.token_ids, r.token_ids, detok)
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


def metrics_of(s, inp: Inputs, reference: EngineRun, results: dict[str, dict], *,
               passed: bool) -> dict:
    """metrics/smoke.json: counts, acceptance and verdicts, the thresholds; no timings."""
    return {
        "num_speculative_tokens": inp.k,
        "num_prompts": len(inp.prompts),
        "max_tokens": s.max_tokens,
        "tokens_generated_non_speculative": sum(map(len, reference.token_ids)),
        "engine": engine.numeric(inp.settings),
        "formats": {fmt: results[fmt] for fmt in inp.exports},
        NGRAM: results[NGRAM],
        "mean_acceptance_length": {name: results[name]["mean_acceptance_length"]
                                   for name in results},
        "thresholds": {"min_acceptance_length": s.min_acceptance_length,
                       "min_gain_over_ngram": s.min_gain_over_ngram},
        "passed": passed,
    }


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


# ---------------------------------------------------------------------------------------------
# the stage


def measure(s, settings: dict, *, export_dir: str | Path, verifier_dir: str | Path,
            plots_path: str | Path) -> dict:
    """Runs the smoke test; `s` is the params' `smoke` section, `settings` the `vllm:` one
    (engine.settings_of). Writes the plot data and returns the metrics; raises SmokeError (with
    .metrics) when a check fails."""
    engine.environment(settings)  # before anything imports vLLM
    runtime.seed_everything(s.seed, s.threads)
    inp = read_inputs(s, settings, export_dir, verifier_dir)
    # one freeze of the imports' objects for the load checks and every engine
    with engine.frozen_heap():
        check_loads(s, inp)
        limit = preflight.eagle3_limit(inp.verifier.config, inp.verifier.config_path,
                                       preflight.on_cpu())
        if limit:  # the verifier stage's preflight reported it up front
            raise SmokeError(f"{limit.where}: {limit.message} (the exports passed vLLM's "
                             "engine-less load check)", fix=limit.fix)
        reference, runs = run_engines(s, inp)
    results, failures = judge(s, inp.k, reference, runs, inp.tokenizer.decode)
    metrics = metrics_of(s, inp, reference, results, passed=not failures)
    log.info("engine starts: %s", ", ".join(
        f"{n} {r.start_s:.1f} s" for n, r in [("non-speculative", reference), *runs.items()]))
    if failures:
        raise SmokeError("smoke test failed:\n" + "\n".join(f"  - {f}" for f in failures),
                         metrics)
    runtime.write_json(plots_path, plot_rows(results))
    return metrics


def run(params, paths) -> dict:
    """The stage (eagle3pipe.stage.main): paths.export, .verifier -> paths.plots; returns the
    metrics (the runner writes paths.metrics)."""
    m = measure(params.smoke, engine.settings_of(params.vllm), export_dir=paths.export,
                verifier_dir=paths.verifier, plots_path=paths.plots)
    for name, length in sorted(m["mean_acceptance_length"].items()):
        log.info("%s: mean acceptance length %s at k=%d", name, length,
                 m["num_speculative_tokens"])
    return m
