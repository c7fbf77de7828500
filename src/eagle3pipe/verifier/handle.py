"""The verifier handle: the only reader of the verifier's files.

`Verifier(artifacts/verifier)` answers everything a downstream stage asks of the verifier:
where its weights are (`model_dir`; path mode checks the external checkpoint is still what the
verifier stage fingerprinted), its decoder config (`config`, with a multimodal wrapper's
`text_config` unwrapped; `hf_config()` as transformers reads it, `kimi_k2` included), the prefix
of the decoder's tensors in a wrapper (`weight_prefix`), its tensors by decoder layer and their
float32 size from the safetensors headers (`layer_tensors`, `float32_bytes`: the oracle's and
the plan's), the sizes that fix the draft (`info`), and its tokenizer. Every transformers load honours `vllm.trust_remote_code` (the one key, read
by every stage that loads the verifier). Its dtype
and parallelism in the engines are the params' `vllm:` section's (eagle3pipe.engines.engine), the same
in every stage. It never builds anything: building the embedded verifier, or fingerprinting a
checkpoint, is the verifier stage's (verifier_stage.py, embedded.py), which only that stage
imports.

The verifier stage's output directory holds config.json, the tokenizer files and manifest.json:
  embedded: {"mode": "embedded", "path": null, "files": ...}; the weights are in the directory.
  path mode: {"mode": "headers"|"full", "path": DIR, "files": ...} (fingerprint.py); the weights
      stay in DIR.
A directory without manifest.json (a plain Hugging Face checkpoint) is used as it is.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from eagle3pipe.errors import Error, Problem
from eagle3pipe.runtime.jsonio import read_json_object
from eagle3pipe.verifier import families

MANIFEST = "manifest.json"
EMBEDDED_VERIFIER_DIR = "artifacts/verifier"  # the verifier stage's output
EMBEDDING = "model.embed_tokens.weight"  # the decoder's embedding, after its weight_prefix


class VerifierError(Error, ValueError):
    pass


class VerifierConfigError(VerifierError):
    pass


CONFIG_FIX = ("restore the checkpoint's config.json as its publisher ships it (or point "
              "verifier.path at a decoder checkpoint directory)")


def read_config(path: str | Path) -> tuple[dict, dict, Path]:
    """(whole config.json, its decoder part, the file) of a checkpoint dir or config file. A
    wrapper whose decoder sits under `text_config` (Kimi-K2.5, Llava-style) is unwrapped."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise VerifierConfigError(str(Problem(
            str(p), None, "(file)", "verifier config.json not found",
            "set verifier.path to a Hugging Face checkpoint directory, or null for the "
            "embedded verifier")))
    whole = read_json_object(p, VerifierConfigError, "fix: " + CONFIG_FIX, "verifier config.json")
    return whole, whole["text_config"] if families.is_wrapper(whole) else whole, p


def find_config(verifier_path: str | None, configs_dir: str | Path = "configs") -> Path:
    """Where render/check find the verifier's config.json without running the pipeline:
    the checkpoint named by verifier.path, else the verifier stage's output, else the copy the
    configs stage committed (configs/verifier_config.json)."""
    candidates = []
    if verifier_path is not None:
        candidates.append(Path(verifier_path) / "config.json")
    candidates += [Path(EMBEDDED_VERIFIER_DIR) / "config.json",
                   Path(configs_dir) / "verifier_config.json"]
    for c in candidates:
        if c.is_file():
            return c
    raise VerifierConfigError(
        "no verifier config.json found (looked at " + ", ".join(map(str, candidates)) + ")",
        fix="run `dvc repro verifier` or pass --verifier-config FILE")


@dataclass(frozen=True)
class VerifierInfo:
    """The verifier's values that fix the draft (never repeated in params.yaml)."""
    source: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int | None
    bos_token_id: int | list | None
    eos_token_id: int | list | None
    model_type: str | None
    architectures: tuple[str, ...]
    num_key_value_heads: int | None = None  # None: MLA (a latent KV, not sharded as heads)

    @classmethod
    def from_config(cls, path: str | Path) -> "VerifierInfo":
        _, cfg, p = read_config(path)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in cfg]
        if missing:
            raise VerifierConfigError(str(Problem(
                str(p), None, ", ".join(missing), "missing from the verifier config",
                "point verifier.path at a decoder-only checkpoint's config.json")))
        for k in ("hidden_size", "num_hidden_layers", "vocab_size"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
                raise VerifierConfigError(str(Problem(
                    str(p), None, k, f"must be a positive integer, got {cfg[k]!r}",
                    CONFIG_FIX)))
        return cls(source=str(p), hidden_size=cfg["hidden_size"],
                   num_hidden_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
                   num_attention_heads=cfg.get("num_attention_heads"),
                   bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                   model_type=cfg.get("model_type"),
                   architectures=tuple(cfg.get("architectures") or ()),
                   num_key_value_heads=None if "kv_lora_rank" in cfg
                   else cfg.get("num_key_value_heads"))


def read_manifest(verifier_dir: str | Path) -> dict | None:
    """The verifier stage's manifest, or None for a plain checkpoint directory without one."""
    p = Path(verifier_dir) / MANIFEST
    if not p.is_file():
        return None
    return read_json_object(p, VerifierError, "fix: rerun `dvc repro -f -s verifier`")


def _verify_unchanged(ext: Path, manifest: dict, where: Path) -> None:
    """Raises unless the external checkpoint is what the manifest fingerprinted (headers mode:
    it reads no weights). DVC cannot see outside the project; this does."""
    from eagle3pipe.verifier import fingerprint as fp

    fix = "run `dvc repro -f -s verifier` (the checkpoint changed after the verifier stage ran)"
    then = manifest.get("files", {})
    try:
        now = fp.fingerprint(ext, "headers", progress=False)["files"]
    except fp.FingerprintError as e:
        raise VerifierError(f"{e}\n    the verifier checkpoint fingerprinted in {where} is "
                            f"not what it was; or {fix}") from None
    for name in sorted(set(then) | set(now)):
        if name not in now:
            raise VerifierError(f"{ext / name}: missing from the verifier checkpoint "
                                f"fingerprinted in {where}", fix=f"restore it, or {fix}")
        if name not in then:
            raise VerifierError(f"{ext / name}: new in the verifier checkpoint since it was "
                                f"fingerprinted in {where}", fix=fix)
        for key in sorted(now[name]):
            if key in then[name] and then[name][key] != now[name][key]:
                raise VerifierError(f"{ext / name}: {key} is {now[name][key]}, {where} says "
                                    f"{then[name][key]}", fix=fix)


def model_dir(verifier_dir: str | Path, *, verify: bool = True) -> Path:
    """Where the verifier's weights are: the stage output itself (embedded, or a plain
    checkpoint dir), or the external checkpoint its manifest names (checked unless verify=False)."""
    d = Path(verifier_dir)
    manifest = read_manifest(d)
    if manifest is None:
        if not (d / "config.json").is_file():
            raise VerifierError(f"{d}: neither {MANIFEST} nor config.json found",
                                fix="run `dvc repro verifier` (or pass a Hugging Face "
                                "checkpoint dir)")
        return d
    if manifest.get("mode") == "embedded" or manifest.get("path") is None:
        return d
    ext = Path(manifest["path"])
    if not ext.is_dir():
        raise VerifierError(f"{d / MANIFEST}: the external verifier checkpoint {ext} no longer "
                            "exists", fix="restore it, or set verifier.path to its new "
                            "location and run `dvc repro -f -s verifier`")
    if verify:
        _verify_unchanged(ext, manifest, d / MANIFEST)
    return ext


class Verifier:
    """A handle on the verifier stage's output directory (or a plain checkpoint directory)."""

    def __init__(self, directory: str | Path, *, verify: bool = True,
                 trust_remote_code: bool = False):
        self.dir = Path(directory)
        self.model_dir = model_dir(self.dir, verify=verify)
        self.whole_config, self.config, self.config_path = read_config(self.dir)
        self.trust_remote_code = trust_remote_code

    @cached_property
    def info(self) -> VerifierInfo:
        return VerifierInfo.from_config(self.config_path)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of what the verifier stage fingerprinted (its manifest.json: config,
        tokenizer, weights' headers or bytes); for a plain checkpoint dir, of its headers-mode
        fingerprint (eagle3pipe.verifier.fingerprint)."""
        import hashlib

        f = self.dir / MANIFEST
        if f.is_file():
            return hashlib.sha256(f.read_bytes()).hexdigest()
        from eagle3pipe.runtime.jsonio import dumps
        from eagle3pipe.verifier import fingerprint as fp

        body = fp.fingerprint(self.model_dir, "headers", progress=False)
        return hashlib.sha256(dumps(body).encode()).hexdigest()

    def get(self, key: str) -> Any:
        """A decoder config value, or None when the config does not have it."""
        return self.config.get(key)

    def hf_config(self):
        """The decoder's transformers config (a wrapper's text_config; kimi_k2 as DeepseekV3, with
        DeepseekV3's checkpoint conversions: families.register_with_transformers)."""
        from transformers import AutoConfig

        families.register_with_transformers()
        cfg = AutoConfig.from_pretrained(str(self.dir), trust_remote_code=self.trust_remote_code)
        return getattr(cfg, "text_config", None) or cfg

    @cached_property
    def weight_prefix(self) -> str:
        """What precedes `model.embed_tokens.weight` in the checkpoint (`language_model.` in
        Kimi-K2.5's; "" in a decoder-only one), from the safetensors headers."""
        for f, header in self._headers():
            for name in header.tensors:
                if name.endswith(EMBEDDING):
                    return name[:-len(EMBEDDING)]
        return ""

    def layer_tensors(self) -> dict[int, list[tuple[Path, str, tuple[int, ...]]]]:
        """Decoder layer -> its tensors (file, name, shape), from the safetensors headers alone
        (a wrapper's other towers left out; layers past num_hidden_layers, such as DeepSeek-V3's
        multi-token-prediction layer, included)."""
        layer = re.compile(rf"^{re.escape(self.weight_prefix)}model\.layers\.(\d+)\.")
        out: dict[int, list[tuple[Path, str, tuple[int, ...]]]] = {}
        for f, header in self._headers():
            for name, (_, shape) in header.tensors.items():
                m = layer.match(name)
                if m:
                    out.setdefault(int(m.group(1)), []).append((f, name, shape))
        return out

    def float32_bytes(self) -> tuple[dict[int, int], int]:
        """The decoder's weights in float32 from the safetensors headers (no weight read):
        bytes per decoder layer, and the embedding's."""
        per_layer = {i: sum(4 * math.prod(shape) for _, _, shape in ts)
                     for i, ts in self.layer_tensors().items()}
        embedding = sum(4 * math.prod(shape) for _, header in self._headers()
                        for name, (_, shape) in header.tensors.items()
                        if name == self.weight_prefix + EMBEDDING)
        return per_layer, embedding

    def _headers(self):
        from eagle3pipe.runtime.tensorfile import read_header

        for f in sorted(self.model_dir.glob("*.safetensors")):
            yield f, read_header(f, error=VerifierError)

    def tokenizer(self, *, chat: bool = True):
        """The verifier's tokenizer (from the stage's copies); with chat, one with a template."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.dir),
                                            trust_remote_code=self.trust_remote_code)
        if chat and not tok.chat_template:
            raise VerifierError(f"{self.dir}: the verifier's tokenizer has no chat template",
                                fix="use an instruction-tuned checkpoint (its "
                                "tokenizer_config.json or chat_template.jinja must define one)")
        return tok
