"""The stage runner: what every DVC stage script does, done once.

A stage script is a few lines:

    from eagle3pipe.stages import runner as stage
    from eagle3pipe.stages import vocab
    if __name__ == "__main__":
        stage.main("vocab", vocab.run, paths=("dataset", "verifier_config", "out"))

`main` parses `--params`, `--dvc-yaml`, `--no-progress` and one `--<path>` option per declared
path (underscores spelled as dashes), records the run ($EAGLE3PIPE_RUN_LOG), loads params.yaml
once into a view that refuses keys dvc.yaml does not declare for the stage (`for_stage`), sets up
logging, calls the library's typed `run(params, paths) -> metrics`, and writes the metrics to
`--metrics` when the stage declares that path. Every eagle3pipe.errors.Error becomes one report
on stderr (file:line:key and the fix) and exit code errors.EXIT_CODE, and so does a full disk
(ENOSPC / EDQUOT from any writer: it names the output on the fullest filesystem and its free
space; atomic outputs mean nothing partial was published); nothing else is caught. The stage
process dies with its launcher (runtime.bind_to_launcher).
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ruamel.yaml import YAML

from eagle3pipe.config import params as P
from eagle3pipe.errors import EXIT_CODE, Error
from eagle3pipe.runtime.atomic import bind_to_launcher
from eagle3pipe.runtime.disk import disk_full, free_bytes
from eagle3pipe.runtime.jsonio import write_json


def record_run(stage: str) -> None:
    """Appends the stage name to $EAGLE3PIPE_RUN_LOG, if set: the tests' record of which stage
    commands DVC really executed (as opposed to skipped or restored from its run-cache)."""
    log = os.environ.get("EAGLE3PIPE_RUN_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(stage + "\n")


class UndeclaredParamError(Error, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


_READS: dict[str, set[str]] = {}


def _trace_reads() -> None:
    """$EAGLE3PIPE_PARAMS_TRACE: the keys each stage really read (tests check none is unread)."""
    out = os.environ.get("EAGLE3PIPE_PARAMS_TRACE")
    if out and _READS:
        with open(out, "a") as fh:
            for stage, keys in sorted(_READS.items()):
                fh.write(json.dumps({"stage": stage, "keys": sorted(keys)}) + "\n")


atexit.register(_trace_reads)


class StageView:
    """Attribute access into Params that raises for keys the stage did not declare."""

    def __init__(self, obj: Any, stage: str, declared: frozenset[str], prefix: str = "",
                 root: Any = None):
        self._obj, self._stage, self._declared, self._prefix = obj, stage, declared, prefix
        self._root = obj if root is None else root

    def _allowed(self, key: str) -> bool:
        return any(key == d or key.startswith(d + ".") for d in self._declared)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        key = self._prefix + name
        value = getattr(self._obj, name)
        if dataclasses.is_dataclass(value):
            if self._allowed(key) or any(d.startswith(key + ".") for d in self._declared):
                return StageView(value, self._stage, self._declared, key + ".", self._root)
        elif self._allowed(key):
            _READS.setdefault(self._stage, set()).add(key)
            return value
        raise UndeclaredParamError(
            f"stage '{self._stage}' read params key '{key}', which dvc.yaml does not declare "
            f"for it; add `- {key}` under stages.{self._stage}.params in dvc.yaml")

    # the view's own names below must not be params keys (tests/test_params.py checks)
    @property
    def params_file(self) -> str:
        """The params file this view was loaded from."""
        return P.source_of(self._root)

    @property
    def key_lines(self) -> dict[str, int | None]:
        """Line numbers of every loaded key (for error messages; reading them reads no value)."""
        return getattr(self._root, "_lines", {})

    def where(self, key: str) -> str:
        """'params.yaml:LINE' for a dotted key, for error messages."""
        line = self.key_lines.get(key)
        return self.params_file + (f":{line}" if line else "")

    def for_validation(self, section: str) -> Any:
        """A whole section for a cross-check that can only refuse, never change an output (the
        verifier stage checks the verifier against `draft` before building it). Such reads are
        not inputs of the stage, so they are not recorded and need no declaration."""
        return getattr(self._root, section)


def declared_params(stage: str, dvc_yaml: str | os.PathLike = "dvc.yaml") -> frozenset[str]:
    doc = YAML(typ="safe").load(Path(dvc_yaml).read_text())
    try:
        entries = doc["stages"][stage].get("params", [])
    except KeyError:
        raise Error(f"{dvc_yaml}: no stage named '{stage}'") from None
    keys: set[str] = set()
    for entry in entries:
        if isinstance(entry, str):
            keys.add(entry)
        elif isinstance(entry, dict):  # {params.yaml: [keys]}
            for v in entry.values():
                keys.update(v or [])
    return frozenset(keys)


def for_stage(stage: str, params_file: str | os.PathLike = "params.yaml",
              dvc_yaml: str | os.PathLike = "dvc.yaml") -> StageView:
    """The params a DVC stage may read: validated, and limited to its declared keys."""
    return StageView(P.load(params_file), stage, declared_params(stage, dvc_yaml))


class Paths(argparse.Namespace):
    """The stage's declared paths as Path objects, plus `progress` (False with --no-progress)."""

    progress: bool


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
    out = Paths(progress=not a.no_progress, **{n: getattr(a, n) for n in paths})
    return a, out


def main(stage: str, run: Callable[[StageView, Paths], dict | None], *,
         paths: tuple[str, ...], argv: list[str] | None = None, doc: str | None = None,
         exit: bool = True) -> int:
    """Runs one stage; returns (or exits with) 0, or errors.EXIT_CODE on an Error."""
    if argv is None:  # this process is the stage (its command line): it dies with its launcher
        bind_to_launcher()
    a, p = parse(stage, paths, argv, doc)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {stage}: %(message)s",
                        stream=sys.stderr)
    record_run(stage)
    try:
        try:
            view = for_stage(stage, a.params, a.dvc_yaml)
            plan_check(stage, a.params, getattr(p, "out", None))
            metrics = run(view, p)
            if "metrics" in paths:
                write_json(p.metrics, metrics)
        except Exception as e:
            if isinstance(e, Error) or not disk_full(e):
                raise
            raise no_space(stage, e, outputs_of(stage, a.dvc_yaml, p)) from None
        code = 0
    except Error as e:
        print(f"{stage}: error: {e}", file=sys.stderr)
        code = EXIT_CODE
    if exit:
        sys.exit(code)
    return code


def plan_check(stage: str, params_file: str | os.PathLike, out: Path | None) -> None:
    """`eagle3pipe plan`'s row for this stage at the start of its log, and a refusal (before
    any compute) when its output would not fit on the free disk where it is written. Like
    for_validation, the plan reads the whole params file; it changes no output."""
    from eagle3pipe.tools import plan

    lines, problem = plan.stage_report(stage, params_file, out)
    for line in lines:
        logging.getLogger(f"eagle3pipe.{stage}").info("%s", line)
    if problem:
        raise Error(problem)


def outputs_of(stage: str, dvc_yaml: str | os.PathLike, p: Paths) -> list[Path]:
    """What the stage writes: its --out, --metrics and --plots paths, then the outs, metrics
    and plots dvc.yaml lists for it (train's dvclive directory is only there)."""
    outs = [getattr(p, n) for n in ("out", "metrics", "plots") if getattr(p, n, None)]
    try:
        body = YAML(typ="safe").load(Path(dvc_yaml).read_text())["stages"][stage]
        outs += [Path(o if isinstance(o, str) else next(iter(o)))
                 for kind in ("outs", "metrics", "plots") for o in body.get(kind) or []]
    except Exception:  # noqa: BLE001 - only to name paths in an error message
        pass
    return list(dict.fromkeys(outs))


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def no_space(stage: str, exc: BaseException, outputs: list[Path]) -> Error:
    """The report for a full disk: the output on the filesystem with the least space free
    (measured after the atomic writer removed its partial output), the failing file when the
    error names one, and the fix."""
    failed = next((e.filename for e in (exc, exc.__cause__, exc.__context__)
                   if isinstance(e, OSError) and e.filename), None)
    where = min(outputs or [Path(failed or ".")], key=lambda o: free_bytes(o)[1])
    fs, free = free_bytes(where)
    also = f"; the write that failed: {failed}" if failed else ""
    return Error(f"no space left on device writing {where} ({fs} has {_size(free)} free now "
                 f"that the partial output is removed; nothing was published{also})",
                 fix=f"free space on that filesystem, or put {where} on a larger one "
                 f"(`eagle3pipe plan` prints the disk each stage writes); then rerun "
                 f"`dvc repro {stage}`")
