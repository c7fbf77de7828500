"""The draft's vocabulary map: d2t (int64 [draft_vocab_size], target id = draft id + d2t[draft
id]) and t2d (bool [vocab_size], the target ids the draft can propose), speculators'
convention, which vLLM's EAGLE-3 sampler assumes too; read and checked here for every consumer
(train, export, the checkpoint check). The vocab stage (eagle3pipe.stages.vocab.run) builds it."""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3pipe.errors import Error

MAP_FILE = "vocab_map.safetensors"


class VocabError(Error, ValueError):
    pass


def mapping_problem(d2t: torch.Tensor, t2d: torch.Tensor) -> str | None:
    """None if target id = draft id + d2t[draft id] lists exactly the ids t2d marks, in order
    (what vLLM's and speculators' samplers assume; an all-zero d2t is right only for t2d =
    0..n-1), else what is wrong."""
    targets = torch.arange(len(d2t)) + d2t.long()
    marked = torch.nonzero(t2d.bool()).flatten()
    if len(marked) != len(targets):
        return f"t2d marks {len(marked)} ids, draft vocab is {len(targets)}"
    if torch.equal(marked, targets):
        return None
    bad = int((targets != marked).nonzero()[0])
    return (f"first mismatch at draft id {bad}: draft+d2t = {int(targets[bad])}, t2d marks "
            f"{int(marked[bad])}")


def load(path: str | Path, draft_vocab_size: int | None = None, vocab_size: int | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab], t2d bool [vocab]) from a vocab_map.safetensors file or the
    directory holding it, checked: the tensors, their dtypes, the sizes (when given) and that
    target ids = arange(draft_vocab) + d2t are exactly the ascending ids where t2d is set."""
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        p = p / MAP_FILE
    fix = "rerun `dvc repro vocab`"
    if not p.is_file():
        raise VocabError(f"{p}: vocab map not found", fix)
    t = load_file(str(p))
    for name in ("d2t", "t2d"):
        if name not in t:
            raise VocabError(f"{p}: tensor '{name}' missing", fix)
    d2t, t2d = t["d2t"], t["t2d"]
    n = draft_vocab_size if draft_vocab_size is not None else d2t.numel()
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (n,):
        raise VocabError(f"{p}: d2t is {d2t.dtype} {list(d2t.shape)}, the draft needs "
                         f"int64 [{n}] (draft.draft_vocab_size)", fix)
    v = vocab_size if vocab_size is not None else t2d.numel()
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (v,):
        raise VocabError(f"{p}: t2d is {t2d.dtype} {list(t2d.shape)}, the draft needs "
                         f"bool [{v}] (verifier vocab_size)", fix)
    problem = mapping_problem(d2t, t2d)
    if problem:
        raise VocabError(f"{p}: d2t and t2d disagree (target = draft + d2t[draft] must be "
                         f"exactly the ids t2d marks, in order): {problem}", fix)
    return d2t, t2d
