"""Draft vocabulary: the draft_vocab_size most frequent loss-masked training tokens.

The mapping is speculators' own (speculators.train.vocab_mapping.
build_vocab_mappings_from_distribution, reused as is):
  - tokens ranked by (descending count, ascending target id) - ties are deterministic;
  - if fewer distinct tokens occur than draft_vocab_size, the lowest unused target ids fill the
    rest (counted as `filled` in stats.json);
  - draft ids are ordered by ascending target id;
  - d2t int64 [draft_vocab] holds OFFSETS: target = draft + d2t[draft] (an all-zero d2t loads
    fine in vLLM and is wrong);
  - t2d bool [verifier vocab] marks the chosen target ids.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from eagle3pipe.config.view import StageView
from eagle3pipe.data.samples import read as read_samples
from eagle3pipe.draft.vocab_map import MAP_FILE, VocabError, mapping_problem
from eagle3pipe.errors import ParamsAt
from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.runtime.jsonio import write_json
from eagle3pipe.stages.runner import Paths
from eagle3pipe.verifier.handle import VerifierInfo

log = logging.getLogger("eagle3pipe.stages.vocab")


def count_masked_tokens(train_jsonl: str | Path, vocab_size: int, *,
                        progress: bool = True) -> tuple[Counter, int]:
    """Counts of target ids at loss-masked positions, and the number of samples read
    (eagle3pipe.data.samples.read: every bad line is an error naming file:line)."""
    rows = read_samples(train_jsonl, vocab_size, progress=progress, desc="vocab: count")
    if not rows:
        raise VocabError(f"{train_jsonl}: no samples",
                         "rerun the dataset stage with more data")
    counts: Counter = Counter(t for r in rows for t, m in zip(r.input_ids, r.loss_mask) if m)
    return counts, len(rows)


def build_mapping(counts: dict[int, int], draft_vocab_size: int, vocab_size: int, *,
                  at: ParamsAt = ParamsAt()) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab_size], t2d bool [vocab_size]) by speculators' convention."""
    if draft_vocab_size > vocab_size:
        raise VocabError(problems=[at.problem(
            "draft.draft_vocab_size", f"{draft_vocab_size} exceeds the verifier's vocab_size "
            f"({vocab_size})", f"set draft.draft_vocab_size <= {vocab_size}")])
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(dict(counts), draft_vocab_size, vocab_size)
    d2t, t2d = d2t.to(torch.int64).contiguous(), t2d.to(torch.bool).contiguous()
    problem = mapping_problem(d2t, t2d)  # the invariant every consumer relies on
    assert problem is None, problem
    return d2t, t2d


def stats(counts: dict[int, int], d2t: torch.Tensor, samples: int) -> dict:
    chosen = set((torch.arange(len(d2t)) + d2t).tolist())
    total = sum(counts.values())
    covered = sum(c for t, c in counts.items() if t in chosen)
    return {
        "samples": samples,
        "masked_tokens": total,
        "distinct_tokens_seen": len(counts),
        "draft_vocab_size": len(d2t),
        "distinct_seen_in_draft_vocab": sum(1 for t in counts if t in chosen),
        "filled": sum(1 for t in chosen if t not in counts),
        "masked_tokens_covered": covered,
        "coverage": round(covered / total, 6) if total else 0.0,
    }


def save(out_dir: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, st: dict) -> None:
    """vocab_map.safetensors (what train and export read), the same tensors as the .npy files
    `speculators train --d2t-path d2t.npy --t2d-path t2d.npy` loads (speculators/train/cli.py
    `_load_mappings`: np.load, then torch.from_numpy), and stats.json."""
    import numpy as np
    from safetensors.torch import save_file

    with atomic_dir(out_dir) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp / MAP_FILE))
        for name, t in (("d2t", d2t), ("t2d", t2d)):
            np.save(tmp / f"{name}.npy", t.numpy(), allow_pickle=False)
        write_json(tmp / "stats.json", st)


def build(train_jsonl: str | Path, draft_vocab_size: int, vocab_size: int, out_dir: str | Path,
          *, progress: bool = True, at: ParamsAt = ParamsAt()) -> dict:
    """The vocab stage: counts, mapping, out_dir/{vocab_map.safetensors, stats.json}.
    `at` locates draft.draft_vocab_size in errors (StageView.params_at)."""
    if draft_vocab_size > vocab_size:  # refuse before reading anything
        build_mapping({}, draft_vocab_size, vocab_size, at=at)
    counts, n = count_masked_tokens(train_jsonl, vocab_size, progress=progress)
    d2t, t2d = build_mapping(counts, draft_vocab_size, vocab_size, at=at)
    st = stats(counts, d2t, n)
    if st["filled"]:
        log.warning("only %d distinct tokens in %s; filled %d draft slots with the lowest "
                    "unused target ids", st["distinct_tokens_seen"], train_jsonl, st["filled"])
    save(out_dir, d2t, t2d, st)
    log.info("%d of %d distinct masked tokens in a draft vocab of %d; coverage %.4f of "
             "%d masked tokens", st["distinct_seen_in_draft_vocab"], st["distinct_tokens_seen"],
             draft_vocab_size, st["coverage"], st["masked_tokens"])
    return st


def run(params: StageView, paths: Paths) -> None:
    """The stage (eagle3pipe.stages.runner.main): paths.dataset (train.jsonl), paths.verifier_config,
    paths.out; reads draft.draft_vocab_size."""
    info = VerifierInfo.from_config(paths.verifier_config)
    build(paths.dataset, params.draft.draft_vocab_size, info.vocab_size, paths.out,
          progress=paths.progress, at=params.params_at)
