"""The dataset stage's output: the train/eval split and the files that hold it
(out/{train,eval}.jsonl, out/store_keys.json), written sample by sample as batches finish, so
the stage never holds the whole dataset.

A sample's split is a seeded hash of its group (split_of): its id, or for a conversation
source the conversation (group_of), so all turns of one conversation share a split and a
sample's split does not depend on the others (adding samples moves none). With
dataset.eval_fraction > 0 and at least 2 groups, each split gets at least one group: when the
hash leaves one split empty, the group nearest to it moves (Splitter.moved).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from eagle3pipe.data.samples import line

SPLITS = ("train", "eval")
KEY_BYTES = 32  # a store key (data.store.key: a sha256) as raw bytes


def split_of(sample_id: str, seed: int) -> float:
    """A sample's position in [0, 1) for the split: a seeded hash of its id."""
    h = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64


def group_of(sample_id: str) -> str:
    """What a sample is split by: its conversation's source ("<source>#<depth>" -> "<source>"),
    or the id itself when it has no depth (stdlib samples)."""
    head, _, tail = sample_id.rpartition("#")
    return head if head and tail.isdigit() else sample_id


@dataclass
class Splitter:
    """Each group's side (split_of(group) < eval_fraction: eval), with the counts and the two
    extreme groups that decide Splitter.moved; a group's samples arrive one after another."""

    eval_fraction: float
    seed: int
    groups: int = 0
    eval_groups: int = 0
    lowest: tuple[float, str] | None = None
    highest: tuple[float, str] | None = None
    _last: str | None = None

    def is_eval(self, group: str) -> bool:
        k = split_of(group, self.seed)
        if group != self._last:
            self._last = group
            self.groups += 1
            self.eval_groups += k < self.eval_fraction
            self.lowest = min(self.lowest or (k, group), (k, group))
            self.highest = max(self.highest or (k, group), (k, group))
        return k < self.eval_fraction

    def moved(self) -> tuple[str, bool] | None:
        """(group, to eval) when a split would be empty: the lowest-ranked group to eval, or the
        highest-ranked to train; None when both have one (or eval_fraction is 0)."""
        if self.eval_fraction <= 0 or self.groups < 2:
            return None
        if self.eval_groups == 0:
            return self.lowest[1], True
        if self.eval_groups == self.groups:
            return self.highest[1], False
        return None


def split(samples: list[dict], eval_fraction: float, seed: int,
          group: Callable[[str], str] = lambda i: i) -> tuple[list[dict], list[dict]]:
    """(train, eval) of samples held in memory, as SplitWriter splits them."""
    sp = Splitter(eval_fraction, seed)
    side = {g: sp.is_eval(g) for g in dict.fromkeys(group(s["id"]) for s in samples)}
    moved = sp.moved()
    if moved:
        side[moved[0]] = moved[1]
    return ([s for s in samples if not side[group(s["id"])]],
            [s for s in samples if side[group(s["id"])]])


class SplitWriter:
    """folder/{train,eval}.jsonl, one canonical line per sample as it is added (samples.line),
    and on finish() folder/store_keys.json: each split's reply-store keys in the order of its
    samples (what `eagle3pipe gc` keeps). For use as a context manager inside the stage's
    atomic output folder. Memory: 32 bytes per sample (its key, raw, in one buffer per split;
    as a string it took ~120), nothing else that grows. Moving a group (Splitter.moved) rereads
    the other split's file."""

    def __init__(self, folder: Path, eval_fraction: float, seed: int,
                 group: Callable[[str], str] = lambda i: i):
        self.folder, self.group = Path(folder), group
        self.splitter = Splitter(eval_fraction, seed)
        self.keys: dict[str, bytearray] = {name: bytearray() for name in SPLITS}
        self._files = {name: (self.folder / f"{name}.jsonl").open("w", encoding="utf-8",
                                                                   newline="\n")
                       for name in SPLITS}

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, *exc) -> None:
        for fh in self._files.values():
            fh.close()

    def add(self, sample: dict, key: str) -> None:
        name = "eval" if self.splitter.is_eval(self.group(sample["id"])) else "train"
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = b""
        if len(raw) != KEY_BYTES:
            raise ValueError(f"{sample['id']}: {key!r} is not a store key (data.store.key)")
        self._files[name].write(line(sample))
        self.keys[name] += raw

    def finish(self) -> tuple[int, int]:
        """Closes the files, moves a group if a split is empty, writes store_keys.json;
        (train samples, eval samples)."""
        self.__exit__()
        moved = self.splitter.moved()
        if moved:
            self._move(*moved)
        self._write_keys(self.folder / "store_keys.json")
        return len(self.keys["train"]) // KEY_BYTES, len(self.keys["eval"]) // KEY_BYTES

    def split_keys(self, name: str) -> Iterator[str]:
        """A split's store keys, in the order of its samples."""
        raw = self.keys[name]
        return (raw[i:i + KEY_BYTES].hex() for i in range(0, len(raw), KEY_BYTES))

    def _write_keys(self, path: Path) -> None:
        """store_keys.json as runtime.jsonio.write_json writes {split: [keys]}, byte for byte,
        one key at a time (no list of every key)."""
        with path.open("w", encoding="utf-8", newline="\n") as fh:
            fh.write("{\n")
            for n, name in enumerate(sorted(SPLITS)):
                keys = self.split_keys(name)
                first = next(keys, None)
                fh.write(f'  "{name}": ' + ("[]" if first is None else f'[\n    "{first}"'))
                for k in keys:
                    fh.write(f',\n    "{k}"')
                fh.write(("" if first is None else "\n  ]") + (",\n" if n == 0 else "\n"))
            fh.write("}\n")

    def _move(self, group: str, to_eval: bool) -> None:
        """`group`'s samples from one split to the other, which is empty (hence the move)."""
        src, dst = ("train", "eval") if to_eval else ("eval", "train")
        path = self.folder / f"{src}.jsonl"
        rows = list(zip(path.read_text(encoding="utf-8").splitlines(keepends=True),
                        self.split_keys(src)))
        goes = [self.group(json.loads(text)["id"]) == group for text, _ in rows]
        for name, keep in ((src, False), (dst, True)):
            picked = [r for r, g in zip(rows, goes) if g == keep]
            (self.folder / f"{name}.jsonl").write_text("".join(t for t, _ in picked),
                                                       encoding="utf-8", newline="\n")
            self.keys[name] = bytearray(b"".join(bytes.fromhex(k) for _, k in picked))
