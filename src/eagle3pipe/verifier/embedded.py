"""The embedded default verifier: a byte-level BPE tokenizer and a tiny Llama, both trained on the
standard library's sources (corpus.py), on CPU, seeded and byte-identical on rerun.

The verifier is trained on chat-formatted pairs (user: a block of code, assistant: the block that
follows it in the same file), so that regenerated responses continue code instead of looping.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.runtime.seeds import seed_everything
from eagle3pipe.verifier import corpus

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, USER, ASSISTANT, END = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}<|end|>\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n"
    "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}\n"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_pairs(part: str, block_lines: int = 8, max_chars: int = 500) -> list[tuple[str, str]]:
    """(user, assistant) pairs of consecutive code blocks from one corpus part."""
    pairs = []
    for p in corpus.files(part):
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
        blocks = ["\n".join(lines[i:i + block_lines]).strip("\n")
                  for i in range(0, len(lines), block_lines)]
        blocks = [b[:max_chars] for b in blocks if b.strip()]
        pairs += list(zip(blocks[::2], blocks[1::2]))
    return pairs


def format_pair(user: str, assistant: str) -> str:
    return f"{USER}\n{user}{END}\n{ASSISTANT}\n{assistant}{END}\n"


def train_tokenizer(vocab_size: int, text_iter):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text_iter, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=PAD, eos_token=END,
                                   pad_token=PAD, unk_token=None, chat_template=CHAT_TEMPLATE,
                                   model_max_length=1 << 30)


def _windows(stream: torch.Tensor, seq_len: int, n: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (n,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def build(e, out_dir: str | Path, *, progress: bool = True) -> dict:
    """Builds the embedded verifier into out_dir (atomically). `e` is the params'
    `verifier.embedded` section. Returns metrics (held-out loss, perplexity)."""
    from transformers import LlamaForCausalLM

    seed_everything(e.seed, e.threads)
    train_text = [format_pair(u, a) for u, a in chat_pairs("train")]
    held_text = [format_pair(u, a) for u, a in chat_pairs("heldout")]
    tokenizer = train_tokenizer(e.tokenizer_vocab_size, train_text)
    vocab = len(tokenizer)
    ids = tokenizer(train_text, add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for seq in ids for t in seq], dtype=torch.long)
    held = torch.tensor([t for seq in tokenizer(held_text, add_special_tokens=False)["input_ids"]
                         for t in seq], dtype=torch.long)
    torch.manual_seed(e.seed)
    model = LlamaForCausalLM(_llama_config(e, tokenizer, vocab))
    gen = torch.Generator().manual_seed(e.seed)
    _train(model, stream, vocab, e, gen, progress)
    model.eval()
    eval_loss = evaluate(model, held, e.seq_len, e.batch_size)
    metrics = {"heldout_loss": round(eval_loss, 4),
               "heldout_perplexity": round(math.exp(eval_loss), 2),
               "train_tokens": int(len(stream)), "heldout_tokens": int(len(held)),
               "vocab_size": vocab, "parameters": sum(p.numel() for p in model.parameters())}
    with atomic_dir(out_dir) as tmp:
        model.generation_config.do_sample = False
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _normalise_json(Path(tmp))
    return metrics


def _llama_config(e, tokenizer, vocab: int):
    """The verifier's LlamaConfig from params' `verifier.embedded` section, the special tokens'
    ids from the tokenizer, SDPA attention."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=e.hidden_size, intermediate_size=e.intermediate_size,
        num_hidden_layers=e.num_hidden_layers, num_attention_heads=e.num_attention_heads,
        num_key_value_heads=e.num_key_value_heads, head_dim=e.head_dim,
        max_position_embeddings=e.max_position_embeddings, rms_norm_eps=e.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(e.rope_theta)},
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD),
        eos_token_id=tokenizer.convert_tokens_to_ids(END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    config._attn_implementation = "sdpa"
    return config


def _lr_at(e, step: int) -> float:
    """The learning rate at `step`: a linear warm-up over e.warmup_steps, then a cosine decay
    to e.min_lr_ratio of it at e.train_steps."""
    warmup, floor = e.warmup_steps, e.min_lr_ratio
    if step < warmup:
        return e.learning_rate * (step + 1) / warmup
    frac = (step - warmup) / max(1, e.train_steps - warmup)
    return e.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def _train(model, stream: torch.Tensor, vocab: int, e, gen: torch.Generator,
           progress: bool) -> None:
    """e.train_steps of AdamW on random windows of the token stream (drawn from `gen`), bf16
    autocast on CPU, gradients clipped to norm 1."""
    opt = torch.optim.AdamW(model.parameters(), lr=e.learning_rate, betas=tuple(e.adam_betas),
                            weight_decay=e.weight_decay)
    model.train()
    bar = tqdm(range(e.train_steps), desc="verifier: train", disable=not progress,
               mininterval=1.0)
    for step in bar:
        batch = _windows(stream, e.seq_len, e.batch_size, gen)
        for g in opt.param_groups:
            g["lr"] = _lr_at(e, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")


@torch.no_grad()
def evaluate(model, held: torch.Tensor, seq_len: int, batch_size: int, max_windows: int = 64) -> float:
    n = min(max_windows, (len(held) - 1) // seq_len)
    if n < 1:
        raise RuntimeError("held-out corpus part is shorter than one training window")
    windows = torch.stack([held[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
    losses = []
    for i in range(0, n, batch_size):
        b = windows[i:i + batch_size]
        logits = model(input_ids=b[:, :-1]).logits
        losses.append(torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1),
            reduction="sum").item())
    return sum(losses) / (n * seq_len)


def _normalise_json(d: Path) -> None:
    """Rewrites JSON files with sorted keys so reruns are byte-identical."""
    for p in sorted(d.glob("*.json")):
        if p.name == "tokenizer.json":
            continue
        data = json.loads(p.read_text())
        data.pop("transformers_version", None)
        p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
