"""Trains the EAGLE-3 draft: speculators' `Eagle3DraftModel` and `Eagle3SpeculatorConfig` driven
by a loop of our own (speculators' Trainer assumes an accelerator).

Inputs (all produced by earlier stages):
  configs/draft_config.json          the draft architecture (DraftArch.to_dict() minus "dtype")
  artifacts/verifier                 embeddings, lm_head rows and final norm come from here
  artifacts/hidden/{train,eval}      speculators datapaths (ArrowDataset layout)
  artifacts/vocab/vocab_map.safetensors   d2t (offsets) and t2d
Outputs:
  artifacts/train/{model.safetensors, config.json}   float32, speculators layout, exactly the
                                                     tensors of arch.contract(arch, "speculators")
  metrics/train/metrics.json, metrics/train/plots/metrics/**.tsv   (dvclive, no timestamps)

CPU (default): sdpa attention (flex attention has no CPU backward) and speculators' eager loss
(the fused one needs Triton); float32 weights under bf16 autocast, as speculators' Trainer runs
(~1.5x faster than float32 here: the CPU has avx512_bf16); each packed batch runs as micro-batches
of <= 512 tokens (see backend_for); a fixed thread count, a seeded init and a seeded per-epoch
shuffle. Two runs give byte-identical weights and metrics.

GPU: the same loop runs on CUDA (`train.device: cuda`) with speculators' GPU defaults
(flex attention, the fused Triton loss when Triton is importable, one packed batch per forward)
under bf16 autocast, as speculators' own Trainer does (not run in this project's CI: no GPU).
Several GPUs: launch the same stage script under torchrun,

    torchrun --nproc-per-node 8 stages/train.py --params params.yaml ... (the dvc.yaml cmd args)

WORLD_SIZE > 1 makes every rank init torch.distributed from the environment (NCCL), take every
world-th packed batch of the (identically seeded) epoch order, wrap the model in
DistributedDataParallel, all-reduce the eval sums, and leaves all writes (weights, metrics) to
rank 0. That path is only entered with device cuda; CPU runs never touch torch.distributed
(the test suite alone runs it on CPU over gloo, behind EAGLE3PIPE_CPU_DDP_TEST=1).
"""
from __future__ import annotations

import json
import logging
import math
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from eagle3pipe import arch as archmod
from eagle3pipe.errors import Error
from eagle3pipe.verifier import Verifier, VerifierInfo
from eagle3pipe.runtime import atomic_dir, dumps, read_json_object, seed_everything

log = logging.getLogger("eagle3pipe.train")

NUM_SLOTS = archmod.NUM_AUX + 1  # 3 aux layers + the pre-norm last-layer output
VOCAB_MAP_FILE = "vocab_map.safetensors"
LOSS_FN = "kl_div"                # speculators' default for EAGLE-3 (forward KL to the verifier)
TTT_STEP_LOSS_DECAY = 1.0         # speculators' default: every TTT step weighted equally
GRAD_CLIP = 1.0                   # speculators' Trainer clips at 1.0
PAD_MULTIPLE = 128                # CUDA: packs trimmed to a multiple of this (flex blocks)
CPU_CHUNK_TOKENS = 512            # CPU: tokens per forward (see backend_for)
DRAFT_CONFIG_KEYS = tuple(f.name for f in fields(archmod.DraftArch) if f.name != "dtype")


class TrainInputError(Error, ValueError):
    """A bad input file: the message names the file, the key and the fix."""


# ---------------------------------------------------------------------------------------------
# Inputs


def load_draft_config(path: str | Path) -> archmod.DraftArch:
    """Reads configs/draft_config.json (DraftArch.to_dict() minus "dtype") into a DraftArch.
    Training keeps float32 weights, so the arch's dtype is float32 here (the export stage casts
    to the configured dtype)."""
    p = Path(path)
    fix = "regenerate it with `dvc repro configs`"
    d = read_json_object(p, TrainInputError, fix, "draft config")
    missing = [k for k in DRAFT_CONFIG_KEYS if k not in d]
    unknown = sorted(set(d) - set(DRAFT_CONFIG_KEYS) - {"dtype"})
    if missing or unknown:
        raise TrainInputError(
            f"{p}: " + "; ".join(([f"missing keys {missing}"] if missing else [])
                                 + ([f"unknown keys {unknown}"] if unknown else []))
            + f"; {fix}")
    values = {k: d[k] for k in DRAFT_CONFIG_KEYS}
    values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
    return archmod.DraftArch(**values, dtype="float32")


def check_against_verifier(arch: archmod.DraftArch, v: VerifierInfo) -> None:
    """The draft config must belong to this verifier (configs/ may be stale otherwise)."""
    for key, ours, theirs in (("hidden_size", arch.hidden_size, v.hidden_size),
                              ("target_hidden_size", arch.target_hidden_size, v.hidden_size),
                              ("vocab_size", arch.vocab_size, v.vocab_size),
                              ("verifier_num_layers", arch.verifier_num_layers,
                               v.num_hidden_layers)):
        if ours != theirs:
            raise TrainInputError(
                f"draft config {key}={ours} but the verifier ({v.source}) has {theirs}; "
                "the draft config is stale: rerun `dvc repro configs`")


# Model


def speculator_config(arch: archmod.DraftArch, verifier_dir: str | Path, *,
                      speculative_tokens: int, attn_impl: str | None = None):
    """Eagle3SpeculatorConfig for the draft, built by the same function that renders
    configs/speculators/config.json; verifier.name_or_path = the verifier model dir (weights
    are loaded from there)."""
    from speculators.config import VerifierConfig

    from eagle3pipe.formats import eagle3_config

    return eagle3_config(arch, num_speculative_tokens=speculative_tokens,
                         verifier=VerifierConfig.from_pretrained(str(verifier_dir)),
                         attn_impl=attn_impl)


def build_model(arch: archmod.DraftArch, verifier_dir: str | Path, d2t: torch.Tensor,
                t2d: torch.Tensor, *, speculative_tokens: int, attn_impl: str):
    """A freshly initialised Eagle3DraftModel (current torch RNG) with the vocab mapping set and
    the verifier's embeddings, lm_head rows (t2d) and final norm loaded, as speculators does."""
    from speculators.models.eagle3 import Eagle3DraftModel

    config = speculator_config(arch, verifier_dir, speculative_tokens=speculative_tokens,
                               attn_impl=attn_impl)
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    for name in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"):
        w = getattr(model, name).weight
        if torch.isnan(w).any():
            raise TrainInputError(f"{verifier_dir}: {name} was not loaded from the verifier "
                                  "weights (still NaN); check the verifier checkpoint")
    return model.float()


def contract_state_dict(model, arch: archmod.DraftArch) -> dict[str, torch.Tensor]:
    """The model's tensors named by arch.contract(arch, "speculators"), float32 (d2t int64,
    t2d bool), contiguous CPU copies. Raises if a name or shape differs from the contract."""
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, spec in archmod.contract(arch, "speculators").items():
        if name not in sd:
            raise AssertionError(f"model has no tensor {name} required by the contract")
        t = sd[name].detach().to("cpu")
        if tuple(t.shape) != spec.shape:
            raise AssertionError(f"{name}: model has {list(t.shape)}, contract {list(spec.shape)}")
        if t.is_floating_point():
            t = t.to(torch.float32)
        out[name] = t.contiguous().clone()
    return out


def save_checkpoint(model, arch: archmod.DraftArch, out_dir: str | Path) -> None:
    """Atomically writes model.safetensors (contract tensors only: no embed_tokens, no
    verifier_*; save_pretrained would add embed_tokens) and config.json (what
    Eagle3SpeculatorConfig.save_pretrained writes, as canonical JSON without the
    transformers_version stamp)."""
    from safetensors.torch import save_file

    tensors = contract_state_dict(model, arch)
    config = json.loads(model.config.to_json_string(use_diff=True))
    config.pop("transformers_version", None)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(dumps(config))
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes 0600 (a temp file renamed)


# ---------------------------------------------------------------------------------------------
# Data


def open_datapath(datapath: str | Path, max_len: int, dtype: torch.dtype):
    """speculators' ArrowDataset over a hidden-state datapath; missing files raise."""
    from speculators.train.data import ArrowDataset

    p = Path(datapath)
    if not (p / "hidden_states").is_dir():
        raise TrainInputError(f"{p}: not a hidden-state datapath (no hidden_states/); "
                              "rerun `dvc repro extract`")
    ds = ArrowDataset(max_len, str(p), on_missing="raise", hidden_states_dtype=dtype)
    if len(ds) == 0:
        raise TrainInputError(f"{p}: has no samples; check dataset.num_samples / eval_fraction")
    return ds


def check_datapath(ds, datapath: str | Path, arch: archmod.DraftArch) -> None:
    """The first sample's hidden states must have NUM_SLOTS slots of the verifier's width."""
    sample = ds.transfer.get_cached(ds._map_to_file_idx(0))  # noqa: SLF001
    if sample is None:
        raise TrainInputError(f"{datapath}/hidden_states/hs_0.safetensors: missing; "
                              "rerun `dvc repro extract`")
    hs = sample["hidden_states"]
    want = (NUM_SLOTS, arch.target_hidden_size)
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

    def __init__(self, ds, datapath: str | Path, collate, backend: "Backend"):
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


# ---------------------------------------------------------------------------------------------
# Distributed (CUDA + torchrun only)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> Dist:
    """Single process unless WORLD_SIZE > 1 (torchrun); multi-process requires CUDA (NCCL).
    The one exception is the test suite: EAGLE3PIPE_CPU_DDP_TEST=1 runs the same DDP path on
    CPU over gloo, so the sharding/all-reduce/rank-0 code is exercised without a GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainInputError("train.device is cuda but torch sees no CUDA device; "
                           "set train.device: cpu in params.yaml or run on a GPU machine")
    if world <= 1:
        return Dist(device=torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
    cpu_test = device == "cpu" and os.environ.get("EAGLE3PIPE_CPU_DDP_TEST") == "1"
    if device != "cuda" and not cpu_test:
        raise TrainInputError(f"WORLD_SIZE={world} (torchrun) with train.device=cpu: multi-process "
                           "training is for GPUs; set train.device: cuda or run without torchrun")
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cpu_test:
        dist.init_process_group(backend="gloo")
        return Dist(rank=dist.get_rank(), world=dist.get_world_size())
    torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl")  # env:// (MASTER_ADDR, RANK, WORLD_SIZE from torchrun)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(),
                device=torch.device("cuda", local))


def _all_reduce(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


# ---------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class Backend:
    attn_impl: str               # transformer_layer_config._attn_implementation
    loss_impl: str               # speculators.losses implementation: eager | fused
    autocast: torch.dtype | None  # speculators' Trainer runs the model under bf16 autocast
    data_dtype: torch.dtype      # hidden states as collated (stored as bf16 by extract)
    chunk_tokens: int | None     # CPU: micro-batches of at most this many tokens per forward
    pad_multiple: int            # collated length rounded up to a multiple of this


def backend_for(device: str) -> Backend:
    """CPU: sdpa (flex attention has no CPU backward), the eager loss (the fused one needs
    Triton), and every packed batch run as micro-batches of <= CPU_CHUNK_TOKENS tokens with
    gradient accumulation: sdpa gets a dense [T, ttt*T] mask, so one 2048-token pack costs ~2.5x
    the compute of its 512-token pieces (measured), all of it on cross-document pairs that are
    masked out anyway. Each micro-batch's loss is weighted by its share of loss-mask tokens, so
    the step's loss and gradient are speculators' token-weighted mean over the whole pack.
    CUDA: speculators' own defaults, one packed batch per forward (flex attention skips the
    masked blocks), the fused Triton loss when Triton is importable."""
    if device == "cpu":
        return Backend("sdpa", "eager", torch.bfloat16, torch.bfloat16, CPU_CHUNK_TOKENS, 1)
    try:
        import triton  # noqa: F401
        loss_impl = "fused"
    except ImportError:
        loss_impl = "eager"
    return Backend("simple_flex_attention", loss_impl, torch.bfloat16, torch.bfloat16, None,
                   PAD_MULTIPLE)


def lr_lambda(warmup: int, total: int):
    """Linear warm-up over `warmup` steps (the first step already gets lr/(warmup+1)), then a
    half-cosine decay to 0 at `total`, the shape of speculators' cosine scheduler."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        frac = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))
    return f


def _weights(chunks: list[dict[str, torch.Tensor]]) -> list[float]:
    """Each micro-batch's share of the pack's loss-mask tokens (uniform if none are masked)."""
    n = [float(c["loss_mask"].sum()) for c in chunks]
    total = sum(n)
    return [x / total for x in n] if total > 0 else [1.0 / len(n)] * len(n)


def run_batch(model, chunks: list[dict[str, torch.Tensor]], *, ttt_steps: int, loss_config,
              backend: Backend, d: Dist, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (and backward) of one packed batch given as micro-batches. Returns the pack's
    loss (token-weighted over micro-batches) and the accuracy count vector
    [full_correct_i, full_total_i, cond_correct_i, cond_total_i for i < ttt_steps]."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    counts = torch.zeros(4 * ttt_steps, dtype=torch.float64)
    weights = _weights(chunks)
    for j, (chunk, w) in enumerate(zip(chunks, weights)):
        chunk = {k: v.to(d.device) for k, v in chunk.items()}
        # DDP: gradients are all-reduced once per step, on the last micro-batch (ranks may run
        # different numbers of micro-batches)
        sync = not hasattr(model, "no_sync") or j == len(chunks) - 1 or not backward
        with nullcontext() if sync else model.no_sync():
            with _autocast(backend, d):
                _, loss, m = model(**chunk, ttt_steps=ttt_steps,
                                   ttt_step_loss_decay=TTT_STEP_LOSS_DECAY,
                                   loss_config=loss_config)
            if backward:
                (loss * w).backward()
        loss_sum += w * loss.detach().double().cpu()
        counts += torch.stack([m[f"{kind}_acc_{i}_{part}"].detach().double().reshape(())
                               for i in range(ttt_steps) for kind, part in
                               (("full", "sum"), ("full", "total"), ("cond", "sum"),
                                ("cond", "total"))]).cpu()
    return loss_sum, counts


@torch.no_grad()
def evaluate(model, packs: list[list[int]], data: Batches, *, ttt_steps: int, loss_config,
             backend: Backend, d: Dist) -> dict[str, float]:
    """Mean loss over eval packs and per-position accuracies, token-weighted (`model`
    unwrapped: no collectives per forward, ranks may hold different pack counts; their sums
    are all-reduced at the end):
    acc_pos{i}: share of eval positions whose draft tokens 0..i all match the verifier's greedy
    token (what vLLM reports as per-position acceptance), cond_acc_pos{i}: the same given
    0..i-1 matched; accept_len: 1 + sum_i acc_pos{i} (expected tokens per verifier step)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(1 + 4 * ttt_steps, dtype=torch.float64)
    for idx in packs:
        loss, counts = run_batch(model, data.micro(idx), ttt_steps=ttt_steps,
                                 loss_config=loss_config, backend=backend, d=d, backward=False)
        sums[0] += loss
        sums[1:] += counts
    n = torch.tensor([float(len(packs))], dtype=torch.float64)
    if d.world > 1:
        both = _all_reduce(torch.cat([sums, n]).to(d.device), d).cpu()
        sums, n = both[:-1], both[-1:]
    if was_training:
        model.train()
    out = {"loss": sums[0].item() / max(1.0, n.item())}
    accept = 1.0
    for i in range(ttt_steps):
        fs, ft, cs, ct = sums[1 + 4 * i: 5 + 4 * i].tolist()
        out[f"acc_pos{i}"] = fs / ft if ft else 0.0
        out[f"cond_acc_pos{i}"] = cs / ct if ct else 0.0
        accept += out[f"acc_pos{i}"]
    out["accept_len"] = accept
    return out


def _autocast(backend: Backend, d: Dist):
    if backend.autocast is None:
        return nullcontext()
    return torch.autocast(d.device.type, dtype=backend.autocast)


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def train(p, draft_config: str | Path, verifier: str | Path, hidden: str | Path,
          vocab: str | Path, out_dir: str | Path, *, metrics_dir: str | Path = "metrics/train",
          progress: bool = True, max_steps: int | None = None) -> dict[str, Any]:
    """Trains the draft and writes out_dir (atomic) and the dvclive metrics/plots.

    `p` is the params' `train` section (a params.for_stage view or any object with the
    TrainParams attributes). `max_steps` stops early (benchmarks/tests only; the schedule is
    still computed over all epochs). Returns the final metrics."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from tqdm import tqdm

    seed_everything(p.seed, p.threads)
    d = setup_distributed(p.device)
    backend = backend_for(p.device)
    if d.device.type == "cpu":
        torch.use_deterministic_algorithms(True)

    arch = load_draft_config(draft_config)
    ver = Verifier(verifier)
    vdir = ver.model_dir
    check_against_verifier(arch, ver.info)
    d2t, t2d = load_vocab_map(Path(vocab), arch)
    hidden = Path(hidden)
    collate = CollateFn(p.batch_tokens, arch.target_hidden_size, num_target_layers=archmod.NUM_AUX,
                        dtype=backend.data_dtype, preprocess=shift_batch)
    data = {}
    for split in ("train", "eval"):
        ds = open_datapath(hidden / split, p.batch_tokens, backend.data_dtype)
        check_datapath(ds, hidden / split, arch)
        data[split] = Batches(ds, hidden / split, collate, backend)

    torch.manual_seed(p.seed)
    model = build_model(arch, vdir, d2t, t2d, speculative_tokens=p.ttt_steps,
                        attn_impl=backend.attn_impl).to(d.device)
    loss_config = resolve_loss_config(LOSS_FN, backend.loss_impl)
    core = model
    if d.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
            broadcast_buffers=False)

    lengths = data["train"].lengths
    # every rank packs the same seeded order and takes every world-th pack; the step count is
    # the same on every rank (DDP all-reduces each backward)
    packs = [epoch_batches(lengths, p.batch_tokens, p.seed, e) for e in range(p.epochs)]
    steps_per_epoch = min(len(b) // d.world for b in packs)
    per_epoch = [b[d.rank::d.world][:steps_per_epoch] for b in packs]
    if steps_per_epoch == 0:
        raise TrainInputError(f"{hidden / 'train'}: {len(lengths)} samples make fewer packed "
                              f"batches than ranks ({d.world}); add data or lower the rank count")
    total = steps_per_epoch * p.epochs
    ev_len = data["eval"].lengths
    eval_packs = pack(list(range(len(ev_len))), ev_len, p.batch_tokens)[d.rank::d.world]
    trainable = [x for x in core.parameters() if x.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=p.learning_rate, weight_decay=p.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(min(p.warmup_steps, total), total))
    run = dict(ttt_steps=p.ttt_steps, loss_config=loss_config, backend=backend, d=d)
    limit = total if max_steps is None else min(total, max_steps)
    log.info("train: %d samples, %d steps (%d epochs x %d packs of <= %d tokens), %d eval "
             "packs, device %s x %d, attention %s, loss %s", len(lengths), limit, p.epochs,
             steps_per_epoch, p.batch_tokens, len(eval_packs), d.device.type, d.world,
             backend.attn_impl, backend.loss_impl)

    live = _live(metrics_dir) if d.main else None

    def log_eval(step: int, ev: dict) -> None:
        if live is not None:
            live.step = step
            for k, v in ev.items():
                live.log_metric(f"eval/{k}", _round(v))

    ev = evaluate(core, eval_packs, data["eval"], **run)
    log.info("step 0: eval loss %.4f", ev["loss"])
    log_eval(0, ev)
    last: dict[str, Any] = {"step": 0, "eval": ev}
    step = 0
    bar = tqdm(total=limit, desc="train", disable=not (progress and d.main), mininterval=1.0)
    model.train()
    try:
        for epoch in range(p.epochs):
            for idx in per_epoch[epoch]:
                if step >= limit:
                    break
                opt.zero_grad(set_to_none=True)
                loss, _ = run_batch(model, data["train"].micro(idx), backward=True, **run)
                torch.nn.utils.clip_grad_norm_(trainable, GRAD_CLIP)
                lr = opt.param_groups[0]["lr"]
                opt.step()
                sched.step()
                step += 1
                loss_v = _all_reduce(loss.reshape(1).to(d.device), d).item() / d.world
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{loss_v:.4f}")
                if live is not None:
                    live.step = step
                    live.log_metric("train/loss", _round(loss_v))
                    live.log_metric("train/lr", _round(lr))
                if step % p.eval_every == 0 or step == limit:
                    ev = evaluate(core, eval_packs, data["eval"], **run)
                    log.info("step %d/%d: train loss %.4f, eval loss %.4f, acceptance/pos %s",
                             step, limit, loss_v, ev["loss"],
                             [round(ev[f"acc_pos{i}"], 3) for i in range(p.ttt_steps)])
                    log_eval(step, ev)
                    last = {"epoch": epoch, "step": step, "train_loss": loss_v, "eval": ev}
    finally:
        bar.close()
    if live is not None:
        live.end()
    if d.main:
        save_checkpoint(core, arch, out_dir)
    if d.world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return last


def _live(metrics_dir: str | Path):
    """dvclive writer: metrics.json (latest values, no timestamps) and per-step TSV plots under
    <metrics_dir>/plots/metrics/ (it clears old plots first). No dvc.yaml of its own, no
    experiment saving, and no DVC repo access at all: outside a DVC repo, dvclive 3.49's
    get_dvc_repo() would `dvc init` the enclosing git repo. dvc.yaml declares these files."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from dvclive import Live

    class FilesOnlyLive(Live):
        def _init_dvc(self) -> None:  # no Repo(), no Repo.init(), no experiment
            self._dvc_file = "dvc.yaml"

    return FilesOnlyLive(dir=str(metrics_dir), save_dvc_exp=False, dvcyaml=None)


def run(params, paths) -> None:
    """The stage (eagle3pipe.stage.main): paths.draft_config, .verifier, .hidden, .vocab ->
    paths.out; dvclive writes metrics/train/."""
    final = train(params.train, paths.draft_config, paths.verifier, paths.hidden, paths.vocab,
                  paths.out, metrics_dir="metrics/train", progress=paths.progress)
    ev = final.get("eval", {})
    log.info("%s written; step %s, eval loss %.4f, acceptance length (training estimate) %.2f",
             paths.out, final.get("step"), ev.get("loss", float("nan")),
             ev.get("accept_len", float("nan")))
