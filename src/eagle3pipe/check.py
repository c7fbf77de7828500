"""`eagle3pipe check`: every way a draft's files can drift from params.yaml, each reported with
the file, key or tensor that is wrong.

- stale derived configs (hand edits, stale copies) vs what params.yaml renders;
- safetensors checkpoints (either layout) vs the shape contract of their own config and of
  params, including what vLLM silently accepts (a head_dim smaller than the weights, a missing
  fc.weight, an all-zero d2t);
- a published flat config, field by field, split into fields vLLM reads and fields it ignores;
- hand-written architecture constants in tracked files that contradict params.yaml.
"""
from __future__ import annotations

import json
import re
import struct
import subprocess
from dataclasses import fields
from pathlib import Path

from eagle3pipe import arch as A
from eagle3pipe.formats import FLAT_ARCHITECTURE, VLLM_READS

ST_DTYPES = {"BF16", "F16", "F32", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"}


# --------------------------------------------------------------------------------------------
# safetensors headers (read without loading tensors: a 100 GB file is checked in milliseconds)


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        meta = json.loads(fh.read(n))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in meta.items() if k != "__metadata__"}


def checkpoint_tensors(ckpt: str | Path) -> dict[str, tuple[str, tuple[int, ...], Path]]:
    ckpt = Path(ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no *.safetensors files")
    out = {}
    for f in files:
        for name, (dt, shape) in read_header(f).items():
            out[name] = (dt, shape, f)
    return out


# --------------------------------------------------------------------------------------------
# config -> architecture


def layout_of(cfg: dict) -> str:
    if "speculators_model_type" in cfg:
        return "speculators"
    if FLAT_ARCHITECTURE in (cfg.get("architectures") or []) or "eagle_config" in cfg:
        return "vllm"
    raise ValueError("config.json is neither speculators' nested EAGLE-3 format "
                     "(speculators_model_type) nor the flat vLLM one (architectures: "
                     f"[{FLAT_ARCHITECTURE}])")


def arch_from_config(cfg: dict, source: str = "config.json") -> tuple[A.DraftArch, str]:
    """Reconstructs the DraftArch a config describes. head_dim must be explicit."""
    layout = layout_of(cfg)
    if layout == "speculators":
        tl = cfg["transformer_layer_config"]
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        nbr = cfg.get("norm_before_residual")
        draft_vocab, target_h = cfg.get("draft_vocab_size"), cfg.get("target_hidden_size")
        rope = tl.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", tl.get("rope_theta"))
        dtype = cfg.get("dtype") or tl.get("dtype") or "bfloat16"
    else:
        tl = cfg
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        nbr = cfg.get("norm_before_residual")
        draft_vocab, target_h = cfg.get("draft_vocab_size"), cfg.get("target_hidden_size")
        rope_theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    missing = [k for k, v in (("head_dim", tl.get("head_dim")),
                              ("eagle_aux_hidden_state_layer_ids", aux),
                              ("norm_before_residual", nbr), ("draft_vocab_size", draft_vocab))
               if v is None]
    if missing:
        raise ValueError(f"{source}: {', '.join(missing)} missing; consumers would fall back to "
                         "their own defaults (head_dim = hidden/heads, aux ids (2, L//2, L-3), "
                         "norm_before_residual True/False by consumer). Write them explicitly.")
    H = tl["hidden_size"]
    return A.DraftArch(
        hidden_size=H, target_hidden_size=target_h or H,
        num_attention_heads=tl["num_attention_heads"],
        num_key_value_heads=tl.get("num_key_value_heads") or tl["num_attention_heads"],
        head_dim=tl["head_dim"], intermediate_size=tl["intermediate_size"],
        vocab_size=tl["vocab_size"], draft_vocab_size=draft_vocab, aux_layer_ids=tuple(aux),
        norm_before_residual=nbr, rope_theta=float(rope_theta or 10000.0),
        rope_scaling=tl.get("rope_scaling"), rms_norm_eps=tl.get("rms_norm_eps", 1e-6),
        max_position_embeddings=tl.get("max_position_embeddings", 0),
        hidden_act=tl.get("hidden_act", "silu"), dtype=dtype if dtype in A.SAFETENSORS_DTYPE
        else "bfloat16", bos_token_id=tl.get("bos_token_id"), eos_token_id=tl.get("eos_token_id"),
        verifier_num_layers=max(aux) + 1 if aux else 0,
        num_hidden_layers=tl.get("num_hidden_layers", 1)), layout


ARCH_FIELDS_COMPARED = ("hidden_size", "target_hidden_size", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                        "draft_vocab_size", "aux_layer_ids", "norm_before_residual", "rope_theta",
                        "rms_norm_eps", "max_position_embeddings", "num_hidden_layers")


def _why(name: str, arch: A.DraftArch) -> str:
    if "q_proj" in name or "o_proj" in name:
        return (f" (head_dim={arch.head_dim} x num_attention_heads={arch.num_attention_heads}"
                f" = {arch.q_dim})")
    if "k_proj" in name or "v_proj" in name:
        return (f" (head_dim={arch.head_dim} x num_key_value_heads={arch.num_key_value_heads}"
                f" = {arch.kv_dim})")
    if name == "fc.weight":
        return f" (fc input = {A.NUM_AUX} aux layers x target hidden {arch.target_hidden_size})"
    return ""


def check_tensors(tensors: dict, arch: A.DraftArch, layout: str, where: str) -> list[str]:
    expected = A.contract(arch, layout, embed_tokens="embed_tokens.weight" in tensors)
    problems = []
    for name, spec in expected.items():
        if name not in tensors:
            problems.append(f"{where}: tensor {name} missing (expected {list(spec.shape)} "
                            f"{spec.dtype}); vLLM would leave it uninitialised without an error")
            continue
        dt, shape = tensors[name][0], tensors[name][1]
        if tuple(shape) != spec.shape:
            problems.append(f"{where}: tensor {name} has shape {list(shape)} but the config "
                            f"needs {list(spec.shape)}{_why(name, arch)}")
        if dt != spec.dtype:
            problems.append(f"{where}: tensor {name} has dtype {dt}, expected {spec.dtype}")
    for name in sorted(set(tensors) - set(expected)):
        hint = ""
        other = "vllm" if layout == "speculators" else "speculators"
        if A.rename(name, other, layout) in expected:
            hint = f" (a {other}-layout name in a {layout}-layout checkpoint)"
        problems.append(f"{where}: unexpected tensor {name}{hint}")
    return problems


def check_vocab_map(ckpt: Path, tensors: dict, arch: A.DraftArch) -> list[str]:
    import torch
    from safetensors import safe_open

    if "d2t" not in tensors or "t2d" not in tensors:
        return []
    with safe_open(tensors["d2t"][2], "pt") as f:
        d2t = f.get_tensor("d2t")
    with safe_open(tensors["t2d"][2], "pt") as f:
        t2d = f.get_tensor("t2d")
    if d2t.shape != (arch.draft_vocab_size,) or t2d.shape != (arch.vocab_size,):
        return []  # shape problems are reported by check_tensors
    targets = torch.arange(len(d2t)) + d2t.long()
    marked = torch.nonzero(t2d.bool()).flatten()
    if len(marked) != len(targets) or not torch.equal(marked, targets):
        bad = int((targets != marked[:len(targets)]).nonzero()[0]) if len(marked) == len(
            targets) else None
        detail = (f"first mismatch at draft id {bad}: draft+d2t = {int(targets[bad])}, t2d marks "
                  f"{int(marked[bad])}" if bad is not None else
                  f"t2d marks {len(marked)} ids, draft vocab is {len(targets)}")
        return [f"{ckpt}: d2t is not consistent with t2d (target = draft + d2t[draft] must be "
                f"exactly the ids t2d marks, in order); {detail}"]
    return []


def check_checkpoint(ckpt_dir: str | Path, params_arch: A.DraftArch | None = None) -> list[str]:
    """Problems of a safetensors draft checkpoint dir (config.json + *.safetensors)."""
    ckpt = Path(ckpt_dir)
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        return [f"{cfg_path}: missing"]
    try:
        cfg = json.loads(cfg_path.read_text())
        arch, layout = arch_from_config(cfg, str(cfg_path))
        tensors = checkpoint_tensors(ckpt)
    except (ValueError, KeyError, FileNotFoundError) as e:
        return [f"{cfg_path}: {e}" if not str(e).startswith(str(ckpt)) else str(e)]
    problems = check_tensors(tensors, arch, layout, f"{ckpt} ({layout} layout, vs its config)")
    if params_arch is not None:
        for f in ARCH_FIELDS_COMPARED:
            mine, theirs = getattr(arch, f), getattr(params_arch, f)
            if f == "aux_layer_ids":
                mine, theirs = list(mine), list(theirs)
            if mine != theirs:
                problems.append(f"{cfg_path}: {f} = {mine!r} but params.yaml gives {theirs!r}")
        pa = A.DraftArch(**{**params_arch.__dict__, "dtype": arch.dtype})
        problems += [p for p in check_tensors(tensors, pa, layout, f"{ckpt} (vs params.yaml)")
                     if p not in problems]
    problems += check_vocab_map(ckpt, tensors, arch)
    return problems


# --------------------------------------------------------------------------------------------
# derived configs on disk vs what params.yaml renders


def _flatten(d, prefix=""):
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): d}


def json_diff(a: dict, b: dict) -> list[str]:
    fa, fb = _flatten(a), _flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, "<absent>") != fb.get(k, "<absent>"))


def check_rendered(rendered: dict[str, str], configs_dir: str | Path) -> list[str]:
    problems = []
    for rel, text in rendered.items():
        p = Path(configs_dir) / rel
        if not p.is_file():
            problems.append(f"{p}: missing (run `dvc repro configs`)")
            continue
        on_disk = p.read_text()
        if on_disk == text:
            continue
        try:
            keys = json_diff(json.loads(on_disk), json.loads(text))
        except json.JSONDecodeError as e:
            problems.append(f"{p}:{e.lineno}: not valid JSON ({e.msg}); it is generated: run "
                            "`dvc repro configs`")
            continue
        fa, fb = _flatten(json.loads(on_disk)), _flatten(json.loads(text))
        detail = "; ".join(f"{k}: on disk {fa.get(k, '<absent>')!r}, params.yaml renders "
                           f"{fb.get(k, '<absent>')!r}" for k in keys[:6]) or "formatting"
        problems.append(f"{p}: differs from what params.yaml renders ({detail}). It is "
                        "generated: never edit it; change params.yaml and run `dvc repro configs`")
    return problems


# --------------------------------------------------------------------------------------------
# published reference config


def compare_reference(rendered_flat: dict, reference: dict) -> tuple[list[dict], list[str]]:
    ours, theirs = _flatten(rendered_flat), _flatten(reference)
    rows, problems = [], []
    for key in sorted(set(ours) | set(theirs)):
        read = key in VLLM_READS
        a, b = ours.get(key, "<absent>"), theirs.get(key, "<absent>")
        if read and b == "<absent>":
            default = VLLM_READS[key]
            b = ours.get("hidden_size") if default == "=hidden_size" else default
            b = "<absent>" if b is None else b
        same = a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and
                          float(a) == float(b))
        rows.append({"field": key, "ours": a, "reference": b, "vllm_reads": read, "same": same})
        if read and not same:
            problems.append(f"{key}: rendered {a!r}, reference {b!r} (vLLM reads this field)")
    return rows, problems


# --------------------------------------------------------------------------------------------
# hand-written architecture constants


SCAN_KEYS = ("head_dim", "num_attention_heads", "num_key_value_heads", "hidden_size",
             "intermediate_size", "draft_vocab_size", "num_hidden_layers", "vocab_size",
             "target_hidden_size")
SCAN_SUFFIXES = {".py", ".json", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".ini", ".mk"}
SCAN_NAMES = {"Makefile", "run"}
# generated, or fixtures with their own sizes (tests build micro models; examples have their
# own params.yaml): not hand-written copies of this project's architecture
SCAN_EXEMPT = ("configs/", "metrics/", "plots/", "dvc.lock", "params.yaml", "examples/",
               "tests/", "bench/", ".dvc/", "requirements.lock")
_PATTERN = re.compile(r"""["']?\b(%s)\b["']?\s*[:=]\s*(\d+)\b""" % "|".join(SCAN_KEYS))


def allowed_values(params, verifier_cfg: dict | None) -> dict[str, set[int]]:
    allowed: dict[str, set[int]] = {k: set() for k in SCAN_KEYS}
    for section in (params.draft, params.verifier.embedded):
        if section is None:
            continue
        for f in fields(section):
            if f.name in allowed and isinstance(getattr(section, f.name), int):
                allowed[f.name].add(getattr(section, f.name))
    if verifier_cfg:
        for k in SCAN_KEYS:
            if isinstance(verifier_cfg.get(k), int):
                allowed[k].add(verifier_cfg[k])
        for k in ("hidden_size", "target_hidden_size"):
            if isinstance(verifier_cfg.get("hidden_size"), int):
                allowed[k].add(verifier_cfg["hidden_size"])
    allowed["num_hidden_layers"].add(1)  # the draft's single decoder layer
    if params.verifier.embedded is not None:
        allowed["vocab_size"].add(params.verifier.embedded.tokenizer_vocab_size)
    return allowed


def tracked_files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split("\n")
    except (subprocess.CalledProcessError, FileNotFoundError):
        out = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return sorted(f for f in out if f)


def scan_constants(root: str | Path, params, verifier_cfg: dict | None) -> list[str]:
    root = Path(root)
    allowed = allowed_values(params, verifier_cfg)
    problems = []
    for rel in tracked_files(root):
        p = root / rel
        if rel.startswith(SCAN_EXEMPT) or not p.is_file():
            continue
        if p.suffix not in SCAN_SUFFIXES and p.name not in SCAN_NAMES:
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if "check: ignore" in line:
                continue
            for m in _PATTERN.finditer(line):
                key, val = m.group(1), int(m.group(2))
                if allowed[key] and val not in allowed[key]:
                    problems.append(f"{rel}:{i}: {key} = {val} written by hand contradicts "
                                    f"params.yaml / the verifier ({key} in "
                                    f"{sorted(allowed[key])}); derive it from params instead")
    return problems
