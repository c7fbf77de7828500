"""fingerprint.py on real files: sparse multi-GB safetensors checkpoints (valid headers, data
region extended with os.truncate), real small safetensors written by the safetensors library."""
from __future__ import annotations

import json
import os
import struct
import time

import pytest

from eagle3pipe.verifier import fingerprint as fp
from helpers.sparse import (CONFIG, GiB, make_checkpoint, shard_tensors,
                            write_safetensors_header)


def test_sparse_20gb_checkpoint_is_fingerprinted_in_seconds(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=4, shard_gib=5.0)
    t0 = time.perf_counter()
    m = fp.fingerprint(ckpt, "headers", progress=False)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"headers fingerprint of a 20 GiB checkpoint took {elapsed:.1f} s"
    assert m["total_bytes"] >= 20 * GiB
    shards = [n for n in m["files"] if n.endswith(".safetensors")]
    assert len(shards) == 4
    for n in shards:
        e = m["files"][n]
        assert set(e) == {"size", "header_sha256", "tensors"}  # no full hash in headers mode
        assert e["size"] > 5 * GiB - 1
    # 2 layers of 9 tensors a shard, embed_tokens in the first, the final norm and lm_head in
    # the last
    assert [m["files"][n]["tensors"] for n in shards] == [19, 18, 18, 20]
    for n in ("config.json", "tokenizer.json", "model.safetensors.index.json", "README.md"):
        assert len(m["files"][n]["sha256"]) == 64
    assert not any(n.startswith(".") for n in m["files"])  # .cache/ skipped
    assert list(m["files"]) == sorted(m["files"])
    assert fp.fingerprint(ckpt, "headers", progress=False) == m  # deterministic


def test_header_change_changes_only_that_files_entry(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=2, shard_gib=2.0)
    before = fp.fingerprint(ckpt, "headers", progress=False)
    shard = ckpt / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    # same byte size, different dtype: the weights would be read as the wrong type
    write_safetensors_header(shard, shard_tensors(1, 2.0, "F16", shards=2))
    assert shard.stat().st_size == size
    after = fp.fingerprint(ckpt, "headers", progress=False)
    changed = [n for n in before["files"] if before["files"][n] != after["files"][n]]
    assert changed == [shard.name]
    assert before["files"][shard.name]["size"] == after["files"][shard.name]["size"]


def test_config_change_changes_manifest(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=1, shard_gib=1.0)
    before = fp.fingerprint(ckpt, "headers", progress=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_theta"] = 50000.0
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    after = fp.fingerprint(ckpt, "headers", progress=False)
    assert before["files"]["config.json"]["sha256"] != after["files"]["config.json"]["sha256"]
    assert {n: e for n, e in before["files"].items() if n != "config.json"} == \
        {n: e for n, e in after["files"].items() if n != "config.json"}


def test_full_mode_detects_a_tensor_byte_change_that_headers_mode_does_not(tmp_path):
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    save_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, 3)},
              str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    heads0 = fp.fingerprint(ckpt, "headers", progress=False)
    full0 = fp.fingerprint(ckpt, "full", progress=False)
    assert "sha256" in full0["files"]["model.safetensors"]
    assert full0["files"]["model.safetensors"]["header_sha256"] == \
        heads0["files"]["model.safetensors"]["header_sha256"]
    with open(ckpt / "model.safetensors", "r+b") as fh:  # flip one byte of tensor data
        fh.seek(-5, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    assert fp.fingerprint(ckpt, "headers", progress=False) == heads0  # documented blind spot
    assert fp.fingerprint(ckpt, "full", progress=False) != full0


def test_other_weight_formats_are_size_only_in_headers_mode(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    (ckpt / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    heads = fp.fingerprint(ckpt, "headers", progress=False)
    assert heads["files"]["pytorch_model.bin"] == {"size": 4096}
    full = fp.fingerprint(ckpt, "full", progress=False)
    assert len(full["files"]["pytorch_model.bin"]["sha256"]) == 64


@pytest.mark.parametrize("cut", [1, 10 ** 6])
def test_truncated_safetensors_is_an_error_naming_the_file(tmp_path, cut):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=2, shard_gib=0.5)
    shard = ckpt / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - cut)
    with pytest.raises(fp.FingerprintError, match="model-00001-of-00002.safetensors.*truncated"):
        fp.fingerprint(ckpt, "headers", progress=False)


def test_garbage_safetensors_header_is_an_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(fp.FingerprintError, match="header length"):
        fp.fingerprint(ckpt, "headers", progress=False)


def test_unknown_mode_and_missing_dir_are_errors(tmp_path):
    with pytest.raises(fp.FingerprintError, match="verifier.hash_mode"):
        fp.fingerprint(tmp_path, "fast", progress=False)
    with pytest.raises(fp.FingerprintError, match="not a directory"):
        fp.fingerprint(tmp_path / "nope", "headers", progress=False)
