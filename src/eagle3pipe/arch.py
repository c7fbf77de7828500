"""The draft architecture and its tensor shape contract.

This is the ONLY module that computes a shape. Renderers, exporters, trainers and checks all ask
`derive()` for the architecture and `contract()` for tensor names, shapes and dtypes.

Shapes of an EAGLE-3 draft (1 decoder layer whose attention sees [embedding ; hidden] = 2H):
  fc.weight                [H, 3 * H_target]      (3 aux layers; vLLM hard-codes 3)
  <layer>.self_attn.q_proj [heads * head_dim, 2H]
  <layer>.self_attn.k_proj [kv_heads * head_dim, 2H]   (v_proj alike)
  <layer>.self_attn.o_proj [H, heads * head_dim]
  <layer>.mlp.gate_proj    [ff, H]  (up_proj alike), down_proj [H, ff]
  <layer>.{input_layernorm, hidden_norm, post_attention_layernorm}.weight [H]
  norm.weight [H]; lm_head.weight [draft_vocab, H]; d2t int64 [draft_vocab]; t2d bool [vocab]
  embed_tokens.weight [vocab, H]  (optional: vLLM shares the verifier's when H matches)
where <layer> is `layers.0` in speculators' layout and `midlayer` in the flat vLLM layout.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from eagle3pipe.errors import Error
from eagle3pipe.params import DraftParams, Problem
from eagle3pipe.verifier import VerifierInfo

NUM_AUX = 3  # vLLM's Eagle3 fc input is fixed at 3 aux layers (speculators 0.8 drafts with 4 failed)
LAYOUTS = ("speculators", "vllm")
LAYER_PREFIX = {"speculators": "layers.0", "vllm": "midlayer"}


class ArchError(Error, ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True)
class DraftArch:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    dtype: str
    bos_token_id: int | list | None
    eos_token_id: int | list | None
    verifier_num_layers: int
    num_hidden_layers: int = 1

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: BF16, F16, F32, I64, BOOL


SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def derive(draft: DraftParams, verifier: VerifierInfo, *, params_file: str = "params.yaml",
           lines: dict | None = None) -> DraftArch:
    """Derives the draft architecture; cross-checks params against the verifier first."""
    lines = lines or {}
    problems: list[Problem] = []

    def bad(key: str, msg: str, fix: str) -> None:
        problems.append(Problem(params_file, lines.get(key), key, msg, fix))

    H = verifier.hidden_size
    L = verifier.num_hidden_layers
    if draft.hidden_size is not None and draft.hidden_size != H:
        bad("draft.hidden_size",
            f"{draft.hidden_size} differs from the verifier's hidden_size {H} "
            f"({verifier.source}); vLLM shares the verifier's embedding and lm_head geometry "
            "with the draft only when they are equal, and speculators refuses the pair",
            "remove draft.hidden_size (it is read from the verifier)")
    ids = list(draft.aux_layer_ids)
    if len(ids) != NUM_AUX:
        bad("draft.aux_layer_ids", f"expected exactly {NUM_AUX} layer ids, got {len(ids)}; "
            "vLLM's EAGLE-3 fc takes exactly 3 aux hidden states",
            "list 3 ascending verifier layer ids")
    for i in ids:
        if not 0 <= i < L:
            bad("draft.aux_layer_ids",
                f"layer id {i} is outside the verifier's layers 0..{L - 1} "
                f"(num_hidden_layers={L} in {verifier.source})",
                f"use ids in 0..{L - 1}, e.g. {[2, L // 2, L - 3] if L >= 6 else list(range(1, 4))}")
    if draft.draft_vocab_size > verifier.vocab_size:
        bad("draft.draft_vocab_size",
            f"{draft.draft_vocab_size} exceeds the verifier's vocab_size {verifier.vocab_size}",
            f"use at most {verifier.vocab_size}")
    if H % draft.num_attention_heads:
        bad("draft.num_attention_heads",
            f"{draft.num_attention_heads} does not divide the verifier hidden size {H}; "
            "transformers 5.19's LlamaConfig (which speculators and vLLM build the draft from) "
            "rejects hidden % heads != 0 even when head_dim is explicit",
            f"pick a divisor of {H} and keep draft.head_dim explicit")
    if draft.head_dim % 2:
        bad("draft.head_dim", f"must be even for rotary embeddings, got {draft.head_dim}",
            "use an even head_dim")
    if problems:
        raise ArchError(problems)
    return DraftArch(
        hidden_size=H, target_hidden_size=H,
        num_attention_heads=draft.num_attention_heads,
        num_key_value_heads=draft.num_key_value_heads,
        head_dim=draft.head_dim,
        intermediate_size=draft.intermediate_size,
        vocab_size=verifier.vocab_size,
        draft_vocab_size=draft.draft_vocab_size,
        aux_layer_ids=tuple(ids),
        norm_before_residual=draft.norm_before_residual,
        rope_theta=float(draft.rope_theta),
        rope_scaling=draft.rope_scaling,
        rms_norm_eps=float(draft.rms_norm_eps),
        max_position_embeddings=draft.max_position_embeddings,
        hidden_act=draft.hidden_act,
        dtype=draft.dtype,
        bos_token_id=verifier.bos_token_id,
        eos_token_id=verifier.eos_token_id,
        verifier_num_layers=L,
    )


def contract(arch: DraftArch, layout: str, *, embed_tokens: bool = False) -> dict[str, TensorSpec]:
    """Every tensor of an exported draft: name -> (shape, dtype)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    H, Ht, ff = arch.hidden_size, arch.target_hidden_size, arch.intermediate_size
    w = SAFETENSORS_DTYPE[arch.dtype]
    p = LAYER_PREFIX[layout]
    out = {
        "fc.weight": TensorSpec((H, NUM_AUX * Ht), w),
        f"{p}.input_layernorm.weight": TensorSpec((H,), w),
        f"{p}.hidden_norm.weight": TensorSpec((H,), w),
        f"{p}.post_attention_layernorm.weight": TensorSpec((H,), w),
        f"{p}.self_attn.q_proj.weight": TensorSpec((arch.q_dim, 2 * H), w),
        f"{p}.self_attn.k_proj.weight": TensorSpec((arch.kv_dim, 2 * H), w),
        f"{p}.self_attn.v_proj.weight": TensorSpec((arch.kv_dim, 2 * H), w),
        f"{p}.self_attn.o_proj.weight": TensorSpec((H, arch.q_dim), w),
        f"{p}.mlp.gate_proj.weight": TensorSpec((ff, H), w),
        f"{p}.mlp.up_proj.weight": TensorSpec((ff, H), w),
        f"{p}.mlp.down_proj.weight": TensorSpec((H, ff), w),
        "norm.weight": TensorSpec((H,), w),
        "lm_head.weight": TensorSpec((arch.draft_vocab_size, H), w),
        "d2t": TensorSpec((arch.draft_vocab_size,), "I64"),
        "t2d": TensorSpec((arch.vocab_size,), "BOOL"),
    }
    if embed_tokens:
        out["embed_tokens.weight"] = TensorSpec((arch.vocab_size, H), w)
    return dict(sorted(out.items()))


def rename(name: str, src: str, dst: str) -> str:
    """Maps a tensor name between layouts (`layers.0.` <-> `midlayer.`)."""
    a, b = LAYER_PREFIX[src] + ".", LAYER_PREFIX[dst] + "."
    return b + name[len(a):] if name.startswith(a) else name
