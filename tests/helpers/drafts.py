"""Test helper: writes real EAGLE-3 draft checkpoints (config.json + model.safetensors) in both
layouts, with tensor names/shapes from arch.contract and configs rendered by formats.py exactly as
the `configs` stage renders them.

Weights are random (seeded) or controlled; negative controls can drop tensors or build the
weights from a different architecture than the config describes (e.g. head_dim 64 weights under a
config that says 32).
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from eagle3pipe.draft import arch as A
from eagle3pipe.draft import formats
from eagle3pipe.stages.export.run import TORCH_DTYPE
from eagle3pipe.config.schema import DraftParams
from eagle3pipe.runtime.jsonio import dumps
from eagle3pipe.verifier.handle import VerifierInfo

# Micro draft for the micro verifier of conftest.py (hidden 64, 4 layers, vocab 512).
MICRO_DRAFT = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                   intermediate_size=128, aux_layer_ids=[1, 2, 3], draft_vocab_size=256,
                   norm_before_residual=True, norm_before_fc=False, fc_norm=False,
                   norm_output=False, draft_arch="llama", rope_theta=10000.0, rope_scaling=None,
                   rms_norm_eps=1e-6, max_position_embeddings=1024, hidden_act="silu",
                   dtype="float32", num_speculative_tokens=3)


def micro_draft_params(**overrides) -> DraftParams:
    return DraftParams(**{**MICRO_DRAFT, **overrides})


def micro_arch(verifier_dir: str | Path, **overrides) -> A.DraftArch:
    """The micro draft architecture derived (by arch.derive) for a verifier checkpoint."""
    return A.derive(micro_draft_params(**overrides), VerifierInfo.from_config(verifier_dir))


def vocab_map(arch: A.DraftArch, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-trivial (not all-zero) d2t/t2d pair that always contains target id 0 (= draft id 0)."""
    g = torch.Generator().manual_seed(seed)
    rest = torch.randperm(arch.vocab_size - 1, generator=g)[:arch.draft_vocab_size - 1] + 1
    targets = torch.cat([torch.zeros(1, dtype=torch.long), rest.sort().values])
    d2t = targets - torch.arange(arch.draft_vocab_size)
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[targets] = True
    return d2t.to(torch.int64), t2d


def make_weights(arch: A.DraftArch, layout: str, *, mode: str = "random", seed: int = 0,
                 std: float = 0.05) -> dict[str, torch.Tensor]:
    """Tensors exactly as arch.contract(arch, layout) names and shapes them (the same values in
    either layout for the same seed, as the export stage writes one checkpoint twice).

    mode "random": seeded normal weights, RMSNorm weights 1 (an untrained draft).
    mode "zero_norm": as random, but the final norm is zero, so every draft logit is 0 and
    the draft always proposes draft id 0 (= target id 0, see vocab_map).
    """
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = vocab_map(arch, seed)
    out = {}
    # drawn in one canonical order, then renamed: both layouts get the same values
    for canonical, spec in A.contract(arch, "speculators").items():
        name = A.rename(canonical, "speculators", layout)
        dt = TORCH_DTYPE[spec.dtype]
        if name == "d2t":
            out[name] = d2t
        elif name == "t2d":
            out[name] = t2d
        elif "norm" in name:
            out[name] = torch.ones(spec.shape, dtype=dt)
        else:
            out[name] = (torch.randn(spec.shape, generator=g) * std).to(dt)
    if mode == "zero_norm":
        out["norm.weight"].zero_()
    elif mode != "random":
        raise ValueError(f"unknown weights mode {mode!r}")
    return out


def config_for(arch: A.DraftArch, layout: str, *, verifier_dir: str | Path,
               num_speculative_tokens: int) -> dict:
    if layout == "vllm":
        return formats.flat_config(arch)
    return formats.speculators_config(
        arch, num_speculative_tokens=num_speculative_tokens,
        verifier_name_or_path=str(verifier_dir),
        verifier_architectures=list(VerifierInfo.from_config(verifier_dir).architectures))


def write_draft(out_dir: str | Path, arch: A.DraftArch, layout: str, *,
                verifier_dir: str | Path, num_speculative_tokens: int = 3,
                mode: str = "random", seed: int = 0, weights_arch: A.DraftArch | None = None,
                omit: tuple[str, ...] = (),
                edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """Writes {config.json, model.safetensors}. The config describes `arch`; the weights follow
    `weights_arch` (default: arch), minus the tensors named in `omit`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = make_weights(weights_arch or arch, layout, mode=mode, seed=seed)
    for name in omit:
        del tensors[name]
    if edit is not None:
        edit(tensors)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())},
              str(out / "model.safetensors"))
    cfg = config_for(arch, layout, verifier_dir=verifier_dir,
                     num_speculative_tokens=num_speculative_tokens)
    (out / "config.json").write_text(dumps(cfg))
    return out


def write_export(export_dir: str | Path, arch: A.DraftArch, *, verifier_dir: str | Path,
                 num_speculative_tokens: int = 3, **kw) -> Path:
    """An export dir as the export stage writes it: speculators/ and vllm/, same weights."""
    root = Path(export_dir)
    for layout in A.LAYOUTS:
        write_draft(root / layout, arch, layout, verifier_dir=verifier_dir,
                    num_speculative_tokens=num_speculative_tokens, **kw)
    return root


def zero_final_norm(verifier_dir: str | Path) -> Path:
    """Zeroes the verifier's final norm in place: every logit ties (0), greedy picks id 0."""
    path = Path(verifier_dir) / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.norm.weight"
    assert name in tensors, sorted(tensors)
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(verifier_dir)


def copy_verifier(src: str | Path, dst: str | Path) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def with_head_dim(arch: A.DraftArch, head_dim: int) -> A.DraftArch:
    return replace(arch, head_dim=head_dim)


def scramble_verifier(verifier_dir: str | Path, *, seed: int = 0, std: float = 0.2) -> Path:
    """Replaces the verifier's weights (in place) with seeded random ones, norms kept: greedy
    text without loops or ties, so speculative and plain decoding diverge on any inexactness."""
    path = Path(verifier_dir) / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        t = tensors[name]
        if "norm" not in name and t.is_floating_point():
            tensors[name] = (torch.randn(t.shape, generator=g) * std).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(verifier_dir)
