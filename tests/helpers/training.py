"""Inputs of the train stage for the micro verifier, as the stages before it write them: the
draft config (configs stage), a speculators datapath of real hidden states from a real forward
pass (extract stage) and a vocab map (vocab stage). Shared by tests/test_train.py and
tests/test_export.py."""
from __future__ import annotations

import json
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3pipe.config.schema import DraftParams
from eagle3pipe.draft import arch as archmod
from eagle3pipe.verifier.handle import VerifierInfo

# head_dim 32 on purpose: hidden/heads would be 64/4 = 16, so a derived head_dim shows up as
# wrong shapes everywhere.
MICRO_DRAFT = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=96, aux_layer_ids=[1, 2, 3], draft_vocab_size=128,
                   norm_before_residual=True, norm_before_fc=False, fc_norm=False,
                   norm_output=False, draft_arch="llama", rope_theta=10000.0, rope_scaling=None,
                   rms_norm_eps=1e-6, max_position_embeddings=1024, hidden_act="silu",
                   dtype="bfloat16", num_speculative_tokens=3)
MICRO_TRAIN = dict(seed=0, threads=2, device="cpu", nproc_per_node=1, epochs=2, batch_tokens=512,
                   learning_rate=3e-3, weight_decay=0.0, warmup_steps=2, ttt_steps=3, loss="kl_div",
                   ttt_step_loss_decay=1.0, grad_clip=1.0,
                   loss_impl="auto", eval_every=4, checkpoint_every=0, cpu_chunk_tokens=512, nnodes=1, rdzv_endpoint=None, init_from=None)


def draft_arch(verifier: Path, **overrides) -> archmod.DraftArch:
    return archmod.derive(DraftParams(**{**MICRO_DRAFT, **overrides}),
                          VerifierInfo.from_config(verifier))


def write_draft_config(verifier: Path, path: Path, **overrides) -> archmod.DraftArch:
    """What the configs stage writes: DraftArch.to_dict() minus "dtype"."""
    a = draft_arch(verifier, **overrides)
    d = a.to_dict()
    d.pop("dtype")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return a


def _conversations(tokenizer, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    from eagle3pipe.verifier import embedded

    pairs = embedded.chat_pairs("heldout")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(pairs), generator=g)[:n].tolist()
    out = []
    for i in pick:
        user, assistant = pairs[i]
        prompt = tokenizer(f"{embedded.USER}\n{user[:160]}{embedded.END}\n{embedded.ASSISTANT}\n",
                           add_special_tokens=False)["input_ids"]
        answer = tokenizer(f"{assistant[:160]}{embedded.END}\n",
                           add_special_tokens=False)["input_ids"]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


@torch.no_grad()
def write_datapath(model, convs, out: Path, aux_ids) -> None:
    """A speculators datapath: save_to_disk dataset + hidden_states/hs_i.safetensors with
    token_ids [T] and hidden_states [T, 4, H] bf16 (aux layer inputs, then the last layer's
    output before the final norm), from a real forward pass."""
    from datasets import Dataset

    captured = {}
    hook = model.model.norm.register_forward_hook(
        lambda mod, args, out_: captured.__setitem__("pre_norm", args[0]))
    (out / "hidden_states").mkdir(parents=True)
    try:
        for i, (ids, _mask) in enumerate(convs):
            x = torch.tensor([ids])
            hs = model(input_ids=x, output_hidden_states=True).hidden_states
            slots = [hs[j][0] for j in aux_ids] + [captured["pre_norm"][0]]
            save_file({"token_ids": x[0].clone(),
                       "hidden_states": torch.stack(slots, dim=1).to(torch.bfloat16).contiguous()},
                      str(out / "hidden_states" / f"hs_{i}.safetensors"))
    finally:
        hook.remove()
    ds = Dataset.from_dict({"input_ids": [c[0] for c in convs],
                            "loss_mask": [c[1] for c in convs],
                            "seq_len": [len(c[0]) for c in convs]})
    ds.set_format("torch")
    ds.save_to_disk(str(out))


def write_vocab_map(convs, vocab_size: int, draft_vocab: int, out_dir: Path) -> None:
    """d2t/t2d from assistant-token frequencies with speculators' own mapping builder."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts: dict[int, int] = {}
    for ids, mask in convs:
        for t, m in zip(ids, mask):
            if m:
                counts[t] = counts.get(t, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab, vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()},
              str(out_dir / "vocab_map.safetensors"))


def make_inputs(verifier: Path, root: Path, *, n_train=16, n_eval=4, **draft_overrides):
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(2)
    a = write_draft_config(verifier, root / "configs" / "draft_config.json", **draft_overrides)
    tok = AutoTokenizer.from_pretrained(verifier)
    model = LlamaForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    convs = _conversations(tok, n_train + n_eval, seed=0)
    write_datapath(model, convs[:n_train], root / "hidden" / "train", a.aux_layer_ids)
    write_datapath(model, convs[n_train:], root / "hidden" / "eval", a.aux_layer_ids)
    write_vocab_map(convs[:n_train], a.vocab_size, a.draft_vocab_size, root / "vocab")
    return types.SimpleNamespace(root=root, verifier=verifier, arch=a,
                                 draft_config=root / "configs" / "draft_config.json",
                                 hidden=root / "hidden", vocab=root / "vocab")
