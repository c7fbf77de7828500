"""The params a stage may read: a view of the validated params that refuses every key dvc.yaml
does not declare for the stage (so an undeclared read fails instead of producing a stale output),
records what it read ($EAGLE3PIPE_PARAMS_TRACE, for the tests) and names a key's file and line
for error messages.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
from typing import Any

from eagle3pipe.config import dvcfile
from eagle3pipe.config import params as P
from eagle3pipe.errors import Error, ParamsAt
from eagle3pipe.runtime import environment


class UndeclaredParamError(Error, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


_READS: dict[str, set[str]] = {}


def _trace_reads() -> None:
    """$EAGLE3PIPE_PARAMS_TRACE: the keys each stage really read (tests check none is unread)."""
    for stage, keys in sorted(_READS.items()):
        environment.append_line(environment.PARAMS_TRACE,
                                json.dumps({"stage": stage, "keys": sorted(keys)}))


atexit.register(_trace_reads)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Settings that say where or how big, never what is computed: vLLM's memory bounds and
    length limit, the engine's address (extract.endpoint) and call size (extract.batch_size).
    The train stage's engine in extract.mode online/hybrid reads them without a declaration
    (StageView.run_settings), so that changing one reruns nothing; what that engine computes
    is fixed by the extract stage's manifest (the numeric settings its store keys hash)."""
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    max_model_len: int | None
    trust_remote_code: bool
    cpu_omp_threads_bind: str | None
    endpoint: str | None
    batch_size: int

    VLLM = ("gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len",
            "trust_remote_code", "cpu_omp_threads_bind")  # params' vllm: names

    def vllm(self) -> dict[str, Any]:
        """The vllm: ones, by their params names (engine settings)."""
        return {k: getattr(self, k) for k in self.VLLM}


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

    @property
    def params_at(self) -> ParamsAt:
        """The params file and its keys' lines, for located problems (errors.ParamsAt)."""
        return ParamsAt(self.params_file, self.key_lines)

    def run_settings(self) -> RunSettings:
        """The RunSettings of these params, read without a declaration (see RunSettings)."""
        v, e = self._root.vllm, self._root.extract
        return RunSettings(**{k: getattr(v, k) for k in RunSettings.VLLM},
                           endpoint=e.endpoint, batch_size=e.batch_size)

    def for_validation(self, section: str) -> Any:
        """A whole section for a cross-check that can only refuse, never change an output (the
        verifier stage checks the verifier against `draft` before building it). Such reads are
        not inputs of the stage, so they are not recorded and need no declaration."""
        return getattr(self._root, section)


def for_stage(stage: str, params_file: str | os.PathLike = "params.yaml",
              dvc_yaml: str | os.PathLike = "dvc.yaml") -> StageView:
    """The params a DVC stage may read: validated, and limited to its declared keys."""
    return StageView(P.load(params_file), stage, dvcfile.declared_params(stage, dvc_yaml))
