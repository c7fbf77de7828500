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

import json
import logging
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3pipe.errors import Error
from eagle3pipe.runtime import atomic_dir, write_json

log = logging.getLogger(__name__)


class VocabError(Error, ValueError):
    pass


def count_masked_tokens(train_jsonl: str | Path, vocab_size: int, *,
                        progress: bool = True) -> tuple[Counter, int]:
    """Counts of target ids at loss-masked positions, and the number of samples read. Every bad
    line is an error naming file:line."""
    path = Path(train_jsonl)
    if not path.is_file():
        raise VocabError(f"{path}: not found; run the dataset stage first (dvc repro dataset)")
    counts: Counter = Counter()
    n = 0
    with path.open(encoding="utf-8") as fh:
        for lineno, raw in enumerate(tqdm(fh, desc="vocab: count", disable=not progress,
                                          mininterval=1.0), start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                sample = json.loads(raw)
            except json.JSONDecodeError as e:
                raise VocabError(f"{where}: not valid JSON ({e}); fix: rerun the dataset "
                                 "stage") from None
            ids, mask = sample.get("input_ids"), sample.get("loss_mask")
            if not isinstance(ids, list) or not isinstance(mask, list):
                raise VocabError(f"{where}: needs lists input_ids and loss_mask; fix: rerun the "
                                 "dataset stage")
            if len(ids) != len(mask):
                raise VocabError(f"{where}: input_ids has {len(ids)} tokens, loss_mask "
                                 f"{len(mask)}; fix: rerun the dataset stage")
            for t, m in zip(ids, mask):
                if m not in (0, 1):
                    raise VocabError(f"{where}: loss_mask holds {m!r}, expected 0 or 1")
                if m:
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                        raise VocabError(
                            f"{where}: token id {t!r} outside the verifier vocab [0, "
                            f"{vocab_size}); fix: rebuild the dataset with this verifier")
                    counts[t] += 1
            n += 1
    if n == 0:
        raise VocabError(f"{path}: no samples; fix: rerun the dataset stage with more data")
    return counts, n


def build_mapping(counts: dict[int, int], draft_vocab_size: int, vocab_size: int, *,
                  where: str = "params.yaml") -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab_size], t2d bool [vocab_size]) by speculators' convention."""
    if draft_vocab_size > vocab_size:
        raise VocabError(f"{where}: draft.draft_vocab_size ({draft_vocab_size}) exceeds the "
                         f"verifier's vocab_size ({vocab_size}); fix: set "
                         f"draft.draft_vocab_size <= {vocab_size}")
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(dict(counts), draft_vocab_size, vocab_size)
    d2t, t2d = d2t.to(torch.int64).contiguous(), t2d.to(torch.bool).contiguous()
    # the invariants every consumer relies on
    targets = torch.arange(draft_vocab_size) + d2t
    assert int(t2d.sum()) == draft_vocab_size
    assert torch.equal(targets, torch.nonzero(t2d).flatten())
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
    from safetensors.torch import save_file

    with atomic_dir(out_dir) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp / "vocab_map.safetensors"))
        write_json(tmp / "stats.json", st)


def load(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a vocab_map.safetensors file or the directory holding it."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "vocab_map.safetensors"
    t = load_file(str(path))
    return t["d2t"], t["t2d"]


def build(train_jsonl: str | Path, draft_vocab_size: int, vocab_size: int, out_dir: str | Path,
          *, progress: bool = True, where: str = "params.yaml") -> dict:
    """The vocab stage: counts, mapping, out_dir/{vocab_map.safetensors, stats.json}.
    `where` names the params file (and line) of draft.draft_vocab_size in errors."""
    if draft_vocab_size > vocab_size:  # refuse before reading anything
        build_mapping({}, draft_vocab_size, vocab_size, where=where)
    counts, n = count_masked_tokens(train_jsonl, vocab_size, progress=progress)
    d2t, t2d = build_mapping(counts, draft_vocab_size, vocab_size, where=where)
    st = stats(counts, d2t, n)
    if st["filled"]:
        log.warning("only %d distinct tokens in %s; filled %d draft slots with the lowest "
                    "unused target ids", st["distinct_tokens_seen"], train_jsonl, st["filled"])
    save(out_dir, d2t, t2d, st)
    log.info("%d of %d distinct masked tokens in a draft vocab of %d; coverage %.4f of "
             "%d masked tokens", st["distinct_seen_in_draft_vocab"], st["distinct_tokens_seen"],
             draft_vocab_size, st["coverage"], st["masked_tokens"])
    return st


def run(params, paths) -> None:
    """The stage (eagle3pipe.stage.main): paths.dataset (train.jsonl), paths.verifier_config,
    paths.out; reads draft.draft_vocab_size."""
    from eagle3pipe.verifier import VerifierInfo

    info = VerifierInfo.from_config(paths.verifier_config)
    build(paths.dataset, params.draft.draft_vocab_size, info.vocab_size, paths.out,
          progress=paths.progress, where=params.where("draft.draft_vocab_size"))
