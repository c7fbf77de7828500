"""Decode speed of the smoke stage's methods, for metrics/smoke_timing.json (wall clock: not
deterministic, so neither a stage output nor hashed in dvc.lock).

A Pass is one generation of the whole prompt set by one engine, timed per domain. The stage
runs every method in the same rounds, alternating their order, so that other work on the
machine slows every method alike; CpuMeter measures how much CPU other processes took meanwhile
(the timings say little above BUSY). speed() gives output tokens/s and ms per output token as
median, min and max over the rounds, speedup() each method's ratio to the non-speculative
reference of the same rounds, timing_of() the whole file.
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
    """Median tokens/s over the reference's median tokens/s of the same rounds (`median`), the
    min and max of the per-round ratios (pass r of both was timed in round r), and the ratio
    of the fastest passes (`best`: other work only ever slows a pass down)."""
    def tps(p: Pass) -> float:
        ds = domains or list(p.seconds)
        sec = sum(p.seconds[d] for d in ds)
        return sum(p.tokens[d] for d in ds) / sec if sec > 0 else 0.0

    a, b = [tps(p) for p in passes], [tps(p) for p in ref]
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    med_b = statistics.median(b)
    return {"median": _sig(statistics.median(a) / med_b) if med_b else 0.0,
            "min": _sig(min(ratios)) if ratios else 0.0,
            "max": _sig(max(ratios)) if ratios else 0.0,
            "best": _sig(max(a) / max(b)) if max(b) else 0.0}


def timing_of(s, inp: Any, m: Any, *, swept: tuple[str, ...], stage_seconds: float,
              metrics_sha256: str) -> dict:
    """metrics/smoke_timing.json: speed of every method at the serving k (overall and by
    domain), speedup and acceptance-free speed per k of the sweep, the best k, where the time
    went. Flat `speedup` and `output_tokens_per_s` maps for `dvc metrics show`. `s` is the
    params' smoke section, `inp` the smoke stage's Inputs (k, prompts, source, domains, sweep),
    `m` its Measured (timed passes by (method, k), seconds, other processes' CPU share),
    `swept` the methods the k sweep runs."""
    k = inp.k
    ref = m.timed[(REFERENCE, k)]
    methods: dict[str, dict] = {REFERENCE: speed(ref)}
    for (name, kk), passes in m.timed.items():
        if kk == k and name != REFERENCE:
            methods[name] = {**speed(passes), "speedup": speedup(passes, ref)}
    out: dict[str, Any] = {
        "num_speculative_tokens": k,
        "timing_rounds": s.timing_rounds,
        "num_prompts": len(inp.prompts),
        "max_tokens": s.max_tokens,
        "prompts": inp.source,
        "methods": methods,
        "speedup": {n: r["speedup"]["median"] for n, r in methods.items() if "speedup" in r},
        "output_tokens_per_s": {n: r["output_tokens_per_s"]["median"]
                                for n, r in methods.items()},
        "ms_per_output_token": {n: r["ms_per_output_token"]["median"]
                                for n, r in methods.items()},
    }
    if len(inp.domains) > 1 or inp.source != STDLIB_SOURCE:
        out["domains"] = {
            d: {name: {**speed(m.timed[(name, k)], [d]),
                       **({"speedup": speedup(m.timed[(name, k)], ref, [d])}
                          if name != REFERENCE else {})}
                for name in methods}
            for d in inp.domains}
    if inp.sweep:
        sweep: dict[str, dict] = {}
        for kk in inp.sweep:
            ref_k = m.timed[(REFERENCE, kk)]
            sweep[str(kk)] = {name: {**speed(m.timed[(name, kk)]),
                                     "speedup": speedup(m.timed[(name, kk)], ref_k)}
                              for name in swept}
        out["k_sweep"] = sweep
        out["best_k"] = {}
        for name in swept:
            best = max(inp.sweep, key=lambda kk: sweep[str(kk)][name]["speedup"]["median"])
            out["best_k"][name] = {"k": best,
                                   "speedup": sweep[str(best)][name]["speedup"]["median"]}
        # the serving default beside the recommendation (params are never rewritten)
        out["best_k"]["serving_k"] = k
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
