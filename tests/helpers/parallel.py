"""The micro pipeline at vLLM tensor_parallel_size 2 with 2 training processes, as a Background
job: `dvc repro` in a copy of the session's cold micro run (its DVC cache included, its
per-sample store not: every sample is computed at TP 2, as in a fresh clone) with the parallel
settings set, started with the session once the cold run ends (conftest.py's `early`) and read
by test_parallel.py. In the background it fills the core that the fault tests' last kill chain
and TP 2's own one-process stretches (vLLM's spawned workers importing) leave idle."""
from __future__ import annotations

from pathlib import Path

from .pipeline import Variant, set_param

# one core per rank (VLLM_CPU_OMP_THREADS_BIND "0|1"), train under torchrun (gloo)
PARALLEL = {"vllm.tensor_parallel_size": 2, "vllm.cpu_omp_threads_bind": "0|1",
            "train.nproc_per_node": 2, "train.threads": 1}


def _set(repo: Path) -> None:
    for key, value in PARALLEL.items():
        set_param(repo, key, value)


def job(base: Path) -> Variant:
    """The Background job (`parallel`): the copy under base."""
    return Variant("cold", base / "repo", _set)
