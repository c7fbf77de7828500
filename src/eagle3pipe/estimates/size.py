"""The verifier's size before anything is loaded: parameters and bytes in the engine, from the
safetensors headers beside its config.json, else estimated from the config's shapes (dense or
MoE MLPs, GQA or MLA attention), and the quantization it declares. Read by the estimates only."""
from __future__ import annotations

import math
from pathlib import Path

from eagle3pipe.runtime.tensorfile import read_header
from eagle3pipe.runtime.units import DTYPE_BYTES
from eagle3pipe.verifier import families


def header_totals(config_file: Path) -> tuple[int, int, str] | None:
    """(tensor elements, bytes, where) from the safetensors headers beside config.json."""
    files = sorted(Path(config_file).parent.glob("*.safetensors"))
    if not files:
        return None
    numel = nbytes = 0
    for f in files:
        h = read_header(f)
        numel += sum(math.prod(shape) for _, shape in h.tensors.values())
        nbytes += h.data_bytes
    return numel, nbytes, f"safetensors headers of {len(files)} file(s) in {Path(config_file).parent}"


def _attention_params(cfg: dict) -> int:
    H, heads = cfg["hidden_size"], cfg.get("num_attention_heads") or 1
    if "kv_lora_rank" in cfg:  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
        nope, rope, v, kv = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                             cfg["v_head_dim"], cfg["kv_lora_rank"])
        ql = cfg.get("q_lora_rank")
        q = H * ql + ql + ql * heads * (nope + rope) if ql else H * heads * (nope + rope)
        return q + H * (kv + rope) + kv + kv * heads * (nope + v) + heads * v * H
    kvh = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or H // heads
    return 2 * H * heads * hd + 2 * H * kvh * hd


def _moe_block(cfg: dict, routed: int) -> int:
    """Parameters of a MoE block's router, shared experts and `routed` of its routed experts."""
    H = cfg["hidden_size"]
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    moe_ff = cfg.get("moe_intermediate_size", cfg.get("intermediate_size", 4 * H))
    return (routed + (cfg.get("n_shared_experts") or 0)) * 3 * H * moe_ff + experts * H


def _mlps(cfg: dict) -> tuple[int, int, int]:
    """(dense layers, parameters of a dense MLP, of a MoE block with its router) of a decoder
    config; a MoE config's first `first_k_dense_replace` layers are dense."""
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    dense_layers = min(cfg.get("first_k_dense_replace", 0), L) if experts else L
    dense_mlp = 3 * H * cfg.get("intermediate_size", 4 * H)
    return dense_layers, dense_mlp, _moe_block(cfg, experts)


def config_param_estimate(cfg: dict) -> tuple[int, str]:
    """(parameters, how) of a decoder config: attention (GQA or MLA), dense or MoE MLPs,
    norms, embeddings and lm_head. An estimate: biases, MTP layers and extra heads omitted."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    dense_layers, dense_mlp, moe_mlp = _mlps(cfg)
    total = (L * (_attention_params(cfg) + 2 * H) + dense_layers * dense_mlp
             + (L - dense_layers) * moe_mlp + V * H * (1 if cfg.get("tie_word_embeddings") else 2)
             + H)
    kind = (f"MoE ({experts} experts, first {dense_layers} layers dense)" if experts
            else "dense (the config has no n_routed_experts/num_experts)")
    attn = "MLA" if "kv_lora_rank" in cfg else "GQA"
    how = f"estimated from config.json shapes: {kind}, {attn} attention"
    if families.decoder_type(cfg) in families.MLA_TYPES and not (experts and attn == "MLA"):
        how += (f" (model_type {cfg['model_type']} is MoE with MLA, but the config lacks "
                "n_routed_experts/moe_intermediate_size/kv_lora_rank...: far below the real "
                "checkpoint)")
    return total, how


def oracle_float32(cfg: dict, config_file: Path) -> tuple[int, int, str]:
    """(the embedding, the largest decoder layer) in float32 bytes: what the transformers oracle
    holds at once (eagle3pipe.hidden.oracle.oracle_memory), from the safetensors headers beside
    config.json, else from the config's shapes; and where the figure comes from."""
    from eagle3pipe.verifier.handle import Verifier

    d = Path(config_file).parent
    if any(d.glob("*.safetensors")):
        per_layer, embedding = Verifier(d, verify=False).float32_bytes()
        return embedding, max(per_layer.values(), default=0), "safetensors headers"
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    dense_layers, dense_mlp, moe_mlp = _mlps(cfg)
    mlp = moe_mlp if dense_layers < L else dense_mlp
    return 4 * cfg["vocab_size"] * H, 4 * (_attention_params(cfg) + 2 * H + mlp), \
        "config.json shapes"


def oracle_active_params(cfg: dict) -> int:
    """The decoder parameters one token passes through: every layer's attention and norms, a
    dense layer's MLP, a MoE layer's router, shared experts and the `num_experts_per_tok`
    routed experts it is sent to (transformers' MoE blocks run only those). The oracle's float32
    work is 2 x this x the tokens it compares, from the config's shapes (embedding lookups and
    the attention scores, small beside it at the oracle's sample lengths, left out)."""
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    dense_layers, dense_mlp, _ = _mlps(cfg)
    routed = min(cfg.get("num_experts_per_tok") or experts, experts)
    return (L * (_attention_params(cfg) + 2 * H) + dense_layers * dense_mlp
            + (L - dense_layers) * _moe_block(cfg, routed))


def _weight_bytes(quant: dict | None, vllm_dtype: str) -> tuple[float, str]:
    """(bytes per weight, the assumption) when only the config is known."""
    if not quant:
        return DTYPE_BYTES[vllm_dtype], (f"no quantization_config: every weight in vllm.dtype "
                                         f"{vllm_dtype} ({DTYPE_BYTES[vllm_dtype]} B)")
    bits = quant.get("bits") or quant.get("num_bits") or next(
        (g.get("weights", {}).get("num_bits") for g in quant.get("config_groups", {}).values()),
        8 if "fp8" in str(quant.get("quant_method", "")).lower() else None)
    method = quant.get("quant_method", "?")
    if not bits:
        return DTYPE_BYTES[vllm_dtype], f"quantization_config ({method}): no bit width, " \
            f"assumed vllm.dtype {vllm_dtype}"
    return bits / 8, (f"quantization_config ({method}): {bits}-bit weights assumed for every "
                      "weight (embeddings and norms usually stay 16-bit: a lower bound)")


def verifier_weights(whole: dict, cfg: dict, config_file: Path,
                     vllm_dtype: str) -> tuple[int, int, str]:
    """(parameters or tensor elements, bytes in the engine, where the figure comes from)."""
    quant = cfg.get("quantization_config") or whole.get("quantization_config")
    headers = header_totals(config_file)
    if headers is not None:
        numel, stored, where = headers
        if quant:
            return numel, stored, where + " (quantized: bytes as stored)"
        return numel, numel * DTYPE_BYTES[vllm_dtype], where + f" (cast to vllm.dtype {vllm_dtype})"
    n, how = config_param_estimate(cfg)
    per_weight, assumption = _weight_bytes(quant, vllm_dtype)
    return n, int(n * per_weight), f"{how}; {assumption}"
