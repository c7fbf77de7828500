"""The dataset stage's sample files (artifacts/dataset/{train,eval}.jsonl): one writer, one
checked reader, for every stage that reads them (vocab, extract, train's benchmarks).

One JSON object per line, keys sorted, compact: {"id", "input_ids", "loss_mask", "messages",
...}; input_ids are the verifier's token ids of the chat-formatted conversation, loss_mask is 1
on the assistant tokens the draft learns to predict.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from eagle3pipe.errors import Error


class SamplesError(Error, ValueError):
    """A bad sample file: names file:line and the command that regenerates it."""


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


def line(sample: dict) -> str:
    """Canonical JSON of one sample."""
    return json.dumps(sample, sort_keys=True, separators=(",", ":")) + "\n"


def write_jsonl(path: Path, samples: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        for s in samples:
            fh.write(line(s))


def read(path: str | os.PathLike, vocab_size: int, max_positions: int | None = None, *,
         progress: bool = False, desc: str = "read") -> list[Sample]:
    """One dataset JSONL ({"id", "input_ids", "loss_mask", ...} per line), every line checked
    against the verifier's vocabulary (and max positions, when given); a bad line is an error
    naming file:line and `dvc repro dataset`."""
    path = Path(path)
    fix = "regenerate it with `dvc repro dataset`"
    if not path.is_file():
        raise SamplesError(f"{path}: dataset split not found; {fix}")
    samples: list[Sample] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(tqdm(fh, desc=desc, disable=not progress,
                                           mininterval=1.0), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SamplesError(f"{where}: invalid JSON ({e.msg}); {fix}") from None
            if not isinstance(row, dict):
                raise SamplesError(f"{where}: expected a JSON object; {fix}")
            missing = [k for k in ("id", "input_ids", "loss_mask") if k not in row]
            if missing:
                raise SamplesError(f"{where}: missing key(s) {missing}; {fix}")
            ids, mask = row["input_ids"], row["loss_mask"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                raise SamplesError(f"{where}: input_ids must be a non-empty list of integers; {fix}")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplesError(f"{where}: token id {bad[0]} outside the verifier vocabulary "
                                   f"[0, {vocab_size}); the dataset was tokenized for another "
                                   f"verifier: {fix}")
            if not isinstance(mask, list) or len(mask) != len(ids) or any(
                    m not in (0, 1) or isinstance(m, bool) for m in mask):
                raise SamplesError(f"{where}: loss_mask must be a list of 0/1 with one entry per "
                                   f"input id ({len(ids)}); {fix}")
            if max_positions is not None and len(ids) > max_positions:
                raise SamplesError(f"{where}: {len(ids)} tokens exceed the verifier's "
                                   f"max_position_embeddings={max_positions}; lower "
                                   f"dataset.max_seq_len in params.yaml")
            samples.append(Sample(str(row["id"]), tuple(ids), tuple(mask)))
    return samples
