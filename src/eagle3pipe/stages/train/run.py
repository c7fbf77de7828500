"""Trains the EAGLE-3 draft: speculators' `Eagle3DraftModel` and `Eagle3SpeculatorConfig` driven
by a loop of our own, split the way speculators' Trainer is (speculators/train/trainer.py):
setup() -> TrainState (Trainer.__init__: setup_trainer, setup_model, setup_optimizer), step()
(one optimizer step: the body of Trainer.train_epoch), evaluate() (Trainer.val_epoch) and fit()
(Trainer.run_training); train() is setup() then fit(), the stage's run(). Its Trainer itself
is not used: it assumes an accelerator, one forward per batch and its own checkpoint layout.
Process group, device and backend choices live in eagle3pipe.runtime.distributed.

Inputs (all produced by earlier stages):
  configs/draft_config.json          the draft architecture (DraftArch.to_dict() minus "dtype")
  artifacts/verifier                 embeddings, lm_head rows and final norm come from here
  artifacts/hidden/{train,eval}      speculators datapaths (ArrowDataset layout)
  artifacts/vocab/vocab_map.safetensors   d2t (offsets) and t2d
Checkpoints: every train.checkpoint_every steps and when stopped by SIGTERM/SIGINT, under a key
of the stage's inputs and params (eagle3pipe.stages.train.checkpoint); the next run of the same
key resumes from the newest, with the same bytes at the end as a run never stopped.
Outputs:
  artifacts/train/{model.safetensors, config.json}   float32, speculators layout, exactly the
                                                     tensors of arch.contract(arch, "speculators")
  metrics/train/metrics.json, metrics/train/plots/metrics/**.tsv   (dvclive, no timestamps)

CPU (default): sdpa attention, speculators' eager loss, float32 weights under bf16 autocast (as
speculators' Trainer runs), packed batches run as micro-batches (distributed.backend_for), a
fixed thread count, a seeded init and a seeded per-epoch shuffle: two runs give byte-identical
weights and metrics. GPU (`train.device: cuda`, several under torchrun): every rank takes every
world-th packed batch of the same seeded epoch order, the model is wrapped in DDP, eval sums are
all-reduced and rank 0 does all writes (see eagle3pipe.runtime.distributed and docs/setup.md).
"""
from __future__ import annotations

import logging
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3pipe.config.view import RunSettings, StageView
from eagle3pipe.data import store
from eagle3pipe.hidden import spec
from eagle3pipe.stages.train import batches
from eagle3pipe.hidden import online
from eagle3pipe.stages.train.batches import Batches, TrainInputError, open_split
from eagle3pipe.draft import arch as archmod
from eagle3pipe.draft.parsing import read_draft_config
from eagle3pipe.draft.vocab_map import load as vocab_load
from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.runtime.distributed import (
    Backend,
    Dist,
    all_reduce,
    backend_for,
    largest,
    lost_peers,
    setup_distributed,
    teardown,
    wrap_model,
)
from eagle3pipe.runtime.seeds import seed_everything
from eagle3pipe.stages.runner import Paths
from eagle3pipe.stages.train.checkpoint import ROOT as CHECKPOINTS
from eagle3pipe.stages.train.checkpoint import (
    Checkpoints,
    after_step,
    key_of,
    restore_metrics,
    resume,
    stop_requests,
)
from eagle3pipe.stages.train.metrics import Metrics
from eagle3pipe.stages.train.model import (
    build_model,
    check_against_verifier,
    run_batch,
    save_checkpoint,
    start_from,
)
from eagle3pipe.verifier.handle import Verifier

log = logging.getLogger("eagle3pipe.stages.train")


# ---------------------------------------------------------------------------------------------
# The trainer: setup -> TrainState, step, evaluate, fit (speculators' Trainer, in functions)


def lr_lambda(warmup: int, total: int):
    """Linear warm-up over `warmup` steps (the first step already gets lr/(warmup+1)), then a
    half-cosine decay to 0 at `total`, the shape of speculators' cosine scheduler."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        frac = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))
    return f


@dataclass
class TrainState:
    """What speculators' Trainer holds after __init__ (setup_trainer, setup_model,
    setup_optimizer): the model (`core`; `model` is the DDP wrapper when world > 1), this
    rank's packs per epoch, the eval packs, optimizer and schedule, and the step counter."""
    p: Any
    arch: archmod.DraftArch
    d: Dist
    backend: Backend
    core: Any
    model: Any
    loss_config: Any
    train: Batches
    eval: Batches
    per_epoch: list[list[list[int]]]
    eval_packs: list[list[int]]
    trainable: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    limit: int                   # steps fit() runs: all of them, or max_steps
    step: int = 0
    init: dict | None = None     # train.init_from: what the draft started from (metrics)
    after_step: Any = lambda idx: None  # on demand: the producer's release (hidden.online)

    def run_args(self) -> dict[str, Any]:
        return dict(ttt_steps=self.p.ttt_steps, ttt_step_loss_decay=self.p.ttt_step_loss_decay,
                    loss_config=self.loss_config,
                    backend=self.backend, d=self.d)


def setup(p, draft_config: str | Path, verifier: str | Path, hidden: str | Path,
          vocab: str | Path, *, max_steps: int | None = None) -> TrainState:
    """speculators' Trainer.__init__ for our inputs: seeds, process group, determinism, the
    checked inputs (the draft config through parsing.read_draft_config: float32 weights), both
    splits, then build_state. `p` is the params' `train` section (a params.for_stage view or any
    object with the TrainParams attributes). `max_steps` stops early (benchmarks/tests only; the
    schedule still spans all epochs, where speculators' max_steps shortens it)."""
    seed_everything(p.seed, p.threads)
    d = setup_distributed(p.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", d.world))
    if d.world != p.nproc_per_node * p.nnodes or local != p.nproc_per_node:
        raise TrainInputError(
            f"{d.world} training process(es) running ({local} on this node), "
            f"train.nproc_per_node is {p.nproc_per_node} on each of train.nnodes {p.nnodes}",
            fix="run the stage through `dvc repro train` (it launches torchrun from these "
            "params) and every other node with the command `eagle3pipe launch` prints")
    backend = backend_for(p.device, p.cpu_chunk_tokens, p.loss_impl)
    if d.device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    arch = read_draft_config(draft_config)
    ver = Verifier(verifier)
    check_against_verifier(arch, ver.info)
    d2t, t2d = vocab_load(vocab, arch.draft_vocab_size, arch.vocab_size)
    m = online.read_manifest(hidden)  # None offline; on demand, the states come from an engine
    if m is not None:
        online.check_manifest(m, spec.num_slots(arch.aux_layer_ids), arch.target_hidden_size)
    train, ev = (open_split(Path(hidden) / split, p.batch_tokens, arch, backend,
                            online.transfer(m, split)) for split in ("train", "eval"))
    return build_state(p, arch, ver.model_dir, d2t, t2d, train, ev, d=d, backend=backend,
                       max_steps=max_steps)


def build_state(p, arch: archmod.DraftArch, verifier_dir: str | Path, d2t: torch.Tensor,
                t2d: torch.Tensor, train_data: Batches, eval_data: Batches, *, d: Dist,
                backend: Backend, max_steps: int | None = None) -> TrainState:
    """The model seeded with p.seed (speculators' setup_model: to the device, DDP when world
    > 1), the epoch plan and AdamW + the warm-up/cosine schedule (setup_optimizer). Every rank
    packs the same seeded order and takes every world-th pack, the same count on every rank
    (DDP all-reduces each backward)."""
    from speculators.losses import resolve_loss_config

    torch.manual_seed(p.seed)
    core = build_model(arch, verifier_dir, d2t, t2d, speculative_tokens=p.ttt_steps,
                       attn_impl=backend.attn_impl)
    init = start_from(core, arch, p.init_from)
    core = core.to(d.device)
    loss_config = resolve_loss_config(p.loss, backend.loss_impl)
    model = wrap_model(core, d)
    lengths = train_data.lengths
    packs = [batches.epoch_batches(lengths, p.batch_tokens, p.seed, e) for e in range(p.epochs)]
    steps_per_epoch = min(len(b) // d.world for b in packs)
    if steps_per_epoch == 0:
        raise TrainInputError(f"{train_data.datapath}: {len(lengths)} samples make fewer packed "
                              f"batches than ranks ({d.world}); add data or lower the rank count")
    total = steps_per_epoch * p.epochs
    ev_len = eval_data.lengths
    eval_packs = batches.pack(list(range(len(ev_len))), ev_len, p.batch_tokens)
    trainable = [x for x in core.parameters() if x.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=p.learning_rate, weight_decay=p.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(min(p.warmup_steps, total), total))
    return TrainState(p, arch, d, backend, core, model, loss_config, train_data, eval_data,
                      [b[d.rank::d.world][:steps_per_epoch] for b in packs],
                      eval_packs[d.rank::d.world], trainable, opt, sched,
                      limit=total if max_steps is None else min(total, max_steps), init=init)


def step(s: TrainState, idx: list[int]) -> tuple[float, float]:
    """One optimizer step on the packed batch `idx` (the body of speculators'
    Trainer.train_epoch: zero_grad, forward/backward, clip_grad_norm_ at train.grad_clip,
    optimizer step, scheduler step), its micro-batches accumulated by run_batch. Returns (the pack's loss
    averaged over ranks, the learning rate the step used)."""
    s.opt.zero_grad(set_to_none=True)
    loss, _ = run_batch(s.model, s.train.micro(idx), backward=True, **s.run_args())
    torch.nn.utils.clip_grad_norm_(s.trainable, s.p.grad_clip)
    lr = s.opt.param_groups[0]["lr"]
    s.opt.step()
    s.sched.step()
    s.step += 1
    return all_reduce(loss.reshape(1).to(s.d.device), s.d).item() / s.d.world, lr


@torch.no_grad()
def evaluate(s: TrainState) -> dict[str, float]:
    """speculators' Trainer.val_epoch: mean loss over the eval packs and per-position
    accuracies, token-weighted, on the unwrapped model (no collectives per forward, ranks may
    hold different pack counts; their sums are all-reduced at the end):
    acc_pos{i}: share of eval positions whose draft tokens 0..i all match the verifier's greedy
    token (what vLLM reports as per-position acceptance), cond_acc_pos{i}: the same given
    0..i-1 matched; accept_len: 1 + sum_i acc_pos{i} (expected tokens per verifier step)."""
    ttt, d = s.p.ttt_steps, s.d
    was_training = s.core.training
    s.core.eval()
    sums = torch.zeros(1 + 4 * ttt, dtype=torch.float64)
    for idx in s.eval_packs:
        loss, counts = run_batch(s.core, s.eval.micro(idx), backward=False, **s.run_args())
        sums[0] += loss
        sums[1:] += counts
    n = torch.tensor([float(len(s.eval_packs))], dtype=torch.float64)
    if d.world > 1:
        both = all_reduce(torch.cat([sums, n]).to(d.device), d).cpu()
        sums, n = both[:-1], both[-1:]
    if was_training:
        s.core.train()
    out = {"loss": sums[0].item() / max(1.0, n.item())}
    accept = 1.0
    for i in range(ttt):
        fs, ft, cs, ct = sums[1 + 4 * i: 5 + 4 * i].tolist()
        out[f"acc_pos{i}"] = fs / ft if ft else 0.0
        out[f"cond_acc_pos{i}"] = cs / ct if ct else 0.0
        accept += out[f"acc_pos{i}"]
    out["accept_len"] = accept
    return out


def fit(s: TrainState, out_dir: str | Path, *, metrics_dir: str | Path, progress: bool,
        checkpoints: Checkpoints | None = None,
        resumed: tuple[Path, dict] | None = None) -> dict[str, Any]:
    """speculators' Trainer.run_training: run_epochs() with rank 0's dvclive writing
    metrics_dir, then rank 0 writes out_dir; both atomic. `resumed`: the checkpoint restore()
    put back into `s` and its (path, saved point), whose metrics files it continues. Returns
    run_epochs()'s last evaluated point."""
    log.info("train: %d samples, %d steps (%d epochs x %d packs of <= %d tokens), %d eval "
             "packs, device %s x %d, attention %s, loss %s (%s)", len(s.train.lengths),
             s.limit, s.p.epochs, len(s.per_epoch[0]), s.p.batch_tokens, len(s.eval_packs),
             s.d.device.type, s.d.world, s.backend.attn_impl, s.p.loss, s.backend.loss_impl)
    # rank 0's dvclive writes into a temporary beside metrics_dir, published whole before the
    # checkpoint: a killed run leaves no partial metrics/train/ (runtime.atomic_dir)
    with lost_peers(s.d):  # a dead node's peers: one message, nothing published
        with atomic_dir(metrics_dir) if s.d.main else nullcontext(None) as live_dir:
            summary = None
            if resumed is not None and live_dir is not None:
                restore_metrics(resumed[0], live_dir)
                summary = resumed[1]["summary"]
            metrics = Metrics(live_dir, summary)
            metrics.init_from(s.init)
            last = run_epochs(s, metrics, progress=progress, checkpoints=checkpoints,
                              last=None if resumed is None else resumed[1]["last"],
                              live_dir=live_dir)
            metrics.end()
        if s.d.main:
            save_checkpoint(s.core, s.arch, out_dir)
        teardown(s.d)
    return last


def run_epochs(s: TrainState, metrics: Metrics, *, progress: bool,
               checkpoints: Checkpoints | None = None, last: dict[str, Any] | None = None,
               live_dir: Path | None = None) -> dict[str, Any]:
    """The body of speculators' Trainer.run_training: eval at step 0, the epochs of step()s
    with an eval every p.eval_every steps and at the last, each logged to `metrics`; from
    s.step on when resuming (`last`: the point the checkpoint saved). A checkpoint every
    p.checkpoint_every steps and when SIGTERM/SIGINT stop it (then Stopped). Returns the last
    evaluated point {epoch, step, train_loss, eval}."""
    from tqdm import tqdm

    if last is None:
        ev = evaluate(s)
        log.info("step 0: eval loss %.4f", ev["loss"])
        metrics.eval(0, ev)
        last = {"step": 0, "eval": ev}
    bar = tqdm(total=s.limit, initial=s.step, desc="train",
               disable=not (progress and s.d.main), mininterval=1.0)
    order = [(epoch, idx) for epoch, packs in enumerate(s.per_epoch) for idx in packs]
    s.model.train()
    with stop_requests() as flag:
        try:
            for epoch, idx in order[s.step:s.limit]:
                loss, lr = step(s, idx)
                s.after_step(idx)
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}")
                metrics.train(s.step, loss, lr)
                if s.step % s.p.eval_every == 0 or s.step == s.limit:
                    ev = evaluate(s)
                    log.info("step %d/%d: train loss %.4f, eval loss %.4f, acceptance/pos %s",
                             s.step, s.limit, loss, ev["loss"],
                             [round(ev[f"acc_pos{i}"], 3) for i in range(s.p.ttt_steps)])
                    metrics.eval(s.step, ev)
                    last = {"epoch": epoch, "step": s.step, "train_loss": loss, "eval": ev}
                after_step(s, flag, metrics, checkpoints, last, live_dir)
        finally:
            bar.close()
    return last


def demand_of(s: TrainState) -> online.Demand | None:
    """What this trainer reads on demand, from s.step on (past 0 when it resumes a checkpoint):
    every row's tokens by store key, then the packs in order, the eval packs first (evaluated
    at step 0 and every eval_every steps); None offline."""
    tr, ev = s.train.ds.transfer, s.eval.ds.transfer
    if not isinstance(tr, online.StoreTransfer):
        return None
    tokens = {k: list(ids) for split in (s.train, s.eval)
              for k, ids in zip(split.ds.transfer.keys,
                                split.ds.data.with_format(None)["input_ids"])}
    plan = [[ev.keys[i] for i in pack] for pack in s.eval_packs]
    steps = [idx for packs in s.per_epoch for idx in packs][s.step:s.limit]
    return online.Demand((tr, ev), tokens, plan + [[tr.keys[i] for i in idx] for idx in steps],
                         len(plan))


def train(p, draft_config: str | Path, verifier: str | Path, hidden: str | Path,
          vocab: str | Path, out_dir: str | Path, *, metrics_dir: str | Path, progress: bool,
          max_steps: int | None = None, run: RunSettings | None = None,
          record_to: Path | None = None, checkpoints: Checkpoints | None = None
          ) -> dict[str, Any]:
    """setup(), the newest checkpoint of `checkpoints` put back (if any), then fit(): trains
    the draft from the stage's input files into out_dir and metrics_dir; on demand, while
    hidden.online.supply's engine computes the hidden states from the step it resumes at
    (`run`: its run-only settings, StageView.run_settings). Once published, the checkpoints
    go. Returns fit()'s last point."""
    state = setup(p, draft_config, verifier, hidden, vocab, max_steps=max_steps)
    resumed = resume(state, checkpoints)
    demand = demand_of(state)
    with online.supply(demand, verifier, run, threads=p.threads,
                       record_to=record_to if state.d.main else None,
                       agree=lambda n: largest(n, state.d)) as release:
        if demand is not None:
            keys = state.train.ds.transfer.keys
            state.after_step = lambda idx: release([keys[i] for i in idx])
        last = fit(state, out_dir, metrics_dir=metrics_dir, progress=progress,
                   checkpoints=checkpoints, resumed=resumed)
    if checkpoints is not None and state.d.main:
        checkpoints.remove()
    return last


def run(params: StageView, paths: Paths) -> None:
    """The stage (eagle3pipe.stages.runner.main): paths.draft_config, .verifier, .hidden, .vocab ->
    paths.out; dvclive writes paths.metrics_dir (metrics/train/)."""
    p = params.train
    key = key_of(p, paths.dvc_yaml)
    final = train(p, paths.draft_config, paths.verifier, paths.hidden, paths.vocab,
                  paths.out, metrics_dir=paths.metrics_dir, progress=paths.progress,
                  run=params.run_settings(),
                  record_to=store.counts_path("train", paths.dvc_yaml),
                  checkpoints=Checkpoints(key, Path(paths.dvc_yaml).parent / CHECKPOINTS))
    ev = final.get("eval", {})
    log.info("%s written; step %s, eval loss %.4f, acceptance length (training estimate) %.2f",
             paths.out, final.get("step"), ev.get("loss", float("nan")),
             ev.get("accept_len", float("nan")))
