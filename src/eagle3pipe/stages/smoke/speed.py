"""Decode speed of the smoke stage's methods, for metrics/smoke_timing.json (wall clock: not
deterministic, so neither a stage output nor hashed in dvc.lock).

A Pass is one generation of the prompt set by one engine: at the smoke batch (the prompts of a
domain in one call), or one request at a time (batch 1). The stage runs every method in the
same rounds, alternating their order, so that other work on the machine slows every method
alike; CpuMeter measures how much CPU other processes took meanwhile (the timings say little
above BUSY). speed() gives output tokens/s and ms per output token as median, min and max over
the rounds, speedup() each method's per-round ratio to the non-speculative reference of the
same round, at_batch() the figures of one batch size, timing_of() the whole file.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from eagle3pipe.data.prompts import STDLIB_SOURCE

REFERENCE = "non-speculative"  # the method every speedup is relative to
BUSY = 0.15  # other processes' CPU share above which the timings are flagged unreliable


@dataclass
class Pass:
    """One generation of the whole prompt set by one engine: one batch per domain."""
    token_ids: list[list[int]]  # in prompt order
    seconds: dict[str, float]  # by domain
    tokens: dict[str, int]  # output tokens by domain
    counters: dict[str, dict] = field(default_factory=dict)  # by domain (the counted pass)


class CpuMeter:
    """How much CPU time other processes took while it ran (resumed .. paused, possibly several
    times): all busy CPU time (/proc/stat) minus this process's own (getrusage; with `children`,
    also its waited-for children's), as a share of wall time x cores. Two threads on few cores:
    any other work stalls them, and the timings say little above ~15% (BUSY). bench/ uses it
    too."""

    def __init__(self, *, children: bool = False):
        self.wall = self.other = 0.0
        self.children = children
        self._at: tuple[float, float, float] | None = None
        self.available = self._busy() is not None

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as fh:
                f = [int(x) for x in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
        return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _own(self) -> float:
        import resource

        who = [resource.RUSAGE_SELF] + ([resource.RUSAGE_CHILDREN] if self.children else [])
        return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, who))

    def resume(self) -> "CpuMeter":
        if self.available:
            self._at = (time.perf_counter(), self._busy() or 0.0, self._own())
        return self

    def pause(self) -> None:
        if self._at is None:
            return
        t0, busy0, own0 = self._at
        self.wall += time.perf_counter() - t0
        self.other += max(0.0, ((self._busy() or 0.0) - busy0) - (self._own() - own0))
        self._at = None

    def other_share(self) -> float | None:
        """Other processes' share so far (a running meter keeps running)."""
        if self._at is not None:
            self.pause()
            self.resume()
        if not self.available or self.wall <= 0:
            return None
        return round(self.other / (self.wall * (os.cpu_count() or 1)), 3)


def _sig(x: float, n: int = 4) -> float:
    return float(f"{x:.{n}g}")


def spread(values: list[float]) -> dict:
    """Median, min and max (4 significant digits)."""
    return {"median": _sig(statistics.median(values)), "min": _sig(min(values)),
            "max": _sig(max(values))}


def speed(passes: list[Pass], domains: list[str] | None = None) -> dict:
    """Output tokens/s and ms per output token of each timed pass (over `domains`, default
    all), as median, min and max, and the pass seconds."""
    tps, secs = [], []
    for p in passes:
        ds = domains or list(p.seconds)
        sec, tok = sum(p.seconds[d] for d in ds), sum(p.tokens[d] for d in ds)
        secs.append(sec)
        tps.append(tok / sec if sec > 0 else 0.0)
    return {"output_tokens_per_s": spread(tps),
            "ms_per_output_token": spread([1000.0 / t if t else 0.0 for t in tps]),
            "seconds": [_sig(x) for x in secs]}


def speedup(passes: list[Pass], ref: list[Pass], domains: list[str] | None = None) -> dict:
    """Each round's ratio of tokens/s to the reference's in the same round (pass r of both was
    timed in round r, next to each other): their median (`median`), min and max, and the ratio
    of the fastest passes (`best`: other work only ever slows a pass down). Pairing by round
    cancels what drifts between rounds (another process, the CPU's clock); a ratio of medians
    would not."""
    def tps(p: Pass) -> float:
        ds = domains or list(p.seconds)
        sec = sum(p.seconds[d] for d in ds)
        return sum(p.tokens[d] for d in ds) / sec if sec > 0 else 0.0

    a, b = [tps(p) for p in passes], [tps(p) for p in ref]
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    return {"median": _sig(statistics.median(ratios)) if ratios else 0.0,
            "min": _sig(min(ratios)) if ratios else 0.0,
            "max": _sig(max(ratios)) if ratios else 0.0,
            "best": _sig(max(a) / max(b)) if max(b) else 0.0}


def at_batch(timed: dict[tuple[str, int], list[Pass]], k: int, sweep: list[int],
             swept: tuple[str, ...]) -> dict:
    """The figures of one batch size: every method's speed at the serving k (`methods`, the
    flat `speedup`, `output_tokens_per_s` and `ms_per_output_token` maps), and with a sweep
    the swept methods' speed per k (`k_sweep`) and the k of the best median speedup
    (`best_k`). `timed` holds the passes of that batch size by (method, k)."""
    ref = timed[(REFERENCE, k)]
    methods: dict[str, dict] = {REFERENCE: speed(ref)}
    for (name, kk), passes in timed.items():
        if kk == k and name != REFERENCE:
            methods[name] = {**speed(passes), "speedup": speedup(passes, ref)}
    out: dict[str, Any] = {
        "methods": methods,
        "speedup": {n: r["speedup"]["median"] for n, r in methods.items() if "speedup" in r},
        "output_tokens_per_s": {n: r["output_tokens_per_s"]["median"]
                                for n, r in methods.items()},
        "ms_per_output_token": {n: r["ms_per_output_token"]["median"]
                                for n, r in methods.items()},
    }
    if sweep:
        by_k: dict[str, dict] = {}
        for kk in sweep:
            ref_k = timed[(REFERENCE, kk)]
            by_k[str(kk)] = {name: {**speed(timed[(name, kk)]),
                                    "speedup": speedup(timed[(name, kk)], ref_k)}
                             for name in swept}
        out["k_sweep"] = by_k
        out["best_k"] = {}
        for name in swept:
            best = max(sweep, key=lambda kk: by_k[str(kk)][name]["speedup"]["median"])
            out["best_k"][name] = {"k": best,
                                   "speedup": by_k[str(best)][name]["speedup"]["median"]}
        # the serving default beside the recommendation (params are never rewritten)
        out["best_k"]["serving_k"] = k
    return out


def timing_of(s, inp: Any, m: Any, *, swept: tuple[str, ...], stage_seconds: float,
              metrics_sha256: str) -> dict:
    """metrics/smoke_timing.json: at the smoke batch (every prompt of a domain in one call) and,
    under `batch_1`, one request at a time (the first smoke.batch1_prompts prompts): every
    method's speed and speedup at the serving k (at the smoke batch also by domain), the k
    sweep and the best k (at_batch); where the time went. `s` is the params' smoke section,
    `inp` the smoke stage's Inputs (k, prompts, source, domains, sweep), `m` its Measured
    (timed passes by (method, k) of both batch sizes, seconds, other processes' CPU share),
    `swept` the methods the k sweep runs."""
    k = inp.k
    out: dict[str, Any] = {
        "num_speculative_tokens": k,
        "timing_rounds": s.timing_rounds,
        "num_prompts": len(inp.prompts),
        "batch_size": max(len(idx) for idx in inp.domains.values()),
        "max_tokens": s.max_tokens,
        "prompts": inp.source,
        **at_batch(m.timed, k, inp.sweep, swept),
    }
    if len(inp.domains) > 1 or inp.source != STDLIB_SOURCE:
        ref = m.timed[(REFERENCE, k)]
        out["domains"] = {
            d: {name: {**speed(m.timed[(name, k)], [d]),
                       **({"speedup": speedup(m.timed[(name, k)], ref, [d])}
                          if name != REFERENCE else {})}
                for name in out["methods"]}
            for d in inp.domains}
    if m.timed_batch1:
        first = next(iter(m.timed_batch1.values()))[0]
        out["batch_1"] = {"num_prompts": len(first.token_ids),
                          **at_batch(m.timed_batch1, k, inp.sweep, swept)}
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    out["seconds"] = {"stage": _sig(stage_seconds),
                      **{n: _sig(v) for n, v in m.seconds.items()}}
    share = m.other_cpu_share
    out["machine"] = {"cpu_count": os.cpu_count(), "loadavg_at_end": load,
                      "other_processes_cpu_share": share,
                      "busy_warning": None if share is None or share <= BUSY else
                      f"other processes took {share:.0%} of the CPU during the timed rounds: "
                      "the timings are unreliable (rerun `dvc repro -f -s smoke` on a quiet "
                      "machine)"}
    out["smoke_metrics_sha256"] = metrics_sha256
    return out
