"""The smoke stage's training-vs-serving agreement: vLLM's acceptance on the training data's eval
split beside the trainer's estimate on the same split.

The trainer (eagle3pipe.stages.train.run.evaluate) reports `acc_pos{i}` on the eval split's hidden
states (metrics/train/metrics.json): the share of reply positions whose draft tokens 0..i all
match the verifier's greedy token. vLLM reports the same quantity at the positions where it
drafts (`acceptance_rate_per_position`). The smoke stage generates the prompts of the first
smoke.agreement_prompts samples of artifacts/dataset/eval.jsonl, each for as many tokens as its
first reply, with the draft (vllm layout) at the serving k, and both sides are summed over the
positions both measure, the first min(k, train.ttt_steps): expected tokens per verifier step,
1 + sum_i rate_i.

Serving below training by more than smoke.max_train_serve_gap (a share of the training
figure) fails the stage: the draft learned from inputs that are not the ones vLLM gives it.
A healthy export agrees closely (the dataset's replies are the verifier's own greedy output, so
serving walks the same sequences); serving above training is recorded, never a failure.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.data import samples
from eagle3pipe.stages.smoke.acceptance import ROUND
from eagle3pipe.runtime.jsonio import read_json_object
from eagle3pipe.stages.smoke.inputs import SmokeError

EVAL_SPLIT = "eval.jsonl"  # in the dataset stage's output directory

LIKELY_CAUSES = (
    "the aux layers vLLM captures (the export's eagle_aux_hidden_state_layer_ids) are not the "
    "ones extract captured (draft.aux_layer_ids)",
    "the capture position: extract's states are taken before/after another point of the layer "
    "than vLLM's (an off-by-one layer shifts every state)",
    "the vocab map: the exported d2t/t2d are not the ones the draft trained with",
    "draft.norm_before_residual differs between training and the exported config",
    "the verifier served is not the one whose states were extracted (vllm.dtype, a changed "
    "checkpoint: see metrics/verifier.json's fingerprint)",
)


@dataclass(frozen=True)
class EvalPrompt:
    ids: list[int]  # the sample's tokens up to its first reply token
    reply: list[int]  # the first reply (loss_mask 1 run) the trainer scored
    source: str  # the sample id


def read_eval(dataset_dir: str | Path, n: int, vocab_size: int, max_model_len: int,
              kmax: int) -> list[EvalPrompt]:
    """The first `n` samples of the eval split, cut into prompt and first reply."""
    path = Path(dataset_dir) / EVAL_SPLIT
    rows = samples.read(path, vocab_size)
    if not rows:
        raise SmokeError(f"{path}: the eval split is empty: the agreement check has nothing "
                         "to measure", fix="set dataset.eval_fraction > 0 (and enough "
                         "dataset.num_samples) and run `dvc repro dataset`")
    out = []
    for row in rows[:n]:
        mask = row.loss_mask
        if 1 not in mask:
            raise SmokeError(f"{path}: sample {row.id} has no reply token (loss_mask all 0)",
                             fix="regenerate it with `dvc repro dataset`")
        start = mask.index(1)
        end = mask.index(0, start) if 0 in mask[start:] else len(mask)
        need = end + kmax + 1
        if need > max_model_len:
            raise SmokeError(f"vllm.max_model_len {max_model_len} is shorter than eval sample "
                             f"{row.id} ({end} tokens) + k + 1 = {need}",
                             fix=f"raise vllm.max_model_len to at least {need}")
        out.append(EvalPrompt(list(row.input_ids[:start]), list(row.input_ids[start:end]),
                              row.id))
    return out


def read_training(path: str | Path) -> list[float]:
    """The trainer's acc_pos0, acc_pos1, ... at its last evaluation."""
    m = read_json_object(Path(path), SmokeError, "run `dvc repro train`",
                         "trainer metrics")
    ev = m.get("eval") if isinstance(m.get("eval"), dict) else {}
    rates = []
    while isinstance(ev.get(f"acc_pos{len(rates)}"), (int, float)):
        rates.append(float(ev[f"acc_pos{len(rates)}"]))
    if not rates:
        raise SmokeError(f"{path}: no eval.acc_pos0: the trainer's evaluation of the eval "
                         "split is missing", fix="keep dataset.eval_fraction > 0 and run "
                         "`dvc repro train`")
    return rates


def compare(serving: dict, training: list[float], k: int, *, tolerance: float,
            prompts: int, replies_equal: int, source: str = EVAL_SPLIT
            ) -> tuple[dict, str | None]:
    """(the record for metrics/smoke.json, the failure or None). `serving` is vLLM's acceptance
    on the eval prompts (stages.smoke.acceptance.acceptance); `replies_equal` how many served
    replies equal the dataset's token for token (greedy decoding in another batch may flip a
    near-tie and go its own way: a diagnostic, not a verdict)."""
    m = min(k, len(training))
    served = 1.0 + sum(serving["acceptance_rate_per_position"][:m])
    trained = 1.0 + sum(training[:m])
    gap = (trained - served) / trained
    record = {
        "source": source, "num_prompts": prompts,
        "replies_equal_dataset": replies_equal, "positions": m,
        "serving": {**serving, "tokens_per_step": round(served, ROUND)},
        "training": {"acceptance_rate_per_position": [round(r, ROUND) for r in training[:m]],
                     "tokens_per_step": round(trained, ROUND)},
        "gap": round(gap, ROUND),
    }
    if gap <= tolerance:
        return record, None
    causes = "\n".join(f"      * {c}" for c in LIKELY_CAUSES)
    return record, (
        f"training and serving disagree: on {prompts} prompts of the eval split vLLM's draft "
        f"gives {served:.4f} tokens per step over the first {m} positions, the trainer "
        f"estimated {trained:.4f} on the same split (per position: serving "
        f"{serving['acceptance_rate_per_position'][:m]}, training "
        f"{record['training']['acceptance_rate_per_position']}): {gap:.1%} lower, above "
        f"smoke.max_train_serve_gap {tolerance:.1%}. "
        f"{replies_equal}/{prompts} served replies equal the dataset's. Likely causes:\n"
        + causes)
