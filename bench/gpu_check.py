"""The GPU check (issue 35): the micro draft trained on a GPU from hidden states made on CPU, by
the train stage's own loop (eagle3pipe.stages.train.run: setup, step, evaluate with
train.device: cuda, bf16 autocast, flex attention, the fused loss where Triton imports) and by
speculators' own Trainer (speculators.train.trainer.Trainer.train_epoch) on the same data: the
same checked inputs, the same seeded initial weights, the same packs in the same order, the
same AdamW learning rate. It needs no vLLM: the inputs are a micro run's files.

    python bench/gpu_check.py RUN_DIR OUT.json [--device cuda] [--steps N]

RUN_DIR holds a micro run's artifacts/verifier, artifacts/hidden, artifacts/vocab and
configs/draft_config.json (tests/micro/params.yaml's train section is the run's). OUT.json gets
per trainer: the loss at each step, the eval loss and acceptance length before and after,
tokens/s over the steps (after one warm-up step, the device synchronised), the device's name.
On CPU it runs the same code at the same size (tests/test_bench.py), so the only thing the
GPU machine adds is the device.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _params(device: str):
    from eagle3pipe.config import params

    p = params.load(ROOT / "tests/micro/params.yaml").train
    return dataclasses.replace(p, device=device, threads=max(1, p.threads))


def inputs_of(run: Path) -> types.SimpleNamespace:
    """A micro run's train-stage inputs, as dvc.yaml names them."""
    return types.SimpleNamespace(draft_config=run / "configs/draft_config.json",
                                 verifier=run / "artifacts/verifier",
                                 hidden=run / "artifacts/hidden", vocab=run / "artifacts/vocab")


def _state(p, inp, loss_impl: str):
    """The TrainState setup() makes with train.loss_impl set to `loss_impl` (auto: on CUDA
    speculators' fused Triton loss; eager: its plain-torch one)."""
    from eagle3pipe.stages.train import run as T

    p = dataclasses.replace(p, loss_impl=loss_impl)
    return T.setup(p, inp.draft_config, inp.verifier, inp.hidden, inp.vocab)


def _tokens(s, packs) -> int:
    return sum(s.train.lengths[i] for idx in packs for i in idx)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ours(p, inp, steps: int, loss_impl: str = "auto") -> dict:
    """The train stage's loop: step() per pack, evaluate() before and after."""
    from eagle3pipe.stages.train import run as T

    s = _state(p, inp, loss_impl)
    packs = [idx for epoch in s.per_epoch for idx in epoch][:steps + 1]
    before = T.evaluate(s)
    s.model.train()
    losses = [T.step(s, packs[0])[0]]  # the warm-up step (kernels compiled, caches filled)
    _sync(p.device)
    t0 = time.perf_counter()
    for idx in packs[1:]:
        losses.append(T.step(s, idx)[0])
    _sync(p.device)
    seconds = time.perf_counter() - t0
    tokens = _tokens(s, packs[1:])
    return {"losses": [round(x, 5) for x in losses], "eval_before": before,
            "eval_after": T.evaluate(s), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "loss_impl": s.backend.loss_impl,
            "attention": s.backend.attn_impl}


def speculators_trainer(p, inp, steps: int, out: Path, loss_impl: str = "auto") -> dict:
    """speculators' Trainer.train_epoch over the same packs, from the same initial weights; its
    per-step loss read back from its metric logger calls."""
    from speculators.train import trainer as S
    from torch.utils.data import DataLoader

    from eagle3pipe.stages.train import run as T

    s = _state(p, inp, loss_impl)  # the same seed: the same initial weights and packs as ours()
    packs = [idx for epoch in s.per_epoch for idx in epoch][:steps + 1]
    before = T.evaluate(s)
    loader = DataLoader(s.train.ds, batch_sampler=packs, collate_fn=s.train.collate)
    cfg = S.TrainerConfig(
        lr=p.learning_rate, num_epochs=1, save_path=str(out / "speculators"),
        train_call_kwargs={"ttt_steps": p.ttt_steps, "ttt_step_loss_decay": p.ttt_step_loss_decay,
                           "loss_config": s.loss_config},
        weight_decay=p.weight_decay, scheduler_type="cosine",
        scheduler_warmup_steps=p.warmup_steps, scheduler_total_steps=s.limit,
        checkpoint_freq=10 ** 9)
    trainer = S.Trainer(s.core, cfg, loader)
    losses: list[float] = []

    class Losses(logging.Handler):  # its metric logger: {"train": {"loss": ...}, ...} per step
        def emit(self, record):
            if isinstance(record.msg, dict) and "loss" in record.msg.get("train", {}):
                losses.append(round(float(record.msg["train"]["loss"]), 5))

    S.metric_logger.setLevel(logging.INFO)
    S.metric_logger.addHandler(Losses())
    _sync(p.device)
    t0 = time.perf_counter()
    trainer.train_epoch(0)
    _sync(p.device)
    seconds = time.perf_counter() - t0
    tokens = _tokens(s, packs)
    return {"losses": losses, "eval_before": before, "eval_after": T.evaluate(s),
            "tokens": tokens, "tokens_per_s_with_first_step": round(tokens / seconds, 1),
            "loss_impl": s.backend.loss_impl}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    p = _params(a.device)
    res = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
           "torch": torch.__version__, "steps": a.steps}
    # train.loss_impl auto first (on CUDA the fused Triton loss), then speculators' eager loss;
    # each trainer on each, an error recorded as what it measured
    for impl in ("auto", "eager"):
        name = "default" if impl == "auto" else impl
        for who, fn in (("ours", ours), ("speculators_trainer", speculators_trainer)):
            args = (p, inputs_of(a.run), a.steps) + ((a.out.parent,) if fn is not ours else ())
            try:
                res[f"{who}:{name}"] = fn(*args, loss_impl=impl)
            except Exception as e:  # noqa: BLE001 - recorded: the rest of the check still counts
                res[f"{who}:{name}"] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
