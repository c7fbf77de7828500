"""The train stage's model (speculators' Trainer.setup_model for our inputs): the draft config
checked against the verifier, speculators' Eagle3DraftModel built from the same
Eagle3SpeculatorConfig the configs stage renders (eagle3pipe.draft.formats.eagle3_config), the
start from a previous draft (train.init_from, eagle3pipe.draft.init_from), and the checkpoint
written as exactly the contract's tensors. eagle3pipe.stages.train.run drives it."""
from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from pathlib import Path

import torch

from eagle3pipe.stages.train.batches import TrainInputError
from eagle3pipe.draft import arch as archmod
from eagle3pipe.draft import init_from
from eagle3pipe.draft.formats import eagle3_config
from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.runtime.distributed import Backend, Dist, autocast
from eagle3pipe.runtime.jsonio import dumps
from eagle3pipe.verifier import families
from eagle3pipe.verifier.handle import VerifierInfo

log = logging.getLogger("eagle3pipe.stages.train")


# ---------------------------------------------------------------------------------------------
# Inputs


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

    return eagle3_config(arch, num_speculative_tokens=speculative_tokens,
                         verifier=VerifierConfig.from_pretrained(str(verifier_dir)),
                         attn_impl=attn_impl)


def build_model(arch: archmod.DraftArch, verifier_dir: str | Path, d2t: torch.Tensor,
                t2d: torch.Tensor, *, speculative_tokens: int, attn_impl: str):
    """A freshly initialised Eagle3DraftModel (current torch RNG) with the vocab mapping set and
    the verifier's embeddings, lm_head rows (t2d) and final norm loaded, as speculators does."""
    from speculators.models.eagle3 import Eagle3DraftModel

    families.register_with_transformers()  # speculators reads the verifier through AutoConfig
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


def start_from(model, arch: archmod.DraftArch, export_dir: str | None) -> dict | None:
    """train.init_from: the export's trained tensors into the fresh model (draft.init_from);
    returns what metrics record of it, or None for the random init."""
    if export_dir is None:
        return None
    tensors, info = init_from.load(export_dir, arch)
    info["vocab_map_equal"] = init_from.apply(model, tensors)
    log.info("train: starting from %s (%s layout, sha256 %s)%s", info["path"], info["layout"],
             info["sha256"][:16], "" if info["vocab_map_equal"] else
             "; its vocab map differs from this run's: keeping this run's d2t/t2d and lm_head")
    return info


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
# Forward/backward of one pack


def token_weights(chunks: list[dict[str, torch.Tensor]]) -> list[float]:
    """Each micro-batch's share of the pack's loss-mask tokens (uniform if none are masked)."""
    n = [float(c["loss_mask"].sum()) for c in chunks]
    total = sum(n)
    return [x / total for x in n] if total > 0 else [1.0 / len(n)] * len(n)


def run_batch(model, chunks: list[dict[str, torch.Tensor]], *, ttt_steps: int,
              ttt_step_loss_decay: float, loss_config, backend: Backend, d: Dist,
              backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (and backward) of one packed batch given as micro-batches. Returns the pack's
    loss (token-weighted over micro-batches) and the accuracy count vector
    [full_correct_i, full_total_i, cond_correct_i, cond_total_i for i < ttt_steps]."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    counts = torch.zeros(4 * ttt_steps, dtype=torch.float64)
    weights = token_weights(chunks)
    for j, (chunk, w) in enumerate(zip(chunks, weights)):
        chunk = {k: v.to(d.device) for k, v in chunk.items()}
        # DDP: gradients are all-reduced once per step, on the last micro-batch (ranks may run
        # different numbers of micro-batches)
        sync = not hasattr(model, "no_sync") or j == len(chunks) - 1 or not backward
        with nullcontext() if sync else model.no_sync():
            with autocast(backend, d):
                _, loss, m = model(**chunk, ttt_steps=ttt_steps,
                                   ttt_step_loss_decay=ttt_step_loss_decay,
                                   loss_config=loss_config)
            if backward:
                (loss * w).backward()
        loss_sum += w * loss.detach().double().cpu()
        counts += torch.stack([m[f"{kind}_acc_{i}_{part}"].detach().double().reshape(())
                               for i in range(ttt_steps) for kind, part in
                               (("full", "sum"), ("full", "total"), ("cond", "sum"),
                                ("cond", "total"))]).cpu()
    return loss_sum, counts
