"""Renders every derived config from params.yaml + the verifier's config.json.

One function, `render()`, returns {relative path: file text}; the `configs` stage and the
`eagle3pipe render` CLI write exactly these bytes, and `eagle3pipe check` compares against them.
Every value any consumer defaults differently (head_dim, norm_before_residual, aux ids, ...) is
written explicitly into every file.
"""
from __future__ import annotations

import json
from pathlib import Path

from eagle3pipe.arch import NUM_AUX, DraftArch
from eagle3pipe.runtime import dumps

FILES = ("draft_config.json", "speculators/config.json", "vllm/config.json", "capture.json",
         "verifier_config.json")
FLAT_ARCHITECTURE = "LlamaForCausalLMEagle3"
EMBEDDED_VERIFIER_DIR = "artifacts/verifier"

# Fields of the flat config that vLLM (0.32, llama_eagle3.py + LlamaConfig) reads, and vLLM's
# value when a field is absent (used to compare against published configs that omit it).
VLLM_READS = {
    "architectures": None, "model_type": None, "hidden_size": None, "intermediate_size": None,
    "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None,
    "num_hidden_layers": None, "vocab_size": None, "draft_vocab_size": None,
    "rms_norm_eps": None, "rope_theta": None, "rope_scaling": None, "hidden_act": None,
    "max_position_embeddings": None, "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False,
    "eagle_config.eagle_aux_hidden_state_layer_ids": None,
    "eagle_config.use_aux_hidden_state": True,
    "norm_before_residual": False,  # vLLM's default; speculators' path differs: never rely on it
    "target_hidden_size": "=hidden_size",
}


def _rope_parameters(arch: DraftArch) -> dict:
    rp = dict(arch.rope_scaling or {})
    rp.setdefault("rope_type", rp.pop("type", "default"))
    rp["rope_theta"] = arch.rope_theta
    return rp


def draft_config(arch: DraftArch) -> dict:
    """The standalone draft architecture training reads (no export dtype, no serving k)."""
    d = arch.to_dict()
    d.pop("dtype")
    return d


def flat_config(arch: DraftArch) -> dict:
    """vLLM/SGLang flat EAGLE-3 config (the published reference drafts' format)."""
    return {
        "architectures": [FLAT_ARCHITECTURE],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "draft_vocab_size": arch.draft_vocab_size,
        "dtype": arch.dtype,
        "torch_dtype": arch.dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(arch.aux_layer_ids),
                         "use_aux_hidden_state": True},
        "head_dim": arch.head_dim,
        "hidden_act": arch.hidden_act,
        "hidden_size": arch.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": arch.intermediate_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "mlp_bias": False,
        "norm_before_residual": arch.norm_before_residual,
        "num_attention_heads": arch.num_attention_heads,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_key_value_heads": arch.num_key_value_heads,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_scaling": arch.rope_scaling,
        "rope_theta": arch.rope_theta,
        "rope_parameters": _rope_parameters(arch),
        "target_hidden_size": arch.target_hidden_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": arch.vocab_size,
    }


def transformer_layer_config(arch: DraftArch, attn_impl: str | None = None):
    """The draft decoder layer as a transformers LlamaConfig, head_dim explicit."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
        hidden_act=arch.hidden_act, max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps, rope_parameters=_rope_parameters(arch),
        bos_token_id=arch.bos_token_id, eos_token_id=arch.eos_token_id,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    if cfg.head_dim != arch.head_dim:  # transformers must never derive it
        raise AssertionError(f"LlamaConfig head_dim {cfg.head_dim} != {arch.head_dim}")
    if attn_impl is not None:
        cfg._attn_implementation = attn_impl
    return cfg


def eagle3_config(arch: DraftArch, *, num_speculative_tokens: int, verifier,
                  attn_impl: str | None = None):
    """speculators' Eagle3SpeculatorConfig for the draft (aux ids, norm_before_residual and
    head_dim explicit). `verifier` is a speculators VerifierConfig. Rendering and training both
    build the draft's config here."""
    from speculators.config import SpeculatorsConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return Eagle3SpeculatorConfig(
        transformer_layer_config=transformer_layer_config(arch, attn_impl),
        draft_vocab_size=arch.draft_vocab_size,
        norm_before_residual=arch.norm_before_residual,
        target_hidden_size=arch.target_hidden_size,
        eagle_aux_hidden_state_layer_ids=list(arch.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=num_speculative_tokens)],
            default_proposal_method="greedy",
            verifier=verifier))


def speculators_config(arch: DraftArch, *, num_speculative_tokens: int, verifier_name_or_path: str,
                       verifier_architectures: list[str]) -> dict:
    """speculators 0.9's nested format, produced by speculators' own config classes."""
    from speculators.config import VerifierConfig

    cfg = eagle3_config(arch, num_speculative_tokens=num_speculative_tokens,
                        verifier=VerifierConfig(name_or_path=verifier_name_or_path,
                                                architectures=list(verifier_architectures)))
    d = json.loads(json.dumps(cfg.to_dict(), default=str))
    d["transformer_layer_config"].pop("transformers_version", None)
    d["dtype"] = arch.dtype
    # explicit even where equal to a default: a consumer's default is never relied on
    assert d["transformer_layer_config"]["head_dim"] == arch.head_dim
    assert d["eagle_aux_hidden_state_layer_ids"] == list(arch.aux_layer_ids)
    return d


def capture_config(arch: DraftArch) -> dict:
    """Only what hidden-state extraction needs (so a head_dim change never reruns it)."""
    assert len(arch.aux_layer_ids) == NUM_AUX
    return {"aux_layer_ids": list(arch.aux_layer_ids), "final": "pre_norm",
            "hidden_size": arch.target_hidden_size,
            "verifier_num_layers": arch.verifier_num_layers}


def verifier_name_or_path(verifier_path: str | None) -> str:
    return verifier_path if verifier_path is not None else EMBEDDED_VERIFIER_DIR


def render(arch: DraftArch, *, verifier_config: dict, verifier_path: str | None,
           num_speculative_tokens: int) -> dict[str, str]:
    spec = speculators_config(
        arch, num_speculative_tokens=num_speculative_tokens,
        verifier_name_or_path=verifier_name_or_path(verifier_path),
        verifier_architectures=verifier_config.get("architectures") or [])
    out = {
        "draft_config.json": draft_config(arch),
        "speculators/config.json": spec,
        "vllm/config.json": flat_config(arch),
        "capture.json": capture_config(arch),
        "verifier_config.json": {k: v for k, v in verifier_config.items()
                                 if k != "transformers_version"},
    }
    assert tuple(out) == FILES
    return {k: dumps(v) for k, v in out.items()}


def write(files: dict[str, str], out_dir: str | Path) -> list[Path]:
    """Writes rendered files atomically; files whose bytes are unchanged are not touched."""
    from eagle3pipe.runtime import write_text_atomic

    written = []
    for rel, text in files.items():
        p = Path(out_dir) / rel
        if p.is_file() and p.read_text() == text:
            continue
        write_text_atomic(p, text)
        written.append(p)
    return written


def render_files(draft, verifier_path: str | None, verifier_config_file: str | Path, *,
                 params_file: str = "params.yaml", lines: dict | None = None) -> dict[str, str]:
    """params' draft section + the verifier's config.json -> every derived config's text."""
    from eagle3pipe.arch import derive
    from eagle3pipe.verifier import VerifierInfo, read_config

    info = VerifierInfo.from_config(verifier_config_file)
    arch = derive(draft, info, params_file=params_file, lines=lines)
    cfg, _, _ = read_config(verifier_config_file)
    return render(arch, verifier_config=cfg, verifier_path=verifier_path,
                  num_speculative_tokens=draft.num_speculative_tokens)


def default_verifier_config(verifier_path: str | None, configs_dir: str | Path = "configs") -> Path:
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
    raise FileNotFoundError(
        "no verifier config.json found (looked at " + ", ".join(map(str, candidates)) +
        "); run `dvc repro verifier` or pass --verifier-config FILE")


def run(params, paths) -> None:
    """The configs stage (eagle3pipe.stage.main): params.draft + paths.verifier (its config.json)
    -> every derived config under paths.out; files whose bytes are unchanged are not touched."""
    import logging

    files = render_files(params.draft, params.verifier.path, paths.verifier,
                         params_file=params.source, lines=params.lines)
    changed = {str(c) for c in write(files, paths.out)}
    for rel in files:
        state = "written" if str(Path(paths.out) / rel) in changed else "unchanged"
        logging.getLogger(__name__).info("%s/%s %s", paths.out, rel, state)
