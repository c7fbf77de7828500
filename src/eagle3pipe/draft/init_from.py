"""Starting a draft from an existing draft export (`train.init_from`).

Published drafts are often continued from a previous draft (speculators documents two-stage
training; Kimi drafts started from the previous version's). `train.init_from` names an export
directory under `drafts/` (config.json + *.safetensors, speculators' or the flat vLLM layout),
a dependency of the train stage, so replacing or editing it reruns training.

The export must describe exactly the draft params.yaml derives (dtype aside: an export is cast,
training keeps float32): eagle3pipe.draft.checkpoint.check_checkpoint compares its config field
by field and its tensors name by name against arch.contract, the same check `eagle3pipe check
--checkpoint` runs, so a mismatch is named tensor by tensor. Its contract tensors replace the
freshly initialised ones (renamed to speculators' layout, float32); the verifier's embedding,
lm_head rows and final norm stay as loaded from the verifier, and the vocab map is this run's
(DERIVED). The fingerprint (sha256 of the
config and of every safetensors file, in name order) goes into the train metrics.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3pipe.config.cross_check import INIT_DIR
from eagle3pipe.draft import arch as A
from eagle3pipe.draft import parsing
from eagle3pipe.draft.checkpoint import check_checkpoint
from eagle3pipe.errors import Error
from eagle3pipe.runtime.hashing import sha256_files

FIX = (f"point train.init_from at a draft exported for this architecture (the export stage "
       f"writes artifacts/export/{{vllm,speculators}}; copy one into {INIT_DIR}/<name>), or set "
       "it to null to start from a random init")


class InitFromError(Error, ValueError):
    """train.init_from names something that is not a draft of this architecture."""


def fingerprint(export_dir: str | Path) -> str:
    """sha256 over config.json and every *.safetensors file (names and bytes, in name order)."""
    d = Path(export_dir)
    return sha256_files(d, [d / "config.json", *sorted(d.glob("*.safetensors"))])


def load(export_dir: str | Path, arch: A.DraftArch) -> tuple[dict[str, torch.Tensor], dict]:
    """(the export's contract tensors in speculators' layout, float32 (d2t int64, t2d bool);
    {"path", "layout", "sha256"}), after check_checkpoint found nothing wrong."""
    from safetensors.torch import load_file

    d = Path(export_dir)
    if not d.is_dir():
        raise InitFromError(f"train.init_from: {d} is not a directory", fix=FIX)
    problems = check_checkpoint(d, arch, against="params.yaml (configs/draft_config.json)")
    if problems:
        raise InitFromError(f"train.init_from: {d} does not fit the draft params.yaml "
                            "describes:\n  - " + "\n  - ".join(problems), fix=FIX)
    _, _, layout = parsing.read_config_file(d / "config.json",
                                            verifier_num_layers=arch.verifier_num_layers)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for name in A.contract(arch, layout):
        t = tensors[name]
        out[A.rename(name, layout, "speculators")] = t.float() if t.is_floating_point() else t
    return out, {"path": str(d), "layout": layout, "sha256": fingerprint(d)}


# what the run itself derives: the vocab map (the vocab stage, from this run's data) and the
# lm_head rows it selects from the verifier's (frozen in training, as speculators trains)
DERIVED = ("d2t", "t2d", "lm_head.weight")


def apply(model, tensors: dict[str, torch.Tensor]) -> bool:
    """Copies the export's trained tensors (all but DERIVED) into the model's parameters of the
    same names. Returns whether the export's vocab map equals this run's (when it differs, the
    draft keeps this run's vocabulary and lm_head rows; its layer starts from the export)."""
    state = model.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in DERIVED:
                state[name].copy_(t.to(state[name].dtype))
    return all(torch.equal(state[n].cpu().to(tensors[n].dtype), tensors[n])
               for n in ("d2t", "t2d"))
