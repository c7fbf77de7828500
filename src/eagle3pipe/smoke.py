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
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagle3pipe import runtime
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

    def __init__(self, message: str, metrics: dict | None = None):
        super().__init__(message)
        self.metrics = metrics


# ---------------------------------------------------------------------------------------------
# inputs


def configure_environment(kv_cache_gib: float, threads: int) -> None:
    """Must run before vLLM is imported: one in-process engine (a load failure surfaces as the
    real exception, not a dead worker), a bounded KV cache, explicit threads, no hub access."""
    import torch

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if float(kv_cache_gib).is_integer():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))  # CPU backend, in GiB
    else:  # the env var takes whole GiB; kv_cache_memory_bytes (engine arg) takes the rest
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)


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


def run_engine(name: str, model_dir: str | Path, prompts: list[list[int]], *,
               speculative_config: dict | None, max_tokens: int, kv_cache_gib: float, seed: int,
               max_model_len: int) -> EngineRun:
    """One in-process vLLM engine: greedy generation and the spec-decode counter deltas."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3pipe import vllm_load

    kw = vllm_load.engine_kwargs(model_dir, speculative_config=speculative_config,
                                 kv_cache_gib=kv_cache_gib, seed=seed,
                                 max_model_len=max_model_len)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start = time.perf_counter() - t0
    log.info("smoke: %s: engine start %.1f s", name, start)
    try:
        before = _counters(llm)
        t1 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=seed),
                            use_tqdm=True)
        gen = time.perf_counter() - t1
        counters = _delta(before, _counters(llm))
        ids = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the objects are dropped anyway
            pass
        del llm
        vllm_load.cleanup()
    log.info("smoke: %s: generated %d tokens in %.1f s", name, sum(map(len, ids)), gen)
    return EngineRun(name, ids, counters, start, gen)


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


def measure(s, *, export_dir: str | Path, verifier_dir: str | Path, plots_path: str | Path
            ) -> dict:
    """Runs the smoke test; `s` is the params' `smoke` section. Writes the plot data and
    returns the metrics; raises SmokeError (with .metrics) when a check fails."""
    configure_environment(s.kv_cache_gib, s.threads)
    runtime.seed_everything(s.seed, s.threads)
    from eagle3pipe import vllm_load

    exports = export_dirs(export_dir)
    k = speculative_tokens(export_dir)
    v = Verifier(verifier_dir)  # fails fast on a vanished or changed external checkpoint
    model_dir, tok = v.model_dir, v.tokenizer()
    prompts = build_prompts(tok, s.num_prompts, s.seed)
    max_model_len = max(map(len, prompts)) + s.max_tokens + k + 1
    log.info("smoke: verifier %s, k=%d, %d prompts (longest %d tokens), max_tokens %d",
             model_dir, k, len(prompts), max(map(len, prompts)), s.max_tokens)

    # the imports' objects out of the cyclic GC's walks while the engines run
    with vllm_load.frozen_heap():
        # 1. engine-less load check, both formats, before any engine starts
        problems = []
        for fmt, d in exports.items():
            rep = vllm_load.check_draft(model_dir, d, num_speculative_tokens=k,
                                        kv_cache_gib=s.kv_cache_gib, seed=s.seed,
                                        max_model_len=max_model_len)
            log.info("smoke: %s: engine-less load check (%s) %s in %.1f s%s", fmt,
                     rep.architecture or "?", "ok" if rep.ok else "FAILED", rep.seconds,
                     "; shared verifier embedding" if rep.shared_embedding else "")
            problems += rep.problems
        if problems:
            raise SmokeError("engine-less vLLM load check failed (each would start an engine "
                             "silently broken, or fail inside it):\n"
                             + "\n".join(f"  - {p}" for p in problems))

        common = dict(max_tokens=s.max_tokens, kv_cache_gib=s.kv_cache_gib, seed=s.seed,
                      max_model_len=max_model_len)
        reference = run_engine("non-speculative", model_dir, prompts, speculative_config=None,
                               **common)
        runs = {}
        for fmt, d in exports.items():
            runs[fmt] = run_engine(f"eagle3 ({fmt})", model_dir, prompts, speculative_config={
                "method": "eagle3", "model": str(d), "num_speculative_tokens": k}, **common)
        runs[NGRAM] = run_engine(NGRAM, model_dir, prompts, speculative_config={
            "method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": s.ngram_prompt_lookup_min,
            "prompt_lookup_max": s.ngram_prompt_lookup_max}, **common)

    detok = tok.decode
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
    for fmt in exports:
        r = results[fmt]
        r["gain_over_ngram"] = round(r["mean_acceptance_length"] / ngram_len, ROUND)
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

    metrics = {
        "num_speculative_tokens": k,
        "num_prompts": len(prompts),
        "max_tokens": s.max_tokens,
        "tokens_generated_non_speculative": sum(map(len, reference.token_ids)),
        "formats": {fmt: results[fmt] for fmt in exports},
        NGRAM: results[NGRAM],
        "mean_acceptance_length": {name: results[name]["mean_acceptance_length"]
                                   for name in results},
        "thresholds": {"min_acceptance_length": s.min_acceptance_length,
                       "min_gain_over_ngram": s.min_gain_over_ngram},
        "passed": not failures,
    }
    log.info("smoke: engine starts: %s", ", ".join(
        f"{n} {r.start_s:.1f} s" for n, r in [("non-speculative", reference), *runs.items()]))
    if failures:
        raise SmokeError("smoke test failed:\n" + "\n".join(f"  - {f}" for f in failures),
                         metrics)
    runtime.write_json(plots_path, plot_rows(results))
    return metrics


def run(params, paths) -> dict:
    """The stage (eagle3pipe.stage.main): paths.export, .verifier -> paths.plots; returns the
    metrics (the runner writes paths.metrics)."""
    m = measure(params.smoke, export_dir=paths.export, verifier_dir=paths.verifier,
                plots_path=paths.plots)
    for name, length in sorted(m["mean_acceptance_length"].items()):
        log.info("%s: mean acceptance length %s at k=%d", name, length,
                 m["num_speculative_tokens"])
    return m
