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

Before anything is written the trained tensors are compared with the contract derived from
configs/vllm/config.json; a checkpoint trained for another architecture (e.g. another head_dim)
is rejected with the tensor and the config field that disagree. Each written export must then
pass eagle3pipe.check.check_checkpoint (names, shapes, dtypes, nothing missing or extra, d2t
consistent with t2d), or the output is not replaced (atomic).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eagle3pipe import arch as archmod
from eagle3pipe.errors import Error
from eagle3pipe.runtime import atomic_dir

log = logging.getLogger("eagle3pipe.export")

TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
               "I64": torch.int64, "BOOL": torch.bool}
FORMATS = {"speculators": "speculators", "vllm": "vllm"}  # output subdir -> contract layout


class ExportError(Error, ValueError):
    """The message names the file, tensor or field that is wrong and the fix."""


def _read_config(path: str | Path, layout: str) -> tuple[bytes, archmod.DraftArch]:
    from eagle3pipe.check import arch_from_config

    p = Path(path)
    if not p.is_file():
        raise ExportError(f"{p}: not found; run `dvc repro configs`")
    raw = p.read_bytes()
    try:
        cfg = json.loads(raw)
        a, found = arch_from_config(cfg, str(p))
    except (json.JSONDecodeError, ValueError, KeyError) as e:
        raise ExportError(f"{p}: {e}; it is generated: run `dvc repro configs`") from None
    if found != layout:
        raise ExportError(f"{p}: is a {found}-layout config, expected the {layout} one; "
                          "check the export stage's arguments in dvc.yaml")
    return raw, a


def _explain(name: str, a: archmod.DraftArch) -> str:
    if ".self_attn.q_proj." in name or ".self_attn.o_proj." in name:
        return f"the config's head_dim {a.head_dim} x {a.num_attention_heads} heads"
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return f"the config's head_dim {a.head_dim} x {a.num_key_value_heads} kv heads"
    if name == "fc.weight":
        return (f"the config's {archmod.NUM_AUX} aux layers x target hidden "
                f"{a.target_hidden_size}")
    if name == "lm_head.weight" or name == "d2t":
        return f"the config's draft_vocab_size {a.draft_vocab_size}"
    if name == "t2d":
        return f"the config's vocab_size {a.vocab_size}"
    if ".mlp." in name:
        return f"the config's intermediate_size {a.intermediate_size}"
    return f"the config's hidden_size {a.hidden_size}"


def check_trained(tensors: dict[str, torch.Tensor], a: archmod.DraftArch, where: str,
                  config_path: str | Path) -> list[str]:
    """Trained (speculators-layout) tensors vs the contract of the config being exported."""
    problems = []
    want = archmod.contract(a, "speculators")
    for name, spec in want.items():
        if name not in tensors:
            problems.append(f"{where}: tensor {name} missing (needed by {config_path})")
            continue
        got = list(tensors[name].shape)
        if tuple(got) != spec.shape:
            problems.append(f"{where}: {name} has {got} but {_explain(name, a)} "
                            f"({config_path}) needs {list(spec.shape)}")
    for name in sorted(set(tensors) - set(want)):
        problems.append(f"{where}: unexpected tensor {name} (not in the contract of "
                        f"{config_path})")
    return problems


def check_trained_config(path: Path, a: archmod.DraftArch, config_path: str | Path) -> list[str]:
    """What shapes cannot show (aux ids, norm_before_residual, rope, eps...): the trained
    checkpoint's config.json must describe the architecture being exported."""
    from eagle3pipe.check import ARCH_FIELDS_COMPARED, arch_from_config

    if not path.is_file():
        return [f"{path}: missing (the trained checkpoint's config)"]
    try:
        trained, _ = arch_from_config(json.loads(path.read_text()), str(path))
    except (json.JSONDecodeError, ValueError, KeyError) as e:
        return [f"{path}: {e}"]
    problems = []
    for f in ARCH_FIELDS_COMPARED:
        mine, theirs = getattr(trained, f), getattr(a, f)
        if f == "aux_layer_ids":
            mine, theirs = list(mine), list(theirs)
        if mine != theirs:
            problems.append(f"{path}: trained with {f} = {mine!r} but {config_path} says "
                            f"{theirs!r}")
    return problems


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

    from eagle3pipe.check import check_checkpoint
    from eagle3pipe.verifier import VerifierInfo

    spec_raw, spec_arch = _read_config(speculators_config, "speculators")
    flat_raw, flat_arch = _read_config(vllm_config, "vllm")
    for f in ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size", "aux_layer_ids",
              "norm_before_residual", "dtype", "num_hidden_layers"):
        if getattr(spec_arch, f) != getattr(flat_arch, f):
            raise ExportError(f"{speculators_config} and {vllm_config} disagree on {f} "
                              f"({getattr(spec_arch, f)!r} vs {getattr(flat_arch, f)!r}); "
                              "they are generated together: run `dvc repro configs`")
    v = VerifierInfo.from_config(verifier)
    if (flat_arch.hidden_size, flat_arch.vocab_size) != (v.hidden_size, v.vocab_size):
        raise ExportError(f"{vllm_config}: hidden_size {flat_arch.hidden_size} / vocab_size "
                          f"{flat_arch.vocab_size} do not match the verifier ({v.source}: "
                          f"{v.hidden_size} / {v.vocab_size}); run `dvc repro configs`")

    ckpt = Path(checkpoint) / "model.safetensors"
    if not ckpt.is_file():
        raise ExportError(f"{ckpt}: not found; run `dvc repro train`")
    tensors = load_file(str(ckpt))
    problems = check_trained(tensors, flat_arch, str(ckpt), vllm_config)
    problems += check_trained_config(Path(checkpoint) / "config.json", flat_arch, vllm_config)
    if problems:
        raise ExportError("the trained checkpoint does not fit the configs it would be exported "
                          "with (retrain after changing the architecture: `dvc repro train`):\n"
                          + "\n".join(problems))

    summary = {}
    with atomic_dir(out_dir) as tmp:
        for sub, raw, a in (("speculators", spec_raw, spec_arch), ("vllm", flat_raw, flat_arch)):
            d = tmp / sub
            d.mkdir()
            out = convert(tensors, a, FORMATS[sub])
            save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
            (d / "model.safetensors").chmod(0o644)  # safetensors writes 0600
            (d / "config.json").write_bytes(raw)
            found = check_checkpoint(d, params_arch=flat_arch)
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
    norm_before_residual explicitly (the converter drops them otherwise), and compares the
    result's tensors with the speculators export bit for bit. Returns the differences."""
    from safetensors.torch import load_file
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    cfg = json.loads((Path(flat_dir) / "config.json").read_text())
    aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    Eagle3Converter().convert(input_path=Path(flat_dir), output_path=Path(work_dir),
                              base_model=str(verifier_dir), validate=True,
                              norm_before_residual=cfg["norm_before_residual"],
                              eagle_aux_hidden_state_layer_ids=list(aux))
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
    conv_cfg = json.loads((Path(work_dir) / "config.json").read_text())
    conv_aux = conv_cfg.get("eagle_aux_hidden_state_layer_ids")
    if conv_aux != list(aux):
        problems.append(f"converter config aux ids {conv_aux} != {aux}")
    if conv_cfg.get("norm_before_residual") != cfg["norm_before_residual"]:
        problems.append("converter config lost norm_before_residual")
    return problems


def run(params, paths) -> None:
    """The stage (eagle3pipe.stage.main): paths.checkpoint, .speculators_config, .vllm_config,
    .verifier -> paths.out. Reads no params: the configs carry the architecture."""
    summary = export(paths.checkpoint, paths.speculators_config, paths.vllm_config,
                     paths.verifier, paths.out)
    for fmt, s in summary.items():
        log.info("%s/%s: %d tensors, %s, %d bytes", paths.out, fmt, s["tensors"], s["dtype"],
                 s["bytes"])
