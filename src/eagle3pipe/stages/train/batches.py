"""The draft's training data: speculators' ArrowDataset over the extract stage's output,
packed into micro-batches of about train.batch_tokens tokens, seeded per epoch.

speculators' own trainer packs with its MultipackDistributedBatchSamplerV2 and collates with
CollateFn (speculators/train/data.py); the packing here is a deterministic first-fit over a
seeded order, so that the same params give the same batches (and bytes) on every rerun.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from eagle3pipe.draft import arch as archmod
from eagle3pipe.errors import Error
from eagle3pipe.hidden import spec
from eagle3pipe.runtime.distributed import Backend



class TrainInputError(Error, ValueError):
    """A bad input file: the message names the file, the key and the fix."""


def open_datapath(datapath: str | Path, max_len: int, dtype: torch.dtype, transfer=None):
    """speculators' ArrowDataset over a hidden-state datapath; missing files raise. `transfer`
    (on demand: eagle3pipe.hidden.online.StoreTransfer) replaces its hidden_states/ files."""
    from speculators.train.data import ArrowDataset

    p = Path(datapath)
    if transfer is None and not (p / "hidden_states").is_dir():
        raise TrainInputError(f"{p}: not a hidden-state datapath (no hidden_states/); "
                              "rerun `dvc repro extract`")
    ds = ArrowDataset(max_len, str(p), transfer=transfer, on_missing="raise",
                      hidden_states_dtype=dtype)
    if len(ds) == 0:
        raise TrainInputError(f"{p}: has no samples; check dataset.num_samples / eval_fraction")
    return ds


def check_datapath(ds, datapath: str | Path, arch: archmod.DraftArch) -> None:
    """The first sample's hidden states must have spec.num_slots() slots of the verifier's width."""
    sample = ds.transfer.get_cached(ds._map_to_file_idx(0))  # noqa: SLF001
    if sample is None:
        raise TrainInputError(f"{datapath}/hidden_states/hs_0.safetensors: missing; "
                              "rerun `dvc repro extract`")
    hs = sample["hidden_states"]
    want = (spec.num_slots(arch.aux_layer_ids), arch.target_hidden_size)
    if hs.dim() != 3 or tuple(hs.shape[1:]) != want:
        raise TrainInputError(
            f"{datapath}/hidden_states/hs_0.safetensors: hidden_states {list(hs.shape)}, the "
            f"draft needs [T, {want[0]}, {want[1]}] ({archmod.NUM_AUX} aux layers + pre-norm "
            "final, verifier hidden size); rerun `dvc repro extract`")


def pack(order: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Greedy packing in the given order: each batch holds at most batch_tokens tokens (a sample
    longer than that gets a batch of its own and is truncated by the collate function)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = max(1, lengths[i])
        if cur and used + n > batch_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Deterministic shuffled packing for one epoch (seeded torch.Generator: seed + epoch)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    return pack(order, lengths, batch_tokens)


class Batches:
    """Collates packed batches of one datapath with speculators' CollateFn (shift_batch
    preprocessing: input token t+1, hidden state t, verifier state t+1) and splits each into
    the micro-batches the backend runs (several on CPU, one on GPU)."""

    def __init__(self, ds, datapath: str | Path, collate, backend: Backend):
        self.ds, self.datapath, self.collate, self.backend = ds, Path(datapath), collate, backend
        self.lengths = [max(1, int(n) - 1) for n in ds.approx_lengths]  # shift drops one token

    def micro(self, idx: list[int]) -> list[dict[str, torch.Tensor]]:
        groups = [idx] if self.backend.chunk_tokens is None else \
            pack(idx, self.lengths, self.backend.chunk_tokens)
        return [self._collate(g) for g in groups]

    def _collate(self, idx: list[int]) -> dict[str, torch.Tensor]:
        from speculators.train.recovery import RECOVERY_METADATA_KEY

        batch = self.collate([self.ds[i] for i in idx])
        if batch.get("error_records") or RECOVERY_METADATA_KEY in batch:
            raise TrainInputError(
                f"{self.datapath}: hidden states of samples {idx} are missing or their token_ids "
                "differ from the dataset's input_ids; rerun `dvc repro extract`")
        used = int((batch["document_ids"] != -1).sum())
        m = self.backend.pad_multiple
        keep = min(batch["document_ids"].shape[1], max(m, math.ceil(used / m) * m))
        return {k: v[:, :keep] for k, v in batch.items()
                if isinstance(v, torch.Tensor) and v.dim() >= 2}


def open_split(datapath: str | Path, batch_tokens: int, arch: archmod.DraftArch,
               backend: Backend, transfer=None) -> Batches:
    """One split's Batches: its ArrowDataset (checked against the draft; on demand, with
    `transfer`, the producer checks every sample instead) and speculators' CollateFn with the
    EAGLE-3 shift_batch preprocess, as speculators' loader factory
    (speculators/train/dataloader.py) and its cli's eagle3 preprocess choose them; the packing
    is ours (epoch_batches), not its MultipackDistributedBatchSamplerV2."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    ds = open_datapath(datapath, batch_tokens, backend.data_dtype, transfer)
    if transfer is None:
        check_datapath(ds, datapath, arch)
    collate = CollateFn(batch_tokens, arch.target_hidden_size, num_target_layers=archmod.NUM_AUX,
                        dtype=backend.data_dtype, preprocess=shift_batch)
    return Batches(ds, datapath, collate, backend)
