"""Where the train stage runs: the process group (torchrun), this process's rank and device, the
backend choices per device (attention, loss kernel, autocast, micro-batching) and the one
collective the loop needs (a sum). eagle3pipe.stages.train.run holds the training itself.

Mirrors speculators/train/distributed.py (`maybe_setup_distributed`: init from the torchrun
environment, `maybe_destroy_distributed`) and the DDP branch of speculators' Trainer.setup_model
(speculators/train/trainer.py: `_setup_model_ddp`, `_all_reduce_metrics`), without FSDP,
sequence parallelism or the torch.accelerator abstraction; CPU runs never touch
torch.distributed.

Several processes: dvc.yaml's train cmd launches the stage script under torchrun with
`train.nproc_per_node` processes (WORLD_SIZE > 1): NCCL on CUDA (one GPU per process), gloo on
CPU (train.threads torch threads per process).
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch

from eagle3pipe.errors import Error

PAD_MULTIPLE = 128                # CUDA: packs trimmed to a multiple of this (flex blocks)


class DistributedError(Error, ValueError):
    """train.device and the launch (torchrun or not) do not fit together; names the fix."""


@dataclass(frozen=True)
class Dist:
    """This process: rank, world size and the device its tensors go to."""
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes (weights, metrics), as in speculators' Trainer."""
        return self.rank == 0


def setup_distributed(device: str) -> Dist:
    """Single process unless WORLD_SIZE > 1 (torchrun); then the process group is initialised
    from the torchrun environment (env://: MASTER_ADDR, RANK, WORLD_SIZE), as speculators'
    `maybe_setup_distributed` does: NCCL on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda" and not torch.cuda.is_available():
        raise DistributedError("train.device is cuda but torch sees no CUDA device; "
                               "set train.device: cpu in params.yaml or run on a GPU machine")
    if world <= 1:
        return Dist(device=torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
    import torch.distributed as dist

    if device == "cpu":
        dist.init_process_group(backend="gloo")
        return Dist(rank=dist.get_rank(), world=dist.get_world_size())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl")
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(),
                device=torch.device("cuda", local))


def wrap_model(model, d: Dist):
    """DistributedDataParallel around `model` when world > 1 (speculators' Trainer
    `_setup_model_ddp`; every rank built the same seeded init, and DDP's constructor broadcasts
    rank 0's parameters anyway), else `model` itself."""
    if d.world <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
        broadcast_buffers=False)


def all_reduce(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """In-place SUM over ranks (speculators' trainer `_all_reduce_metrics`); a no-op alone."""
    if d.world > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def largest(n: int, d: Dist) -> int:
    """The largest of each rank's n (a collective: every rank calls it); n alone."""
    if d.world <= 1:
        return n
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device=d.device)  # NCCL: on the GPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@contextmanager
def lost_peers(d: Dist) -> Iterator[None]:
    """Inside, a collective that fails because another training process died (its node lost,
    killed or out of memory: gloo and NCCL then raise on the survivors, in DDP's backward or an
    all-reduce) becomes one Error that says so, instead of a backend traceback. Outputs are
    atomic (runtime.atomic), so nothing was published and a rerun starts clean."""
    if d.world <= 1:
        yield
        return
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, Error):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"rank {d.rank} of {d.world}: a collective failed, so another training process "
            f"died or became unreachable (a node lost, killed or out of memory): {first}",
            fix="nothing was published; find the first error on the other nodes, restart "
            "each node's command (`eagle3pipe launch` prints it) and rerun `dvc repro train`"
        ) from None


def teardown(d: Dist) -> None:
    """Waits for every rank (rank 0 may still be writing) and leaves the process group
    (speculators' `maybe_destroy_distributed`)."""
    if d.world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


@dataclass(frozen=True)
class Backend:
    attn_impl: str               # transformer_layer_config._attn_implementation
    loss_impl: str               # speculators.losses implementation: eager | fused
    autocast: torch.dtype | None  # speculators' Trainer runs the model under bf16 autocast
    data_dtype: torch.dtype      # hidden states as collated (stored as bf16 by extract)
    chunk_tokens: int | None     # CPU: micro-batches of at most this many tokens per forward
    pad_multiple: int            # collated length rounded up to a multiple of this


def backend_for(device: str, cpu_chunk_tokens: int, loss_impl: str) -> Backend:
    """CPU: sdpa (flex attention has no CPU backward), the eager loss (the fused one needs
    Triton on CUDA), and every packed batch run as micro-batches of <= cpu_chunk_tokens tokens
    (train.cpu_chunk_tokens) with
    gradient accumulation: sdpa gets a dense [T, ttt*T] mask, so one long pack costs far more
    than its short pieces together (a quadratic mask; bench/README.md), all of it on
    cross-document pairs that are masked out anyway. Each micro-batch's loss is weighted by its share of loss-mask tokens, so
    the step's loss and gradient are speculators' token-weighted mean over the whole pack.
    CUDA: speculators' own defaults, one packed batch per forward (flex attention skips the
    masked blocks); the loss as train.loss_impl says (auto: the fused Triton kernel, which
    speculators' Trainer uses wherever Triton imports; eager where torch.compile cannot trace
    that kernel's backward, as torch 2.11's dynamo could not on an H200: docs/setup.md)."""
    if device == "cpu":
        if loss_impl == "fused":  # config.cross_check refuses this in params first
            raise DistributedError("train.loss_impl is fused: speculators' Triton kernel runs "
                                   "on cuda only, and train.device is cpu",
                                   fix="set train.loss_impl: eager (or auto)")
        return Backend("sdpa", "eager", torch.bfloat16, torch.bfloat16, cpu_chunk_tokens, 1)
    impl = "fused" if loss_impl == "auto" else loss_impl
    if impl == "fused":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise DistributedError(f"train.loss_impl is {loss_impl}: on cuda that is "
                                   f"speculators' fused Triton loss, and triton does not import "
                                   f"({e})", fix="install the CUDA set (`make setup` on a "
                                   "machine with an NVIDIA driver), or set train.loss_impl: "
                                   "eager") from e
    return Backend("simple_flex_attention", impl, torch.bfloat16, torch.bfloat16, None,
                   PAD_MULTIPLE)


def autocast(backend: Backend, d: Dist):
    """The forward's autocast context (bf16, as speculators' Trainer), or none."""
    if backend.autocast is None:
        return nullcontext()
    return torch.autocast(d.device.type, dtype=backend.autocast)
