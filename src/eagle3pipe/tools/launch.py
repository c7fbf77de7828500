"""`eagle3pipe launch`: the train stage's command for the nodes other than the one `dvc repro`
runs on (train.nnodes > 1), from the same params and dvc.yaml, or a Slurm batch script that runs
it on them. The command itself comes from eagle3pipe.runtime.launch, which node 0's stage
process uses too, so the nodes cannot disagree on the launch."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from eagle3pipe.config import dvcfile
from eagle3pipe.config.schema import TrainParams
from eagle3pipe.errors import Error
from eagle3pipe.runtime import launch


def stage_script(dvc_yaml: str | os.PathLike = "dvc.yaml") -> list[str]:
    """The train stage's script and its arguments, from its cmd in dvc.yaml (`python
    stages/train.py ...`), with the params file as dvc.yaml names it."""
    cmd = dvcfile.stage("train", dvc_yaml)["cmd"]
    argv = shlex.split(cmd)
    if len(argv) < 2 or Path(argv[0]).name not in ("python", "python3"):
        raise Error(f"{dvc_yaml}: stages.train.cmd is {cmd!r}, not `python stages/train.py ...`",
                    fix="restore the train stage's cmd from the repository's dvc.yaml")
    return argv[1:]


def node_commands(t: TrainParams, script: list[str], node_rank: int | None = None
                  ) -> dict[int, str]:
    """torchrun's command line by node rank: the given one, or every node but 0."""
    if t.nnodes == 1:
        raise Error("train.nnodes is 1: `dvc repro train` runs every training process on this "
                    "node; there is nothing to launch elsewhere",
                    fix="set train.nnodes (and train.rdzv_endpoint) in params.yaml to train "
                    "across nodes")
    ranks = range(1, t.nnodes) if node_rank is None else [node_rank]
    for r in ranks:
        if not 0 < r < t.nnodes:
            raise Error(f"--node-rank {r} is not one of the other nodes 1..{t.nnodes - 1} "
                        f"(train.nnodes {t.nnodes}; node 0 is the one `dvc repro` runs on)",
                        fix=f"pass a rank from 1 to {t.nnodes - 1}")
    return {r: launch.command(launch.torchrun_argv(t, r, script)) for r in ranks}
