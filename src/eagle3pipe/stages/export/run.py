"""Exports the trained draft in the two formats vLLM loads, both from one checkpoint:

  <out>/speculators/  config.json = configs/speculators/config.json (bytes verbatim),
                      model.safetensors in speculators' layout (`layers.0.*`)
  <out>/vllm/         config.json = configs/vllm/config.json (bytes verbatim),
                      model.safetensors in the flat LlamaForCausalLMEagle3 layout (`midlayer.*`)

The configs are copied, never re-rendered, so an export cannot drift from configs/. Nothing in
them is only known at export time: the configs stage already renders
`speculators_config.verifier.name_or_path` (the relative dir "artifacts/verifier" for the
embedded verifier, verifier.path otherwise) and the export dtype. Weights follow
arch.contract(arch, layout, embed_tokens=False): vLLM shares the verifier's embedding when the
hidden sizes match (they always do here), so no embed_tokens is written.

Before anything is written the trained checkpoint (its config.json and tensors) is checked
against configs/vllm/config.json by eagle3pipe.draft.checkpoint.check_checkpoint, the check
`eagle3pipe check --checkpoint` runs: a checkpoint trained for another architecture (another
head_dim, other aux ids) is rejected with the tensor and the config field that disagree. Each
written export must then pass the same check (names, shapes, dtypes, nothing missing or extra,
d2t consistent with t2d), or the output is not replaced (atomic).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagle3pipe.config.view import StageView
from eagle3pipe.draft import arch as archmod
from eagle3pipe.draft import formats, parsing
from eagle3pipe.draft.checkpoint import check_checkpoint
from eagle3pipe.errors import Error
from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.stages.runner import Paths
from eagle3pipe.verifier.handle import VerifierInfo

log = logging.getLogger("eagle3pipe.stages.export")

TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
               "I64": torch.int64, "BOOL": torch.bool}
FORMATS = {"speculators": "speculators", "vllm": "vllm"}  # output subdir -> contract layout
# What speculators' Eagle3Converter writes on its own (_create_transformer_config_from_eagle,
# speculators/convert/eagle/eagle3_converter.py): no bos/eos ids (LlamaConfig's 1 and 2), and
# max_position_embeddings = max(draft's, verifier's).
CONVERTER_REWRITES = ("bos_token_id", "eos_token_id", "max_position_embeddings")


class ExportError(Error, ValueError):
    """The message names the file, tensor or field that is wrong and the fix."""


def read_configs(speculators_config: str | Path, vllm_config: str | Path,
                 verifier: str | Path) -> dict[str, tuple[bytes, archmod.DraftArch]]:
    """{"speculators": (bytes, arch), "vllm": (bytes, arch)} of the two configs/ files, parsed
    by eagle3pipe.draft.parsing (no field defaulted), checked to be one render for this verifier."""
    v = VerifierInfo.from_config(verifier)
    out = {}
    for want, path in (("speculators", speculators_config), ("vllm", vllm_config)):
        raw, a, found = parsing.read_config_file(path, verifier_num_layers=v.num_hidden_layers)
        if found != want:
            raise ExportError(f"{path}: is a {found}-layout config, expected the {want} one; "
                              "check the export stage's arguments in dvc.yaml")
        out[want] = (raw, a)
    diffs = parsing.differences(out["speculators"][1], out["vllm"][1])
    if diffs:
        raise ExportError(f"{speculators_config} and {vllm_config} disagree on " + ", ".join(
            f"{f} ({a!r} vs {b!r})" for f, a, b in diffs) + "; they are generated together: "
            "run `dvc repro configs`")
    flat = out["vllm"][1]
    if (flat.hidden_size, flat.vocab_size) != (v.hidden_size, v.vocab_size):
        raise ExportError(f"{vllm_config}: hidden_size {flat.hidden_size} / vocab_size "
                          f"{flat.vocab_size} do not match the verifier ({v.source}: "
                          f"{v.hidden_size} / {v.vocab_size}); run `dvc repro configs`")
    return out


def convert(tensors: dict[str, torch.Tensor], a: archmod.DraftArch,
            layout: str) -> dict[str, torch.Tensor]:
    """Speculators-layout tensors -> `layout` names, cast to the contract dtypes."""
    out = {}
    for name, spec in archmod.contract(a, layout).items():
        src = archmod.rename(name, layout, "speculators")
        out[name] = tensors[src].to(TORCH_DTYPE[spec.dtype]).contiguous()
    return out


def export(checkpoint: str | Path, speculators_config: str | Path, vllm_config: str | Path,
           verifier: str | Path, out_dir: str | Path) -> dict:
    """Writes <out_dir>/speculators and <out_dir>/vllm (atomically, both or neither).
    Returns a summary {format: {"tensors": n, "bytes": size, "dtype": ...}}."""
    from safetensors.torch import load_file, save_file

    configs = read_configs(speculators_config, vllm_config, verifier)
    flat_arch = configs["vllm"][1]
    ckpt = Path(checkpoint) / "model.safetensors"
    if not ckpt.is_file():
        raise ExportError(f"{ckpt}: not found; run `dvc repro train`")
    problems = check_checkpoint(checkpoint, flat_arch, against=str(vllm_config),
                                dtype=formats.TRAINED_DTYPE)
    if problems:
        raise ExportError("the trained checkpoint does not fit the configs it would be exported "
                          "with (retrain after changing the architecture: `dvc repro train`):\n"
                          + "\n".join(problems))
    tensors = load_file(str(ckpt))

    summary = {}
    with atomic_dir(out_dir) as tmp:
        for sub, (raw, a) in configs.items():
            d = tmp / sub
            d.mkdir()
            out = convert(tensors, a, FORMATS[sub])
            save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
            (d / "model.safetensors").chmod(0o644)  # safetensors writes 0600
            (d / "config.json").write_bytes(raw)
            found = check_checkpoint(d, flat_arch, against=str(vllm_config))
            if found:
                raise ExportError(f"{sub} export fails the contract check:\n" + "\n".join(found))
            summary[sub] = {"tensors": len(out), "dtype": a.dtype,
                            "bytes": (d / "model.safetensors").stat().st_size}
            log.info("export %s: %d tensors, %s", sub, len(out), a.dtype)
    return summary


def speculators_roundtrip(flat_dir: str | Path, speculators_dir: str | Path,
                          verifier_dir: str | Path, work_dir: str | Path) -> list[str]:
    """Converts the flat export with speculators' own converter (Eagle3Converter, what
    `speculators convert --algorithm eagle3` runs), passing the aux ids and
    norm_before_residual and the EAGLE-3.1 switches explicitly (the converter drops or defaults
    them otherwise), and compares the result's tensors with the speculators export bit for bit
    and its config field by field (but CONVERTER_REWRITES). The converter builds a LlamaConfig
    layer whatever the flat config says, so a Qwen3 draft comes back as draft_arch llama: that
    difference is reported too. Returns the differences."""
    from safetensors.torch import load_file
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    _, flat, _ = parsing.read_config_file(Path(flat_dir) / "config.json",
                                          verifier_num_layers=None)
    aux = list(flat.aux_layer_ids)
    Eagle3Converter().convert(input_path=Path(flat_dir), output_path=Path(work_dir),
                              base_model=str(verifier_dir), validate=True,
                              norm_before_residual=flat.norm_before_residual,
                              norm_before_fc=flat.norm_before_fc, fc_norm=flat.fc_norm,
                              norm_output=flat.norm_output,
                              eagle_aux_hidden_state_layer_ids=aux)
    ours = load_file(str(Path(speculators_dir) / "model.safetensors"))
    theirs = load_file(str(Path(work_dir) / "model.safetensors"))
    problems = [f"converter output lacks {n}" for n in sorted(set(ours) - set(theirs))]
    problems += [f"converter output has extra {n}" for n in sorted(set(theirs) - set(ours))]
    for n in sorted(set(ours) & set(theirs)):
        a, b = ours[n], theirs[n]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{n}: export {a.dtype} {list(a.shape)}, converter {b.dtype} "
                            f"{list(b.shape)}")
        elif not torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                             b.view(torch.uint8) if b.dtype != torch.bool else b):
            problems.append(f"{n}: values differ")
    _, conv, _ = parsing.read_config_file(Path(work_dir) / "config.json",
                                          verifier_num_layers=None)
    problems += [f"converter config {f} = {a!r}, the export's {b!r}"
                 for f, a, b in parsing.differences(conv, flat, ignore=CONVERTER_REWRITES)]
    return problems


def run(params: StageView, paths: Paths) -> None:
    """The stage (eagle3pipe.stages.runner.main): paths.checkpoint, .speculators_config, .vllm_config,
    .verifier -> paths.out. Reads no params: the configs carry the architecture."""
    summary = export(paths.checkpoint, paths.speculators_config, paths.vllm_config,
                     paths.verifier, paths.out)
    for fmt, s in summary.items():
        log.info("%s/%s: %d tensors, %s, %d bytes", paths.out, fmt, s["tensors"], s["dtype"],
                 s["bytes"])
