"""What the verifier fixes: read from its config.json, never repeated in params.yaml."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.params import Problem


class VerifierConfigError(ValueError):
    pass


@dataclass(frozen=True)
class VerifierInfo:
    source: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int | None
    bos_token_id: int | list | None
    eos_token_id: int | list | None
    model_type: str | None
    architectures: tuple[str, ...]

    @classmethod
    def from_config(cls, path: str | Path) -> "VerifierInfo":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise VerifierConfigError(str(Problem(
                str(p), None, "(file)", "verifier config.json not found",
                "set verifier.path to a Hugging Face checkpoint directory, or null for the "
                "embedded verifier")))
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise VerifierConfigError(str(Problem(str(p), e.lineno, "(json)",
                                                  f"invalid JSON: {e.msg}", ""))) from None
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in cfg]
        if missing:
            raise VerifierConfigError(str(Problem(
                str(p), None, ", ".join(missing), "missing from the verifier config",
                "point verifier.path at a decoder-only checkpoint's config.json")))
        for k in ("hidden_size", "num_hidden_layers", "vocab_size"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
                raise VerifierConfigError(str(Problem(str(p), None, k,
                                                      f"must be a positive integer, got {cfg[k]!r}",
                                                      "")))
        return cls(source=str(p), hidden_size=cfg["hidden_size"],
                   num_hidden_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
                   num_attention_heads=cfg.get("num_attention_heads"),
                   bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                   model_type=cfg.get("model_type"),
                   architectures=tuple(cfg.get("architectures") or ()))
