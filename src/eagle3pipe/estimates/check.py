"""The stage runner's step before a stage's `run`: the stage's estimate
(eagle3pipe.estimates.stages) at the start of its log, and a refusal, before any compute, of an
output that would not fit on the free disk where it is written.

It reads params.yaml and the verifier's config.json, logs, and raises an Error or returns: it
never changes an output byte. That is why no stage's code deps list this package
(eagle3pipe.tools.deps.REFUSE_ONLY) and editing a formula here reruns no stage.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from eagle3pipe.config import params as P
from eagle3pipe.errors import Error, Problem
from eagle3pipe.estimates.figures import Estimate, cuda_available, figures
from eagle3pipe.estimates.stages import ESTIMATES
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.disk import free_bytes
from eagle3pipe.runtime.units import human
from eagle3pipe.verifier.handle import VerifierConfigError, find_config

def disk_problem(bytes_needed: int, path: str | Path, key: str) -> Problem | None:
    """The problem when `bytes_needed` exceed the free disk where `path` (or its nearest
    existing parent) lives; None when it fits. $EAGLE3PIPE_FREE_BYTES stands in for the measured
    free space."""
    where, free = free_bytes(path)
    what_if = environment.size(environment.FREE_BYTES, unset="the measured free space")
    free = free if what_if is None else what_if
    if bytes_needed <= free:
        return None
    return Problem(str(path), None, key, f"needs {human(bytes_needed)} but {where} has "
                   f"{human(free)} free", f"free disk there, put {path} on a larger disk, or "
                   f"lower {key}")


def line(e: Estimate, gpu: bool) -> str:
    return (f"estimate ({'GPU' if gpu else 'CPU'}): {e.engine}, {e.processes} process(es), "
            f"tokens {e.tokens if e.tokens is not None else '-'}, disk {human(e.disk_bytes)}, "
            f"memory/device {human(e.device_bytes)}, host {human(e.host_bytes)}")


def check(stage: str, params_file: str | os.PathLike, out: Path | None) -> None:
    """Logs the stage's estimate and refuses an output that would not fit on the free disk where
    it is written. Like for_validation, it reads the whole params file; it changes no output.
    Nothing to estimate from before the verifier stage built the embedded verifier, nor from a
    verifier config on disk that the draft params do not fit: the verifier stage runs before the
    configs stage renders that file for the params, and each stage's own checks refuse real
    misfits."""
    estimate = ESTIMATES[stage]
    params = P.load(params_file)
    log = logging.getLogger(f"eagle3pipe.{stage}")
    try:
        cfg = find_config(params.verifier.path)
    except VerifierConfigError:
        return
    try:
        f = figures(params, cfg, cuda_available())
    except Error as err:
        why = (f"{err.problems[0].key}: {err.problems[0].message}" if err.problems
               else (str(err).splitlines() or [type(err).__name__])[0])
        log.info("estimate: skipped (%s does not fit the draft params yet: %s)", cfg, why)
        return
    e = estimate(params, f)
    for text in [line(e, f.gpu)] + [f"estimate: {n}" for n in e.notes]:
        log.info("%s", text)
    problem = disk_problem(e.disk_bytes, out, e.sized_by or stage) \
        if out is not None and e.disk_bytes else None
    if problem:
        raise Error(problems=[problem])
