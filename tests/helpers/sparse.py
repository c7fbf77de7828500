"""Hugging Face-shaped checkpoints of many GiB that take no disk: valid safetensors headers,
data regions extended sparsely with os.truncate. Shared by tests/test_fingerprint.py and
tests/test_verifier.py."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

GiB = 1 << 30


def write_safetensors_header(path: Path, tensors: dict[str, tuple[str, list[int]]],
                             metadata: dict | None = None) -> int:
    """Writes a valid safetensors header for `tensors` {name: (dtype, shape)} and extends the
    file (sparsely) to the size the header describes. Returns the file size. Each dtype name is
    followed by JSON whitespace up to the longest name's width, so that a header rewritten with
    another dtype of the same item size (F16 for BF16) keeps the file's size."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "F8_E4M3": 1}
    width = max(map(len, itemsize))
    entries = [f'"__metadata__":{json.dumps(metadata or {"format": "pt"}, separators=(",", ":"))}']
    offset = 0
    for name, (dtype, shape) in sorted(tensors.items()):
        n = itemsize[dtype]
        for s in shape:
            n *= s
        entries.append(f'{json.dumps(name)}:{{"dtype":"{dtype}"{" " * (width - len(dtype))},'
                       f'"shape":{json.dumps(list(shape), separators=(",", ":"))},'
                       f'"data_offsets":[{offset},{offset + n}]}}')
        offset += n
    raw = ("{" + ",".join(entries) + "}").encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
    size = 8 + len(raw) + offset
    os.truncate(path, size)
    return size


CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 4, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2,
          "torch_dtype": "bfloat16"}


def shard_layers(i: int, shards: int) -> list[int]:
    """The decoder layers shard i of `shards` holds: consecutive, as many as the split allows
    (8 layers over 3 shards: 0-2, 3-5, 6-7)."""
    n = CONFIG["num_hidden_layers"]
    return [layer for layer in range(n) if layer * shards // n == i]


def intermediate_size(shard_gib: float, shards: int) -> int:
    """The MLP width make_checkpoint writes into config.json: the gate, up and down projections
    of the fewest layers any shard holds come to at least shard_gib GiB (BF16), so that every
    shard is at least that large."""
    fewest = min(len(shard_layers(i, shards)) for i in range(shards))
    return -(-int(shard_gib * GiB) // (fewest * 3 * CONFIG["hidden_size"] * 2))


def shard_tensors(i: int, shard_gib: float, dtype: str = "BF16", *, shards: int) -> dict:
    """Shard i's header in a checkpoint of `shards` shards of shard_gib GiB: the tensors, names
    and shapes, that vLLM's LlamaForCausalLM needs for make_checkpoint's config (q/k/v/o,
    gate/up/down and both layernorms of shard_layers(i, shards); embed_tokens in the first
    shard, the final norm and lm_head, unless tied, in the last). The verifier preflight loads
    them on the meta device and refuses a checkpoint that lacks any."""
    h, vocab = CONFIG["hidden_size"], CONFIG["vocab_size"]
    head_dim = h // CONFIG["num_attention_heads"]
    q, kv = h, CONFIG["num_key_value_heads"] * head_dim
    inter = intermediate_size(shard_gib, shards)
    shapes = {"self_attn.q_proj.weight": [q, h], "self_attn.k_proj.weight": [kv, h],
              "self_attn.v_proj.weight": [kv, h], "self_attn.o_proj.weight": [h, q],
              "mlp.gate_proj.weight": [inter, h], "mlp.up_proj.weight": [inter, h],
              "mlp.down_proj.weight": [h, inter], "input_layernorm.weight": [h],
              "post_attention_layernorm.weight": [h]}
    tensors = {f"model.layers.{layer}.{n}": (dtype, shape)
               for layer in shard_layers(i, shards) for n, shape in shapes.items()}
    if i == 0:
        tensors["model.embed_tokens.weight"] = (dtype, [vocab, h])
    if i == shards - 1:
        tensors["model.norm.weight"] = (dtype, [h])
        if not CONFIG.get("tie_word_embeddings", False):
            tensors["lm_head.weight"] = (dtype, [vocab, h])
    return tensors


def make_checkpoint(root: Path, shards: int = 4, shard_gib: float = 5.0,
                    config: dict | None = None) -> Path:
    """A Hugging Face-shaped checkpoint: config, tokenizer files, index, `shards` sparse
    safetensors shards of at least `shard_gib` GiB each (every tensor of CONFIG's Llama, the
    MLP width sized by intermediate_size), plus things that must not be copied."""
    root.mkdir(parents=True, exist_ok=True)
    inter = intermediate_size(shard_gib, shards)
    (root / "config.json").write_text(json.dumps(config or {**CONFIG, "intermediate_size": inter},
                                                 indent=2))
    (root / "generation_config.json").write_text('{"do_sample": false}\n')
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    (root / "tokenizer_config.json").write_text('{"eos_token": "</s>"}\n')
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (root / "README.md").write_text("a model card\n")
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = shard_tensors(i, shard_gib, shards=shards)
        write_safetensors_header(root / name, tensors)
        weight_map.update({n: name for n in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / ".cache").mkdir()
    (root / ".cache" / "lock").write_text("ignored")
    return root
