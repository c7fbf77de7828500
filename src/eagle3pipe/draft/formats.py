"""Every config layout of the draft, rendered in one place.

`render()` returns {relative path: file text}; the `configs` stage and the `eagle3pipe render`
CLI write exactly these bytes (with hidden-state extraction's configs/capture.json,
eagle3pipe.hidden.spec: eagle3pipe.stages.configs.run.render_files), and `eagle3pipe check`
compares against them. Every value any
consumer defaults differently (head_dim, norm_before_residual, aux ids, ...) is written
explicitly into every file. eagle3pipe.draft.parsing is the inverse: each layout that describes
the draft parsed back into its DraftArch.
"""
from __future__ import annotations

import json
from pathlib import Path

from eagle3pipe.draft.arch import DraftArch
from eagle3pipe.runtime.atomic import write_text_atomic
from eagle3pipe.runtime.jsonio import dumps
from eagle3pipe.verifier.handle import EMBEDDED_VERIFIER_DIR

FILES = ("draft_config.json", "speculators/config.json", "vllm/config.json",
         "verifier_config.json")  # configs/capture.json is eagle3pipe.hidden.spec's
TRAINED_DTYPE = "float32"  # training keeps float32 weights (train.py); the export casts
# draft.draft_arch -> the flat config's architecture: vLLM's registry names the Llama draft
# LlamaForCausalLMEagle3 (the published references' name) and the Qwen3 one Eagle3Qwen3ForCausalLM
# (vllm/model_executor/models/registry.py; EAGLEConfig keeps a name that starts or ends with
# "Eagle3", vllm/transformers_utils/configs/eagle.py)
FLAT_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
FLAT_ARCHITECTURE = FLAT_ARCHITECTURES["llama"]

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
    # vLLM's default; speculators' path differs: never rely on it
    "norm_before_residual": False,  # check: ignore (vLLM's fallback, not the draft's value)
    # EAGLE-3.1's switches: vLLM reads each with a default of false (llama_eagle3.py), the
    # speculators CLI turns two on for EAGLE-3 drafts: never rely on either
    "norm_before_fc": False, "fc_norm": False, "norm_output": False,  # check: ignore (vLLM's)
    "target_hidden_size": "=hidden_size",
    # a window per sliding_attention layer (vllm llama.py, qwen3_eagle3.py); these configs state
    # neither, so every draft layer attends to every position, as training's does
    "layer_types": None, "sliding_window": None,
}


def _rope_type(rope_scaling: dict | None) -> dict:
    """rope_scaling in transformers 5's rope_parameters form, less rope_theta (the legacy
    `type` key becomes `rope_type`; no scaling is {"rope_type": "default"})."""
    rp = dict(rope_scaling or {})
    rp.setdefault("rope_type", rp.pop("type", "default"))
    return rp


def canonical_rope(rope_scaling: dict | None) -> dict | None:
    """rope_scaling as the speculators layout can give it back: rope_type form, None for none."""
    rp = _rope_type(rope_scaling)
    return None if rp == {"rope_type": "default"} else rp


def rope_parameters(arch: DraftArch) -> dict:
    """The draft's transformers 5 rope_parameters: rope_scaling's rope_type form + rope_theta."""
    rp = _rope_type(arch.rope_scaling)
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
        "architectures": [FLAT_ARCHITECTURES[arch.draft_arch]],
        "model_type": arch.draft_arch,
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
        "norm_before_fc": arch.norm_before_fc,
        "fc_norm": arch.fc_norm,
        "norm_output": arch.norm_output,
        "num_attention_heads": arch.num_attention_heads,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_key_value_heads": arch.num_key_value_heads,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_scaling": arch.rope_scaling,
        "rope_theta": arch.rope_theta,
        "rope_parameters": rope_parameters(arch),
        "target_hidden_size": arch.target_hidden_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": arch.vocab_size,
    }


def transformer_layer_config(arch: DraftArch, attn_impl: str | None = None):
    """The draft decoder layer as a transformers LlamaConfig or Qwen3Config (draft.draft_arch:
    speculators' DRAFT_ARCH_CONFIGS, speculators/train/cli.py), head_dim explicit."""
    from transformers import LlamaConfig, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch.draft_arch]
    cfg = config_class(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
        hidden_act=arch.hidden_act, max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps, rope_parameters=rope_parameters(arch),
        bos_token_id=arch.bos_token_id, eos_token_id=arch.eos_token_id,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    if cfg.head_dim != arch.head_dim:  # transformers must never derive it
        raise AssertionError(f"{config_class.__name__} head_dim {cfg.head_dim} != {arch.head_dim}")
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
        norm_before_fc=arch.norm_before_fc, fc_norm=arch.fc_norm, norm_output=arch.norm_output,
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
        "verifier_config.json": {k: v for k, v in verifier_config.items()
                                 if k != "transformers_version"},
    }
    assert tuple(out) == FILES
    return {k: dumps(v) for k, v in out.items()}


def write(files: dict[str, str], out_dir: str | Path) -> list[Path]:
    """Writes rendered files atomically; files whose bytes are unchanged are not touched."""
    written = []
    for rel, text in files.items():
        p = Path(out_dir) / rel
        if p.is_file() and p.read_text() == text:
            continue
        write_text_atomic(p, text)
        written.append(p)
    return written
