"""The smoke stage's engines: every engine of a run lives in this process at once
(engine.engines). The non-speculative reference stays up for the whole run; each group of
speculative engines (one k) starts, makes its counted pass (lossless check and acceptance
counters, on a fresh engine; at the serving k the draft in the vllm layout also generates the
eval split's prompts for eagle3pipe.stages.smoke.agreement), then one warm-up round (every
engine of the group and the reference once, not recorded: the first passes after engine starts
and other work measured slow), then `smoke.timing_rounds` rounds follow in which the reference
and every engine of the group generate the whole prompt set once each, in alternating order (A B C, C B A, ...), so that other work on the machine slows every
method alike. In every timed pass the engine also generates the first `smoke.batch1_prompts`
prompts one request at a time (batch-1 latency). Python's garbage collector is held off while a
pass is timed and run between passes, so that no pass pays for another's garbage.
"""
from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from eagle3pipe.engines import engine
from eagle3pipe.stages.smoke.acceptance import counter_delta, counter_sum, read_counters
from eagle3pipe.stages.smoke.speed import REFERENCE, CpuMeter, Pass
from eagle3pipe.stages.smoke.agreement import EvalPrompt
from eagle3pipe.stages.smoke.inputs import FORMATS, NGRAM, SWEPT, Inputs

log = logging.getLogger("eagle3pipe.stages.smoke")


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


def generate_single(llm, inp: Inputs, s) -> Pass:
    """The first smoke.batch1_prompts prompts through one engine one request at a time (each
    call returns before the next is made): batch-1 latency, one timing for them all."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, seed=s.seed)
    ids, seconds = [], 0.0
    for p in inp.prompts[:s.batch1_prompts]:
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p.ids)], sampling, use_tqdm=False)
        seconds += time.perf_counter() - t0
        ids.append(list(res[0].outputs[0].token_ids))
    return Pass(ids, {"batch_1": seconds}, {"batch_1": sum(map(len, ids))})


@contextmanager
def no_gc():
    """Python's collector off for a timed pass, collected after it (not inside the next)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def generate_eval(llm, prompts: list[EvalPrompt], s) -> EngineRun:
    """The eval split's prompts through the engine started last, one greedy batch, each prompt
    for as many tokens as its dataset reply; the spec-decode counter delta."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = [SamplingParams(temperature=0.0, max_tokens=len(p.reply), seed=s.seed)
                for p in prompts]
    before = read_counters(llm)
    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p.ids) for p in prompts], sampling,
                       use_tqdm=False)
    return EngineRun("agreement", [list(r.outputs[0].token_ids) for r in res],
                     counter_delta(before, read_counters(llm)),
                     generate_s=time.perf_counter() - t0)


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
    by (name, k), and every timed pass by (name, k) (the reference's by the k of its round), at
    the smoke batch and at batch 1."""
    reference: EngineRun
    runs: dict[tuple[str, int], EngineRun]
    timed: dict[tuple[str, int], list[Pass]]
    seconds: dict[str, float]
    timed_batch1: dict[tuple[str, int], list[Pass]] = field(default_factory=dict)
    other_cpu_share: float | None = None  # other processes' CPU share during the timed rounds
    agreement: EngineRun | None = None  # the draft (vllm layout, serving k) on the eval split


def groups(s, inp: Inputs) -> list[tuple[int, dict[str, dict]]]:
    """(k, speculative configs) of each round group: every method at the serving k, then the
    swept methods at each other k of the sweep."""
    out = [(inp.k, speculative_configs(s, inp))]
    out += [(k, speculative_configs(s, inp, k, SWEPT)) for k in inp.sweep if k != inp.k]
    return out


def run_engines(s, inp: Inputs, eval_prompts: list[EvalPrompt] | None = None, *,
                progress: bool = True) -> Measured:
    """All engines in this process: the non-speculative reference stays up for the whole run;
    each group of speculative engines (one k) starts, makes its counted pass (the draft in
    the vllm layout at the serving k then also generates `eval_prompts`), then after a warm-up
    round smoke.timing_rounds rounds alternate the reference and the group's engines, each pass
    at the smoke batch and (smoke.batch1_prompts) at batch 1."""
    plan = groups(s, inp)
    rounds = s.timing_rounds
    total = 1 + sum(len(g) + (rounds + 1) * (len(g) + 1) for _, g in plan) + bool(eval_prompts)
    agreement = None
    runs: dict[tuple[str, int], EngineRun] = {}
    timed: dict[tuple[str, int], list[Pass]] = {}
    timed1: dict[tuple[str, int], list[Pass]] = {}
    seconds = {"engine_start": 0.0, "counted": 0.0, "warm_up": 0.0, "timed": 0.0}
    bar = tqdm(total=total, desc="smoke: generate", unit="pass", disable=not progress,
               mininterval=1.0)
    meter = CpuMeter()
    with engine.engines(inp.settings, inp.model_dir, threads=s.threads, stats=True) as pool:
        ref_llm, ref_start = _start(pool, REFERENCE, 0, None, seconds)
        t0 = time.perf_counter()
        first = generate(ref_llm, inp, s, counted=False)
        seconds["counted"] += time.perf_counter() - t0
        bar.update()
        reference = EngineRun(REFERENCE, first.token_ids, start_s=ref_start,
                              generate_s=sum(first.seconds.values()),
                              domain_tokens=first.tokens)
        for k, specs in plan:
            llms, got = _counted_passes(pool, k, specs, s, inp, eval_prompts, runs, seconds, bar)
            if got is not None:
                agreement = got
            order = [(REFERENCE, ref_llm), *llms.items()]
            t0 = time.perf_counter()
            _warm_up(order, s, inp)
            bar.update(len(order))
            seconds["warm_up"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            meter.resume()
            _timed_rounds(order, k, rounds, s, inp, timed, timed1, bar)
            meter.pause()
            seconds["timed"] += time.perf_counter() - t0
            for llm in llms.values():
                pool.stop(llm)
    bar.close()
    return Measured(reference, runs, timed, seconds, timed1, meter.other_share(), agreement)


def _start(pool, name: str, k: int, spec: dict | None, seconds: dict[str, float]):
    """Starts one engine of the pool (spec None: the reference), its start time logged and
    added to seconds["engine_start"]; returns (the engine, its start seconds)."""
    t0 = time.perf_counter()
    llm = pool.start(spec)
    dt = time.perf_counter() - t0
    seconds["engine_start"] += dt
    log.info("%s (k=%s): engine start %.1f s", label(name), k if spec else "-", dt)
    return llm, dt


def _counted_passes(pool, k: int, specs: dict[str, dict], s, inp: Inputs,
                    eval_prompts: list[EvalPrompt] | None,
                    runs: dict[tuple[str, int], EngineRun], seconds: dict[str, float],
                    bar) -> tuple[dict[str, Any], EngineRun | None]:
    """Starts each speculative engine of one group and makes its counted pass before the next
    one starts (so the counters are its own) into runs[(name, k)]; the draft in the vllm layout
    at the serving k then also generates `eval_prompts`. Returns the group's engines by name
    and that eval run (None in every other group)."""
    llms, agreement = {}, None
    for name, spec in specs.items():
        llm, dt = _start(pool, name, k, spec, seconds)
        t0 = time.perf_counter()
        p = generate(llm, inp, s, counted=True)  # before the next start (its counters)
        seconds["counted"] += time.perf_counter() - t0
        bar.update()
        runs[(name, k)] = EngineRun(name, p.token_ids, counter_sum(list(p.counters.values())),
                                    dt, sum(p.seconds.values()), p.counters, p.tokens)
        if eval_prompts and (name, k) == (FORMATS[0], inp.k):
            agreement = generate_eval(llm, eval_prompts, s)
            seconds["counted"] += agreement.generate_s
            bar.update()
        llms[name] = llm
    return llms, agreement


def _warm_up(order: list[tuple[str, Any]], s, inp: Inputs) -> None:
    """The warm-up round: every engine once (and at batch 1), last first, nothing recorded."""
    for name, llm in order[::-1]:
        generate(llm, inp, s, counted=False)
        if s.batch1_prompts:
            generate_single(llm, inp, s)


def _timed_rounds(order: list[tuple[str, Any]], k: int, rounds: int, s, inp: Inputs,
                  timed: dict[tuple[str, int], list[Pass]],
                  timed1: dict[tuple[str, int], list[Pass]], bar) -> None:
    """`rounds` timed rounds over `order`, reversed every other round, each pass without the
    garbage collector, into timed[(name, k)] (and at batch 1, timed1[(name, k)])."""
    for r in range(rounds):
        for name, llm in (order if r % 2 == 0 else order[::-1]):
            with no_gc():
                timed.setdefault((name, k), []).append(
                    generate(llm, inp, s, counted=False))
            if s.batch1_prompts:
                with no_gc():
                    timed1.setdefault((name, k), []).append(
                        generate_single(llm, inp, s))
            bar.update()


