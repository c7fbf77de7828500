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
and, by the EAGLE-3.1 switches and the layer type (speculators' Eagle3DraftModel.__init__ and
vLLM's llama_eagle3.py / qwen3_eagle3.py Eagle3*Model.__init__ create exactly these):
  input_norm.weight [3 * H_target]            (norm_before_fc)
  fc_norm.{0,1,2}.weight [H_target]           (fc_norm)
  <layer>.self_attn.{q_norm, k_norm}.weight [head_dim]   (draft_arch qwen3)
where <layer> is `layers.0` in speculators' layout and `midlayer` in the flat vLLM layout.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from eagle3pipe.config.schema import DraftParams
from eagle3pipe.errors import Error, Problem
from eagle3pipe.runtime.tensorfile import SAFETENSORS_BYTES
from eagle3pipe.verifier import families
from eagle3pipe.verifier.handle import VerifierInfo

NUM_AUX = 3  # vLLM's Eagle3 fc input is fixed at 3 aux layers (speculators 0.8 drafts with 4 failed)
LAYOUTS = ("speculators", "vllm")
LAYER_PREFIX = {"speculators": "layers.0", "vllm": "midlayer"}


# The largest memory of one accelerator on sale (2025): NVIDIA B300 (Blackwell Ultra) and AMD
# Instinct MI355X, 288 GB HBM3E each (NVIDIA's datasheets list H200 at 141 GB, B200 at 192 GB).
# derive() refuses a draft whose weights alone (arch.contract in draft.dtype, the figure
# `eagle3pipe plan` reports as "exported") exceed it: training keeps a whole replica per process
# (DDP, no sharding) and AdamW's float32 state is 8x more, so such a draft fits nowhere. Drafts
# that fit this bound but not the planned device are `eagle3pipe plan`'s to report.
LARGEST_ACCELERATOR_BYTES = 288 * 10 ** 9
LARGEST_ACCELERATOR = "NVIDIA B300 / AMD Instinct MI355X, 288 GB"
# the floating safetensors dtypes count as parameters
FLOATING = ("BF16", "F16", "F32", "F64")


class ArchError(Error, ValueError):
    def __init__(self, problems: list[Problem]):
        super().__init__(problems=problems)


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
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    draft_arch: str
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
    problems = _problems_against_verifier(draft, verifier, params_file, lines)
    if problems:
        raise ArchError(problems)
    H = verifier.hidden_size
    L = verifier.num_hidden_layers
    arch = DraftArch(
        hidden_size=H, target_hidden_size=H,
        num_attention_heads=draft.num_attention_heads,
        num_key_value_heads=draft.num_key_value_heads,
        head_dim=draft.head_dim,
        intermediate_size=draft.intermediate_size,
        vocab_size=verifier.vocab_size,
        draft_vocab_size=draft.draft_vocab_size,
        aux_layer_ids=tuple(draft.aux_layer_ids),
        norm_before_residual=draft.norm_before_residual,
        norm_before_fc=draft.norm_before_fc, fc_norm=draft.fc_norm,
        norm_output=draft.norm_output, draft_arch=draft.draft_arch,
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
    size = size_problem(arch, draft, verifier, params_file, lines)
    if size:
        raise ArchError([size])
    return arch


def _problems_against_verifier(draft: DraftParams, verifier: VerifierInfo, params_file: str,
                               lines: dict) -> list[Problem]:
    """Every way params' draft section contradicts the verifier or what vLLM and speculators
    accept, each a Problem naming its key in params_file (all reported at once)."""
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
    decoder = {"model_type": verifier.model_type}
    example = families.suggest_aux_ids(L, decoder) or "(none: fewer than 3 usable layers)"
    for i in ids:
        if not 0 <= i < L:
            bad("draft.aux_layer_ids",
                f"layer id {i} is outside the verifier's layers 0..{L - 1} "
                f"(num_hidden_layers={L} in {verifier.source})",
                f"use ids in 0..{L - 1}, e.g. {example}")
    if 0 in ids and not families.aux_zero_ok(decoder):
        bad("draft.aux_layer_ids",
            f"layer id 0 on a {verifier.model_type} verifier ({verifier.source}): vLLM's "
            "DeepseekV2Model adds the residual before layer 0, which is None, and crashes "
            "(\"unsupported operand type(s) for +: 'Tensor' and 'NoneType'\")",
            f"use ids in 1..{L - 1}, e.g. {example}")
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
    return problems


# which params key sizes each group of contract tensors (the rest: the verifier's sizes)
_SIZED_BY = (("self_attn.", "head_dim"), (".mlp.", "intermediate_size"),
             ("lm_head.", "draft_vocab_size"), ("d2t", "draft_vocab_size"))


def _bytes(n: int) -> str:
    return f"{n / 1e12:,.1f} TB" if n >= 10 ** 12 else f"{n / 1e9:,.1f} GB"


def size_problem(arch: DraftArch, draft: DraftParams, verifier: VerifierInfo,
                 params_file: str, lines: dict) -> Problem | None:
    """A draft whose weights (totals of contract(arch)) exceed LARGEST_ACCELERATOR_BYTES, named
    by the key that sizes its largest group of tensors, with the largest value that would fit."""
    specs = contract(arch, "speculators")
    params, total = totals(specs)
    if total <= LARGEST_ACCELERATOR_BYTES:
        return None
    groups: dict[str | None, int] = {}
    for name, s in specs.items():
        key = next((k for part, k in _SIZED_BY if part in name), None)
        groups[key] = groups.get(key, 0) + totals({name: s})[1]
    key = max(groups, key=groups.get)
    what = (f"{_bytes(total)} of weights (arch.contract: {params:,} parameters in "
            f"{arch.dtype})")
    limit = f"more than any one accelerator holds (the largest: {LARGEST_ACCELERATOR})"
    if key is None:
        return Problem(str(verifier.source), None, "hidden_size",
                       f"{verifier.hidden_size} makes the draft {what}, {limit}",
                       "check the verifier's config.json")
    value = getattr(draft, key)
    fits = (LARGEST_ACCELERATOR_BYTES - (total - groups[key])) // (groups[key] // value)
    fits -= fits % 2 if key == "head_dim" else 0
    hint = f"it fits at all only up to {fits:,}; " if fits > 0 else ""
    return Problem(params_file, lines.get(f"draft.{key}"), f"draft.{key}",
                   f"{value} makes the draft {what}, {_bytes(groups[key])} of them in the "
                   f"tensors draft.{key} sizes: {limit}; no machine can train or serve it",
                   f"lower draft.{key} ({hint}an EAGLE-3 draft is one decoder layer, usually "
                   "with the verifier's own head_dim and about its intermediate_size)")


def totals(specs: dict[str, TensorSpec]) -> tuple[int, int]:
    """(parameters: numel of the floating tensors, bytes of every tensor) of a contract: the
    one count of a draft's size (derive's bound above, `eagle3pipe plan`)."""
    numel = {name: math.prod(s.shape) for name, s in specs.items()}
    return (sum(n for name, n in numel.items() if specs[name].dtype in FLOATING),
            sum(n * SAFETENSORS_BYTES[specs[name].dtype] for name, n in numel.items()))


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
    if arch.norm_before_fc:
        out["input_norm.weight"] = TensorSpec((NUM_AUX * Ht,), w)
    if arch.fc_norm:
        out.update({f"fc_norm.{i}.weight": TensorSpec((Ht,), w) for i in range(NUM_AUX)})
    if arch.draft_arch == "qwen3":
        out[f"{p}.self_attn.q_norm.weight"] = TensorSpec((arch.head_dim,), w)
        out[f"{p}.self_attn.k_norm.weight"] = TensorSpec((arch.head_dim,), w)
    if embed_tokens:
        out["embed_tokens.weight"] = TensorSpec((arch.vocab_size, H), w)
    return dict(sorted(out.items()))


def rename(name: str, src: str, dst: str) -> str:
    """Maps a tensor name between layouts (`layers.0.` <-> `midlayer.`)."""
    a, b = LAYER_PREFIX[src] + ".", LAYER_PREFIX[dst] + "."
    return b + name[len(a):] if name.startswith(a) else name
