"""The stage runner: what every DVC stage script does, done once.

A stage script is a few lines:

    from eagle3pipe.stages import runner

    from eagle3pipe.stages.vocab import run as vocab
    if __name__ == "__main__":
        runner.main("vocab", vocab.run, paths=("dataset", "verifier_config", "out"))

`main` parses `--params`, `--dvc-yaml`, `--no-progress` and one `--<path>` option per declared
path (underscores spelled as dashes), records the run ($EAGLE3PIPE_RUN_LOG), loads params.yaml
once into a view that refuses keys dvc.yaml does not declare for the stage
(eagle3pipe.config.view.for_stage), sets up logging, with `estimate=True` (every stage but
configs and vocab) logs the stage's estimate and refuses before any compute an output that
cannot fit on the free disk (eagle3pipe.estimates.check), calls the stage's typed
`run(params, paths) -> metrics`, and writes the metrics to `--metrics` when the stage declares
that path. Every eagle3pipe.errors.Error becomes one report on stderr (file:line:key and the
fix) and exit code errors.EXIT_INPUT, and so does a full disk (ENOSPC / EDQUOT from any writer:
it names the output on the fullest filesystem and its free space; atomic outputs mean nothing
partial was published); nothing else is caught. The stage process dies with its launcher
(eagle3pipe.runtime.atomic.bind_to_launcher).

The estimates are refuse-only: the runner imports eagle3pipe.estimates and finds the stage's
estimate by the stage's name (estimates.stages.ESTIMATES); an estimate logs lines or refuses
the run before `run` starts, and never changes an output byte. So the deps tool leaves that
package out of every stage's import closure (eagle3pipe.tools.deps.REFUSE_ONLY) and lets no
module but this one import it: editing a memory or disk formula reruns no stage
(tests/test_deps.py proves it with `dvc status`).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from eagle3pipe.config import dvcfile
from eagle3pipe.config.view import StageView, for_stage
from eagle3pipe.errors import EXIT_INPUT, EXIT_OK, Error
from eagle3pipe.estimates.check import check as check_estimate
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.atomic import bind_to_launcher
from eagle3pipe.runtime.disk import disk_full, free_bytes
from eagle3pipe.runtime.jsonio import write_json
from eagle3pipe.runtime.units import human


def record_run(stage: str) -> None:
    """Appends the stage name to $EAGLE3PIPE_RUN_LOG, if set: the tests' record of which stage
    commands DVC really executed (as opposed to skipped or restored from its run-cache)."""
    environment.append_line(environment.RUN_LOG, stage)


class Paths(argparse.Namespace):
    """The stage's declared paths as Path objects, plus `progress` (False with --no-progress)
    and `dvc_yaml` (the stage graph, where the stage's undeclared-output files are named)."""

    progress: bool
    dvc_yaml: Path


def parse(stage: str, paths: tuple[str, ...], argv: list[str] | None, doc: str | None
          ) -> tuple[argparse.Namespace, Paths]:
    ap = argparse.ArgumentParser(prog=f"stages/{stage}.py", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc-yaml", default="dvc.yaml",
                    help="the stage graph that declares which params keys this stage may read")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    for name in paths:
        ap.add_argument("--" + name.replace("_", "-"), dest=name, required=True, type=Path)
    a = ap.parse_args(argv)
    out = Paths(progress=not a.no_progress, dvc_yaml=Path(a.dvc_yaml),
                **{n: getattr(a, n) for n in paths})
    return a, out


def main(stage: str, run: Callable[[StageView, Paths], dict | None], *,
         paths: tuple[str, ...], estimate: bool = False,
         argv: list[str] | None = None, doc: str | None = None, exit: bool = True) -> int:
    """Runs one stage; returns (or exits with) EXIT_OK, or EXIT_INPUT on an Error. With
    estimate, the stage's estimate (eagle3pipe.estimates.stages.ESTIMATES[stage]) is logged and
    checked against the free disk before `run` (train's command checks it before it becomes
    torchrun, and each torchrun worker again)."""
    if argv is None:  # this process is the stage (its command line): it dies with its launcher
        bind_to_launcher()
    a, p = parse(stage, paths, argv, doc)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {stage}: %(message)s",
                        stream=sys.stderr)
    record_run(stage)
    try:
        try:
            view = for_stage(stage, a.params, a.dvc_yaml)
            if estimate:
                check_estimate(stage, a.params, getattr(p, "out", None))
            metrics = run(view, p)
            if "metrics" in paths:
                write_json(p.metrics, metrics)
        except Exception as e:
            if isinstance(e, Error) or not disk_full(e):
                raise
            raise no_space(stage, e, outputs_of(stage, a.dvc_yaml, p)) from None
        code = EXIT_OK
    except Error as e:
        print(f"{stage}: error: {e}", file=sys.stderr)
        code = EXIT_INPUT
    if exit:
        sys.exit(code)
    return code


def outputs_of(stage: str, dvc_yaml: str | os.PathLike, p: Paths) -> list[Path]:
    """What the stage writes: its --out, --metrics and --plots paths, then the outs, metrics
    and plots dvc.yaml lists for it (train's dvclive directory is only there)."""
    outs = [getattr(p, n) for n in ("out", "metrics", "plots") if getattr(p, n, None)]
    try:
        outs += [Path(o) for o in dvcfile.outputs(dvcfile.stage(stage, dvc_yaml))]
    except Error:  # only to name paths in an error message
        pass
    return list(dict.fromkeys(outs))


def no_space(stage: str, exc: BaseException, outputs: list[Path]) -> Error:
    """The report for a full disk: the output on the filesystem with the least space free
    (measured after the atomic writer removed its partial output), the failing file when the
    error names one, and the fix."""
    failed = next((e.filename for e in (exc, exc.__cause__, exc.__context__)
                   if isinstance(e, OSError) and e.filename), None)
    where = min(outputs or [Path(failed or ".")], key=lambda o: free_bytes(o)[1])
    fs, free = free_bytes(where)
    also = f"; the write that failed: {failed}" if failed else ""
    return Error(f"no space left on device writing {where} ({fs} has {human(free)} free now "
                 f"that the partial output is removed; nothing was published{also})",
                 fix=f"free space on that filesystem, or put {where} on a larger one "
                 f"(`eagle3pipe plan` prints the disk each stage writes); then rerun "
                 f"`dvc repro {stage}`")
