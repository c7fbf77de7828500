"""A draft checkpoint directory (config.json + *.safetensors) against the shape contract: the one
tensor check `eagle3pipe check --checkpoint` and the export stage (the trained checkpoint before
it is converted, each export after it is written) share.

Tensor names, shapes and dtypes are compared with arch.contract() of the checkpoint's own
config (parsing.read_config_file: no field defaulted) and, where the config's fields differ from
a reference architecture (params.yaml, or the config being exported), with the reference's too;
each wrong shape is explained by the config fields it comes from. This includes what vLLM
silently accepts: weights wider than head_dim x heads (vLLM's loader narrows them), a missing
fc.weight (left uninitialised), a d2t that does not map onto t2d (an all-zero d2t loads), a NaN
or Inf weight (check_finite reads every floating tensor). A malformed or truncated safetensors
file is a CheckpointError naming the file, not a traceback.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from eagle3pipe.draft import arch as A
from eagle3pipe.draft import parsing
from eagle3pipe.errors import Error
from eagle3pipe.runtime import tensorfile

FIX = "write the checkpoint again (rerun `dvc repro export`), or copy it again whole"
CONFIG_FIX = ("state every field explicitly (consumers' defaults differ); a draft this "
              "pipeline exported: rerun `dvc repro export`")


class CheckpointError(Error, ValueError):
    pass


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor: (dtype, shape)} of one exported safetensors file (runtime.tensorfile)."""
    return tensorfile.read_header(path, error=CheckpointError, fix=FIX).tensors


def checkpoint_tensors(ckpt: str | Path) -> dict[str, tuple[str, tuple[int, ...], Path]]:
    """{tensor: (dtype, shape, file)} over every *.safetensors file of the directory; a tensor
    in two files is an error (which one a loader keeps is its choice)."""
    ckpt = Path(ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no *.safetensors files", FIX)
    out: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: not a file", FIX)
        for name, (dt, shape) in read_header(f).items():
            if name in out:
                raise CheckpointError(f"{f}: tensor {name} is also in {out[name][2]}", FIX)
            out[name] = (dt, shape, f)
    return out


def explain(name: str, arch: A.DraftArch) -> str:
    """The config fields a contract tensor's shape comes from (see arch.py's table)."""
    if "q_proj" in name or "o_proj" in name:
        return (f"head_dim={arch.head_dim} x num_attention_heads={arch.num_attention_heads}"
                f" = {arch.q_dim}")
    if "k_proj" in name or "v_proj" in name:
        return (f"head_dim={arch.head_dim} x num_key_value_heads={arch.num_key_value_heads}"
                f" = {arch.kv_dim}")
    if name == "fc.weight":
        return f"fc input = {A.NUM_AUX} aux layers x target hidden {arch.target_hidden_size}"
    if name in ("lm_head.weight", "d2t"):
        return f"draft_vocab_size={arch.draft_vocab_size}, hidden_size={arch.hidden_size}"
    if name in ("t2d", "embed_tokens.weight"):
        return f"vocab_size={arch.vocab_size}, hidden_size={arch.hidden_size}"
    if ".mlp." in name:
        return f"intermediate_size={arch.intermediate_size}, hidden_size={arch.hidden_size}"
    return f"hidden_size={arch.hidden_size}"


def check_tensors(tensors: dict, arch: A.DraftArch, layout: str, where: str,
                  needs: str) -> list[str]:
    """{name: (dtype, shape, ...)} vs arch.contract(arch, layout); `needs` names what holds the
    architecture (a config file, params.yaml). embed_tokens is optional, as in vLLM."""
    expected = A.contract(arch, layout, embed_tokens="embed_tokens.weight" in tensors)
    problems = []
    for name, spec in expected.items():
        if name not in tensors:
            problems.append(f"{where}: tensor {name} missing ({needs} needs {list(spec.shape)} "
                            f"{spec.dtype}); vLLM would leave it uninitialised without an error")
            continue
        dt, shape = tensors[name][0], tensors[name][1]
        if tuple(shape) != spec.shape:
            problems.append(f"{where}: tensor {name} has shape {list(shape)} but {needs} needs "
                            f"{list(spec.shape)} ({explain(name, arch)})")
        if dt != spec.dtype:
            problems.append(f"{where}: tensor {name} has dtype {dt}, expected {spec.dtype} "
                            f"({needs}: dtype {arch.dtype})")
    for name in sorted(set(tensors) - set(expected)):
        hint = ""
        other = "vllm" if layout == "speculators" else "speculators"
        if A.rename(name, other, layout) in expected:
            hint = f" (a {other}-layout name in a {layout}-layout checkpoint)"
        problems.append(f"{where}: unexpected tensor {name}{hint}")
    return problems


def check_vocab_map(ckpt: Path, tensors: dict, arch: A.DraftArch) -> list[str]:
    """d2t consistent with t2d (eagle3pipe.draft.vocab_map.mapping_problem)."""
    from safetensors import SafetensorError, safe_open

    if "d2t" not in tensors or "t2d" not in tensors:
        return []
    maps = {}
    for name in ("d2t", "t2d"):
        try:
            with safe_open(tensors[name][2], "pt") as f:
                maps[name] = f.get_tensor(name)
        except SafetensorError as e:
            return [f"{tensors[name][2]}: safetensors cannot read tensor {name} ({e}); {FIX}"]
    d2t, t2d = maps["d2t"], maps["t2d"]
    if d2t.shape != (arch.draft_vocab_size,) or t2d.shape != (arch.vocab_size,):
        return []  # shape problems are reported by check_tensors
    from eagle3pipe.draft.vocab_map import mapping_problem

    detail = mapping_problem(d2t, t2d)
    if detail is None:
        return []
    return [f"{ckpt}: d2t is not consistent with t2d (target = draft + d2t[draft] must be "
            f"exactly the ids t2d marks, in order); {detail}"]


ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # floating
CHUNK_BYTES = 256 * 2**20  # how much of a tensor check_finite holds at once


def _nonfinite(fh, name: str, shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """(NaN count, ±Inf count) of one tensor, read in slices of its first dimension (float8
    slices are widened to float32 to be tested)."""
    import torch

    parts = [fh.get_tensor(name)] if not shape else None
    if parts is None:
        step, sl = max(1, CHUNK_BYTES // (itemsize * max(1, math.prod(shape[1:])))), \
            fh.get_slice(name)
        parts = (sl[i:i + step] for i in range(0, shape[0], step))
    nan = inf = 0
    for t in parts:
        t = t.float() if itemsize == 1 else t
        nan, inf = nan + int(torch.isnan(t).sum()), inf + int(torch.isinf(t).sum())
    return nan, inf


def check_finite(tensors: dict) -> list[str]:
    """Every floating tensor of {name: (dtype, shape, file)} is finite: a NaN or Inf weight
    loads into vLLM without an error and makes every draft token garbage. Read tensor by
    tensor with safetensors.safe_open, each in slices of at most CHUNK_BYTES; integer and bool
    tensors (d2t, t2d) cannot hold NaN (check_vocab_map checks them)."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[Path, list[str]] = {}
    for name, (dt, _, f) in sorted(tensors.items()):
        if dt in ITEMSIZE:
            by_file.setdefault(f, []).append(name)
    problems = []
    for f, names in by_file.items():
        try:
            with safe_open(f, "pt") as fh:
                for name in names:
                    dt, shape = tensors[name][:2]
                    nan, inf = _nonfinite(fh, name, shape, ITEMSIZE[dt])
                    if nan or inf:
                        problems.append(
                            f"{f}: tensor {name} has {nan + inf} non-finite values of "
                            f"{math.prod(shape)} ({nan} NaN, {inf} Inf); vLLM loads it without "
                            "an error and the draft proposes garbage: retrain (did the loss "
                            "diverge?) or export again")
        except SafetensorError as e:
            problems.append(f"{f}: safetensors cannot read it ({e}); {FIX}")
    return problems


SIZE_FIELDS = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size",
               "max_position_embeddings")


def check_checkpoint(ckpt_dir: str | Path, reference: A.DraftArch | None = None, *,
                     against: str = "params.yaml", dtype: str | None = None) -> list[str]:
    """Every problem of a draft checkpoint dir: its config (every field present), its tensors vs
    that config's contract, the config's fields vs `reference` (the architecture `against`
    describes; dtype is not compared: the trained checkpoint is float32) and, where they differ,
    the tensors vs the reference's contract; d2t vs t2d; every floating tensor finite
    (check_finite). `dtype`: the weights' dtype where the config states none
    (parsing.parse_speculators)."""
    ckpt = Path(ckpt_dir)
    cfg_path = ckpt / "config.json"
    if not ckpt.is_dir():
        return [f"{ckpt}: not a directory (a draft checkpoint is a directory of config.json and "
                "*.safetensors files)"]
    try:
        _, arch, layout = parsing.read_config_file(
            cfg_path, verifier_num_layers=None if reference is None else
            reference.verifier_num_layers, dtype=dtype, fix=CONFIG_FIX)
        tensors = checkpoint_tensors(ckpt)
    except Error as e:
        return [str(e)]
    sizes = [f"{cfg_path}: {f} = {getattr(arch, f)} must be a positive integer; {CONFIG_FIX}"
             for f in SIZE_FIELDS if getattr(arch, f) < 1]
    if sizes:  # a contract of such sizes would not explain anything
        return sizes
    where = f"{ckpt} ({layout} layout)"
    problems = check_tensors(tensors, arch, layout, where, f"its {cfg_path.name}")
    if reference is not None:
        diffs = parsing.differences(arch, reference, ignore=("dtype",))
        problems += [f"{cfg_path}: {f} = {mine!r} but {against} gives {theirs!r}"
                     for f, mine, theirs in diffs]
        if diffs:
            problems += check_tensors(tensors, replace(reference, dtype=arch.dtype), layout,
                                      where, against)
    return problems + check_vocab_map(ckpt, tensors, arch) + check_finite(tensors)
