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
    file (sparsely) to the size the header describes. Returns the file size."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "F8_E4M3": 1}
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in sorted(tensors.items()):
        n = itemsize[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
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


def shard_tensors(i: int, shard_gib: float, dtype: str = "BF16") -> dict:
    """Shard i's header: one down_proj of shard_gib GiB (its width the checkpoint's
    intermediate size) and a layernorm, names and shapes vLLM's Llama class accepts (the
    verifier preflight loads them on the meta device)."""
    hidden = CONFIG["hidden_size"]
    cols = int(shard_gib * GiB) // (2 * hidden)
    return {f"model.layers.{i}.mlp.down_proj.weight": (dtype, [hidden, cols]),
            f"model.layers.{i}.input_layernorm.weight": (dtype, [hidden])}


def make_checkpoint(root: Path, shards: int = 4, shard_gib: float = 5.0,
                    config: dict | None = None) -> Path:
    """A Hugging Face-shaped checkpoint: config, tokenizer files, index, `shards` sparse
    safetensors shards of `shard_gib` GiB each, plus things that must not be copied."""
    root.mkdir(parents=True, exist_ok=True)
    cols = int(shard_gib * GiB) // (2 * CONFIG["hidden_size"])  # shard_tensors' down_proj
    (root / "config.json").write_text(json.dumps(config or {**CONFIG, "intermediate_size": cols},
                                                 indent=2))
    (root / "generation_config.json").write_text('{"do_sample": false}\n')
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    (root / "tokenizer_config.json").write_text('{"eos_token": "</s>"}\n')
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (root / "README.md").write_text("a model card\n")
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = shard_tensors(i, shard_gib)
        write_safetensors_header(root / name, tensors)
        weight_map.update({n: name for n in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / ".cache").mkdir()
    (root / ".cache" / "lock").write_text("ignored")
    return root
