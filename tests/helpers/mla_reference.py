"""A float64 reference of a DeepseekV3 / Kimi-K2 decoder layer (MLA attention, dense MLP or the
noaux_tc MoE block), computed from the config's own fields and one layer's safetensors tensors,
in plain torch: nothing of transformers' or vLLM's modelling code runs here. Each formula says
which upstream code it mirrors (paths under site-packages):
- T: transformers/models/deepseek_v3/modeling_deepseek_v3.py
- TR: transformers/modeling_rope_utils.py
- V: vllm/model_executor/models/deepseek_v2.py
- VR: vllm/model_executor/layers/rotary_embedding/ (deepseek_scaling_rope.py, common.py)
- VM: vllm/model_executor/layers/fused_moe/router/grouped_topk_router.py

The reference computes in float64 throughout. `norm_dtype` and `router_dtype` (float64 unless
given) are where an implementation may compute in another precision: transformers computes its
RMSNorm (T: DeepseekV3RMSNorm.forward) and its router logits and scores (T:
DeepseekV3TopkRouter.forward) in float32 whatever the model's dtype, so a comparison with
transformers' layer in float64 names float32 there to compare everything else exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

F64 = torch.float64
EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Mla:
    """The config fields a DeepseekV3 decoder layer is built from (T: DeepseekV3Config)."""
    hidden_size: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    eps: float
    rope: dict  # rope_type, rope_theta and YaRN's keys
    interleave: bool
    first_k_dense: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling: float
    n_shared: int
    moe_intermediate: int
    topk_method: str | None
    scoring: str
    # q_a_layernorm's and kv_a_layernorm's epsilon: DeepseekV3RMSNorm's default 1e-6 (T:
    # DeepseekV3Attention.__init__, as DeepSeek's own modeling_deepseek.py); V uses
    # config.rms_norm_eps for them (DeepseekV2MLAAttention.__init__): the same on the published
    # configs (rms_norm_eps 1e-6), 1e-5 vs 1e-6 on the tiny ones
    latent_eps: float = 1e-6

    @classmethod
    def from_dict(cls, d: dict) -> "Mla":
        """From config.json's dict (a wrapper's text_config, as Kimi-K2.5 ships it). The rope
        keys in transformers 5's `rope_parameters` or in the published configs' `rope_theta` +
        `rope_scaling` (deepseek-ai/DeepSeek-V3: {"type": "yarn", "factor": 40, ...})."""
        d = d.get("text_config") or d
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
        return cls(
            d["hidden_size"], d["num_attention_heads"], d.get("q_lora_rank"),
            d["kv_lora_rank"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"],
            d["rms_norm_eps"], rope, d.get("rope_interleave", True),
            d.get("first_k_dense_replace", 0), d.get("n_routed_experts") or 0,
            d.get("num_experts_per_tok") or 0, d.get("n_group") or 1, d.get("topk_group") or 1,
            d.get("norm_topk_prob", True), d.get("routed_scaling_factor", 1.0),
            d.get("n_shared_experts") or 0, d.get("moe_intermediate_size") or 0,
            d.get("topk_method"), d.get("scoring_func", "sigmoid"))


def yarn_mscale(scale: float, mscale: float) -> float:
    """0.1 * mscale * ln(scale) + 1, 1 for scale <= 1 (T: yarn_get_mscale; VR:
    deepseek_scaling_rope.yarn_get_mscale; V: yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def is_yarn(c: Mla) -> bool:
    return c.rope["rope_type"] not in ("default", None)


def inv_freq(c: Mla) -> torch.Tensor:
    """The rotary frequencies [qk_rope / 2], float64. default: theta^(-2i/d). YaRN (TR:
    _compute_yarn_parameters; VR: DeepseekScalingRotaryEmbedding._compute_inv_freq with
    common.yarn_find_correction_range / yarn_linear_ramp_mask): the frequency of pair i blends
    the extrapolated theta^(-2i/d) and the interpolated one / factor by a ramp over the pairs
    between floor(low) and ceil(high), low and high the pairs that turn beta_fast and beta_slow
    times over original_max_position_embeddings: d ln(L / (2 pi beta)) / (2 ln theta)."""
    d, base = c.qk_rope, float(c.rope["rope_theta"])
    extrapolated = 1.0 / base ** (torch.arange(0, d, 2, dtype=F64) / d)
    if not is_yarn(c):
        return extrapolated
    factor, length = float(c.rope["factor"]), c.rope["original_max_position_embeddings"]
    turns = lambda beta: d * math.log(length / (beta * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(turns(c.rope.get("beta_fast") or 32)), 0)
    high = min(math.ceil(turns(c.rope.get("beta_slow") or 1)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=F64) - low) / (high - low if high > low else 1e-3))
    ramp = ramp.clamp(0, 1)  # 0: extrapolate (fast pairs), 1: interpolate (slow pairs)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def rope_attention_factor(c: Mla) -> float:
    """What YaRN multiplies cos and sin by: mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) (VR: DeepseekScalingRotaryEmbedding.__init__, `self.mscale`; TR:
    _compute_yarn_parameters' attention_factor, an explicit `attention_factor` first; it takes
    mscale(factor, 1) when either key is missing, the same on the published configs, which
    carry both)."""
    if not is_yarn(c):
        return 1.0
    if c.rope.get("attention_factor") is not None:
        return float(c.rope["attention_factor"])
    f = float(c.rope["factor"])
    return (yarn_mscale(f, c.rope.get("mscale") or 1)
            / yarn_mscale(f, c.rope.get("mscale_all_dim") or 0))


def softmax_scale(c: Mla) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN (T:
    DeepseekV3Attention.__init__ with yarn_apply_mscale; V: DeepseekV2MLAAttention.__init__,
    `self.scaling * mscale * mscale` when rope_type is deepseek_yarn)."""
    scale = (c.qk_nope + c.qk_rope) ** -0.5
    if is_yarn(c) and c.rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(c.rope["factor"]), c.rope["mscale_all_dim"]) ** 2
    return scale


def rope_angles(c: Mla, positions: torch.Tensor) -> torch.Tensor:
    """position x frequency [T, qk_rope / 2], float64."""
    return positions.to(F64)[:, None] * inv_freq(c)[None]


def rotate(x: torch.Tensor, angles: torch.Tensor, interleave: bool, gain: float) -> torch.Tensor:
    """x [T, heads, d] rotated by angles [T, d/2] times gain. interleave: pair i is (x[2i],
    x[2i+1]) (VR: common.rotate_gptj, is_neox_style=False, which V always builds for MLA; T:
    apply_rotary_pos_emb_interleave); else (x[i], x[i + d/2]) (VR: common.rotate_neox; T:
    apply_rotary_pos_emb with rotate_half). The output keeps x's layout (T's interleaved
    variant lays the pairs out as halves instead: the same dot products)."""
    cos, sin = (angles.cos() * gain)[:, None], (angles.sin() * gain)[:, None]
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype=F64) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the normalisation in `dtype` (T: DeepseekV3RMSNorm,
    float32 there; vllm/model_executor/layers/layernorm.py: RMSNorm.forward_native)."""
    y = x.to(dtype)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(F64) * y.to(F64)


def attention(w: dict, c: Mla, x: torch.Tensor, norm_dtype=F64) -> torch.Tensor:
    """Multi-head latent attention of the normalised states x [T, H], positions 0..T-1, causal
    (T: DeepseekV3Attention.forward; V: DeepseekV2MLAAttention with
    vllm/model_executor/layers/mla.py MultiHeadLatentAttentionWrapper.forward). q: q_proj, or
    q_b_proj(RMSNorm(q_a_proj x)) with q_lora_rank; per head [qk_nope | qk_rope]. The latent:
    kv_a_proj_with_mqa x = [c_kv (kv_lora_rank) | k_pe (qk_rope, one head shared by all)];
    kv_b_proj(RMSNorm(c_kv)) = per head [k_nope | v]. q_pe and k_pe rotated (rotate); scores
    (q_nope.k_nope + q_pe.k_pe) * softmax_scale, causal softmax, o_proj of the heads' mix of v."""
    T, nh = x.shape[0], c.heads
    if c.q_lora_rank is None:
        q = x @ w["self_attn.q_proj.weight"].T
    else:
        qa = rms_norm(x @ w["self_attn.q_a_proj.weight"].T,
                      w["self_attn.q_a_layernorm.weight"], c.latent_eps, norm_dtype)
        q = qa @ w["self_attn.q_b_proj.weight"].T
    q = q.view(T, nh, c.qk_nope + c.qk_rope)
    latent = x @ w["self_attn.kv_a_proj_with_mqa.weight"].T
    ckv, k_pe = latent.split([c.kv_lora_rank, c.qk_rope], dim=-1)
    ckv = rms_norm(ckv, w["self_attn.kv_a_layernorm.weight"], c.latent_eps, norm_dtype)
    kv = (ckv @ w["self_attn.kv_b_proj.weight"].T).view(T, nh, c.qk_nope + c.v_head)
    k_nope, v = kv.split([c.qk_nope, c.v_head], dim=-1)
    angles, gain = rope_angles(c, torch.arange(T)), rope_attention_factor(c)
    q_pe = rotate(q[..., c.qk_nope:], angles, c.interleave, gain)
    k_pe = rotate(k_pe[:, None], angles, c.interleave, gain)
    scores = torch.einsum("thd,shd->hts", q[..., :c.qk_nope], k_nope)
    scores = (scores + torch.einsum("thd,sd->hts", q_pe, k_pe[:, 0])) * softmax_scale(c)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hts,shd->thd", p, v).reshape(T, nh * c.v_head)
    return out @ w["self_attn.o_proj.weight"].T


def mlp(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) (T: DeepseekV3MLP.forward, DeepseekV3Experts.forward; V:
    DeepseekV2MLP, SiluAndMul)."""
    gate, up = x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T
    return (F.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


def route(w: dict, c: Mla, x: torch.Tensor, router_dtype=F64
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's choice for x [T, H]: (experts [T, k], their weights [T, k] float64, the
    margin [T] of the choice). Scores sigmoid(x W_g^T) (softmax for scoring_func softmax),
    computed in router_dtype; e_score_correction_bias added for the choice only. Group-limited:
    the experts split into n_group groups, a group scored by the sum of its top-2 biased scores
    (noaux_tc; its top score without the bias), the topk_group best groups kept; top-k of their
    biased scores; weights the unbiased scores, divided by their sum with norm_topk_prob, times
    routed_scaling_factor (T: DeepseekV3TopkRouter.forward; VM: grouped_topk). The margin is the
    relative gap (s_k - s_k+1) / |s_k| of the k-th and next biased scores among the kept groups'
    experts, or of the kept groups' last and the next group's score if that is smaller: where
    it is small, a computation in another precision may choose otherwise."""
    logits = F.linear(x.to(router_dtype), w["mlp.gate.weight"].to(router_dtype))
    scores = logits.sigmoid() if c.scoring == "sigmoid" else logits.softmax(-1)
    bias = w.get("mlp.gate.e_score_correction_bias")
    choice = scores.to(F64) + (bias if bias is not None else 0.0)
    grouped = choice.view(len(x), c.n_group, c.experts // c.n_group)
    group = grouped.topk(2, dim=-1).values.sum(-1) if bias is not None \
        else grouped.max(-1).values
    kept = group.topk(c.topk_group, dim=-1).indices
    allowed = torch.zeros_like(group, dtype=torch.bool).scatter(1, kept, True)
    allowed = allowed[..., None].expand_as(grouped).reshape(len(x), c.experts)
    choice = choice.masked_fill(~allowed, float("-inf"))
    idx = choice.topk(c.top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if c.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = (weights * c.routed_scaling).to(F64)
    return idx, weights, torch.minimum(_gap(choice, c.top_k), _gap(group, c.topk_group))


def _gap(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(k-th - (k+1)-th) / |k-th| of each row of scores [T, n] (-inf: not eligible); inf where
    fewer than k + 1 are eligible."""
    if scores.shape[-1] <= k:
        return torch.full(scores.shape[:1], float("inf"), dtype=F64)
    top = scores.topk(k + 1, dim=-1).values.to(F64)
    gap = (top[:, k - 1] - top[:, k]) / top[:, k - 1].abs()
    return torch.where(torch.isinf(top[:, k]), float("inf"), gap)


def moe(w: dict, c: Mla, x: torch.Tensor, router_dtype=F64) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block on x [T, H]: sum over the chosen experts of weight x expert(x), plus the
    shared experts' MLP (n_shared_experts of them fused into one of moe_intermediate_size x
    n_shared_experts) (T: DeepseekV3MoE.forward; V: DeepseekV2MoE with FusedMoE, the routed
    scaling applied to the weights). (Its output, the router's margin [T]: route.)"""
    idx, weights, margin = route(w, c, x, router_dtype)
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        out[rows] += weights[rows, slot, None] * mlp(w, f"mlp.experts.{e}.", x[rows])
    if c.n_shared:
        out = out + mlp(w, "mlp.shared_experts.", x)
    return out, margin


def decoder_layer(w: dict, c: Mla, i: int, h: torch.Tensor, norm_dtype=F64, router_dtype=F64
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder layer i on the residual stream h [T, H] (positions 0..T-1): h + attention of
    the input RMSNorm, then + the MLP (layers below first_k_dense_replace; MoE from there) of
    the post-attention RMSNorm (T: DeepseekV3DecoderLayer.forward; V:
    DeepseekV2DecoderLayer.forward, its fused residual adds). (Its output float64, the router's
    margin [T]: inf for a dense layer.)"""
    h = h.to(F64)
    h = h + attention(w, c, rms_norm(h, w["input_layernorm.weight"], c.eps, norm_dtype),
                      norm_dtype)
    x = rms_norm(h, w["post_attention_layernorm.weight"], c.eps, norm_dtype)
    if i < c.first_k_dense or not c.experts:
        return h + mlp(w, "mlp.", x), torch.full(h.shape[:1], float("inf"), dtype=F64)
    out, margin = moe(w, c, x, router_dtype)
    return h + out, margin


def _prefix(files: list[Path]) -> str:
    """What precedes model.embed_tokens.weight (`language_model.` in Kimi-K2.5's files)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.endswith(EMBEDDING):
                    return name[:-len(EMBEDDING)]
    raise ValueError(f"no {EMBEDDING} in {files}")


def layer_weights(model_dir: Path, i: int) -> dict[str, torch.Tensor]:
    """Decoder layer i's tensors, float64, named from past `model.layers.<i>.`."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    head = f"{_prefix(files)}model.layers.{i}."
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out |= {n[len(head):]: st.get_tensor(n).to(F64) for n in st.keys()
                    if n.startswith(head)}
    return out


def embedding(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """The embedding rows of ids [T, H], float64."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    name = _prefix(files) + EMBEDDING
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name).to(F64)[torch.tensor(ids)]
    raise ValueError(f"no {name} in {files}")
