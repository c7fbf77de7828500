"""How the train stage's processes start: torchrun's command line for each node, from the params'
`train` section (nproc_per_node, nnodes, rdzv_endpoint).

dvc.yaml runs `python stages/train.py ...`. One process on one node (the default) trains in that
process: torchrun's agent would add a process and its start-up (~4 s of CPU on a 2-core machine)
and change no byte. For several processes or nodes that process (node 0) replaces itself with
torchrun (os.execvp: the same pid, so it still dies with DVC, and torchrun's workers with it),
which starts the workers that train. One node: `torchrun --standalone`. Several: torchrun's static
rendezvous with node 0 at train.rdzv_endpoint (`--nnodes N --node-rank R --master-addr host
--master-port port`), so global rank 0, the one process that publishes, is always on the node
DVC runs on; every other node runs the same command with its own `--node-rank`
(`eagle3pipe launch` prints it, or writes a Slurm batch script that runs it). Mirrors torchrun's
own options (torch/distributed/run.py); nothing here talks to the network.
"""
from __future__ import annotations

import os
import shlex
import sys

# set by torchrun in every worker it starts (torch.distributed.elastic's agent)
WORKER_ENV = "TORCHELASTIC_RUN_ID"


def under_torchrun() -> bool:
    """This process is a torchrun worker (not the stage's own command line)."""
    return WORKER_ENV in os.environ or "LOCAL_RANK" in os.environ


def needs_torchrun(t) -> bool:
    """The params' train section asks for more than one training process."""
    return t.nnodes > 1 or t.nproc_per_node > 1


def torchrun_argv(t, node_rank: int, script: list[str]) -> list[str]:
    """torchrun's command line for node `node_rank` running `script` (the stage script and its
    arguments); `t` is the params' train section."""
    if t.nnodes == 1:
        return ["torchrun", "--standalone", "--nproc-per-node", str(t.nproc_per_node), *script]
    host, _, port = t.rdzv_endpoint.rpartition(":")
    return ["torchrun", "--nnodes", str(t.nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(t.nproc_per_node), "--master-addr", host,
            "--master-port", port, *script]


def exec_torchrun(t, script: list[str]) -> None:
    """Replaces this process with torchrun as node 0 (never returns); the venv's torchrun,
    beside this interpreter, when there is one."""
    argv = torchrun_argv(t, 0, script)
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if os.access(beside, os.X_OK):
        argv[0] = beside
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)


def node0(params, paths=None) -> None:
    """The train stage's command line as node 0: replaced by torchrun running the same script
    with the same arguments (`params` is the stage's params view). Never returns."""
    exec_torchrun(params.train, sys.argv)


def command(argv: list[str]) -> str:
    """A command line as a shell would read it."""
    return shlex.join(argv)


def slurm_script(t, script: list[str], *, workdir: str) -> str:
    """A Slurm batch script for nodes 1 .. nnodes-1 (node 0 is the one `dvc repro` runs on):
    one task per node, each node's rank from SLURM_NODEID."""
    others = t.nnodes - 1
    argv = torchrun_argv(t, 0, script)
    rank = argv.index("--node-rank") + 1
    line = command(argv[:rank]) + ' "$((SLURM_NODEID + 1))" ' + command(argv[rank + 1:])
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes={others}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --job-name=eagle3pipe-train-nodes-1-{others}",
        f"# the train stage's nodes 1..{others} of {t.nnodes}; node 0 runs `dvc repro train` "
        f"and is reached at {t.rdzv_endpoint}",
        f"cd {shlex.quote(workdir)}",
        f"srun bash -c {shlex.quote(line)}",
        ""])
