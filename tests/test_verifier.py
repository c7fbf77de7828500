"""The verifier stage: path mode on sparse multi-GB checkpoints, model_dir, validation against
the draft params, the stage script end to end, and the embedded build's byte-identical rerun."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from helpers.malformed import BAD_VERIFIERS
from helpers.micro import DATA_PARAMS, MICRO_EMBEDDED, ROOT
from helpers.sparse import (CONFIG, GiB, make_checkpoint, shard_tensors,
                            write_safetensors_header)

from eagle3pipe.config import params as P
from eagle3pipe.verifier import handle as verifier
from eagle3pipe.stages.verifier import run as verifier_stage
from eagle3pipe.draft.arch import ArchError
from eagle3pipe.verifier.handle import VerifierConfigError


def vparams(path=None, hash_mode="headers", **embedded):
    return types.SimpleNamespace(path=None if path is None else str(path), hash_mode=hash_mode,
                                 embedded=types.SimpleNamespace(**{**MICRO_EMBEDDED, **embedded}))


def draft(**over):
    """tests/data's draft params (aux ids that fit the small test verifiers) with some keys
    replaced."""
    return dataclasses.replace(P.load(DATA_PARAMS).draft, **over)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def write_params(dst: Path, *, path, hash_mode="headers", embedded=None, draft_over=None) -> Path:
    """tests/data's params.yaml (a draft that fits the small test verifiers) with the verifier
    (and optionally draft) keys edited."""
    yaml = YAML(typ="rt")
    doc = yaml.load(DATA_PARAMS.read_text())
    doc["verifier"]["path"] = path
    doc["verifier"]["hash_mode"] = hash_mode
    for k, v in (embedded or {}).items():
        doc["verifier"]["embedded"][k] = v
    for k, v in (draft_over or {}).items():
        doc["draft"][k] = v
    buf = io.StringIO()
    yaml.dump(doc, buf)
    dst.write_text(buf.getvalue())
    return dst


def run_stage(cwd: Path, params_file: Path, out="out/verifier", metrics="metrics/verifier.json",
              env=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "stages" / "verifier.py"), "--params", str(params_file),
         "--out", out, "--metrics", metrics, "--dvc-yaml", str(ROOT / "dvc.yaml"),
         "--no-progress"],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})


# ---------------------------------------------------------------------------------------------
# Path mode


def test_path_mode_writes_copies_and_manifest_of_a_20gb_checkpoint_in_seconds(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=4, shard_gib=5.0)
    t0 = time.perf_counter()
    m = verifier_stage.build(vparams(ckpt), tmp_path / "out", draft=draft(), progress=False)
    assert time.perf_counter() - t0 < 5.0
    out = tmp_path / "out"
    copied = sorted(p.name for p in out.iterdir())
    assert copied == ["chat_template.jinja", "config.json", "generation_config.json",
                      "manifest.json", "tokenizer.json", "tokenizer_config.json"]
    for n in copied:
        if n != "manifest.json":
            assert (out / n).read_bytes() == (ckpt / n).read_bytes()
    man = json.loads((out / "manifest.json").read_text())
    assert man["mode"] == "headers" and man["path"] == str(ckpt.resolve())
    assert man["total_bytes"] >= 20 * GiB and m["total_bytes"] == man["total_bytes"]
    assert m["n_weight_files"] == 4 and m["hidden_size"] == CONFIG["hidden_size"]
    assert du(out) < 1 << 20  # nothing large was copied


def du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_path_mode_manifest_is_byte_identical_on_rerun_and_follows_headers(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=2, shard_gib=1.0)
    verifier_stage.build(vparams(ckpt), tmp_path / "a", progress=False)
    verifier_stage.build(vparams(ckpt), tmp_path / "b", progress=False)
    assert (tmp_path / "a/manifest.json").read_bytes() == (tmp_path / "b/manifest.json").read_bytes()
    write_safetensors_header(ckpt / "model-00001-of-00002.safetensors",
                             shard_tensors(0, 1.0, shards=2),
                             metadata={"format": "pt", "requantised": "yes"})
    verifier_stage.build(vparams(ckpt), tmp_path / "c", progress=False)
    assert (tmp_path / "a/manifest.json").read_bytes() != (tmp_path / "c/manifest.json").read_bytes()


def test_model_dir_path_mode_and_a_vanished_or_changed_checkpoint(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=2, shard_gib=1.0)
    out = tmp_path / "out"
    verifier_stage.build(vparams(ckpt), out, progress=False)
    assert verifier.model_dir(out) == ckpt.resolve()
    shard = ckpt / "model-00002-of-00002.safetensors"
    # DVC cannot see outside the project: model_dir notices what the headers mode would.
    os.truncate(shard, shard.stat().st_size + 8)  # grown: the header no longer matches the size
    with pytest.raises(verifier.VerifierError, match="(?s)model-00002-of-00002.*dvc repro"):
        verifier.model_dir(out)
    os.truncate(shard, shard.stat().st_size - 8)
    assert verifier.model_dir(out) == ckpt.resolve()
    # same size, another dtype
    write_safetensors_header(shard, shard_tensors(1, 1.0, "F16", shards=2))
    with pytest.raises(verifier.VerifierError, match="(?s)00002.safetensors: header_sha256.*dvc"):
        verifier.model_dir(out)
    write_safetensors_header(shard, shard_tensors(1, 1.0, shards=2))
    assert verifier.model_dir(out) == ckpt.resolve()
    cfg = (ckpt / "config.json").read_text()  # a same-size edit: only the hash tells
    (ckpt / "config.json").write_text(cfg.replace('"hidden_size": 1024', '"hidden_size": 2048'))
    with pytest.raises(verifier.VerifierError, match="(?s)config.json: sha256.*dvc repro"):
        verifier.model_dir(out)
    assert verifier.model_dir(out, verify=False) == ckpt.resolve()
    (ckpt / "config.json").write_text(cfg)
    (ckpt / "added.txt").write_text("x")
    with pytest.raises(verifier.VerifierError, match="added.txt: new"):
        verifier.model_dir(out)
    (ckpt / "added.txt").unlink()
    shutil.move(ckpt, tmp_path / "moved")
    with pytest.raises(verifier.VerifierError, match="no longer exists"):
        verifier.model_dir(out)


def test_model_dir_embedded_and_plain_checkpoint(tmp_path):
    # a plain HF checkpoint (no manifest, e.g. the micro_verifier fixture) is its own model dir
    plain = make_checkpoint(tmp_path / "plain", shards=1, shard_gib=0.01)
    assert verifier.model_dir(plain) == plain
    d = make_checkpoint(tmp_path / "emb", shards=1, shard_gib=0.01)
    (d / "manifest.json").write_text(json.dumps({"mode": "embedded", "path": None, "files": {}}))
    assert verifier.model_dir(d) == d
    with pytest.raises(verifier.VerifierError, match="dvc repro verifier"):
        verifier.model_dir(tmp_path)


def test_path_without_config_json_names_the_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=1, shard_gib=0.1)
    (ckpt / "config.json").unlink()
    with pytest.raises(VerifierConfigError, match=r"ckpt/config\.json.*not found"):
        verifier_stage.build(vparams(ckpt), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(verifier.VerifierError, match="not a directory"):
        verifier_stage.build(vparams(tmp_path / "nowhere"), tmp_path / "out", progress=False)


def test_non_decoder_config_is_rejected(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=1, shard_gib=0.1,
                           config={"model_type": "vit", "image_size": 224})
    with pytest.raises(VerifierConfigError, match="hidden_size, num_hidden_layers, vocab_size"):
        verifier_stage.build(vparams(ckpt), tmp_path / "out", progress=False)


def test_draft_incompatible_with_the_verifier_fails_before_writing(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=1, shard_gib=0.1)  # 8 layers
    out = tmp_path / "out"
    with pytest.raises(ArchError, match=r"draft.aux_layer_ids.*outside the verifier's layers 0\.\.7"):
        verifier_stage.build(vparams(ckpt), out, draft=draft(aux_layer_ids=[1, 4, 8]), progress=False)
    assert not out.exists()


def test_embedded_draft_check_fails_before_training(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ArchError, match="draft.draft_vocab_size"):
        verifier_stage.build(vparams(None), tmp_path / "out", draft=draft(draft_vocab_size=100000),
                     progress=False)
    assert time.perf_counter() - t0 < 10.0  # training alone takes > 15 s
    assert not (tmp_path / "out").exists()


def test_full_hash_mode_records_every_files_sha256(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=2, shard_gib=0.01)
    verifier_stage.build(vparams(ckpt, hash_mode="full"), tmp_path / "out", progress=False)
    man = json.loads((tmp_path / "out/manifest.json").read_text())
    assert man["mode"] == "full"
    assert all(len(e["sha256"]) == 64 for e in man["files"].values())


# ---------------------------------------------------------------------------------------------
# The stage script


@pytest.mark.integration
def test_stage_script_path_mode_end_to_end(tmp_path, micro_verifier):
    make_checkpoint(tmp_path / "ckpt", shards=3, shard_gib=4.0)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the preflight
        shutil.copyfile(micro_verifier / f, tmp_path / "ckpt" / f)  # loads the tokenizer
    params_file = write_params(tmp_path / "params.yaml", path="ckpt")  # relative to the cwd
    t0 = time.perf_counter()
    r = run_stage(tmp_path, params_file)
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t0 < 60, "12 GiB must be fingerprinted in seconds, not read"
    out = tmp_path / "out/verifier"
    man = json.loads((out / "manifest.json").read_text())
    assert man["path"] == str((tmp_path / "ckpt").resolve()) and man["mode"] == "headers"
    metrics = json.loads((tmp_path / "metrics/verifier.json").read_text())
    assert metrics["mode"] == "headers" and metrics["total_bytes"] >= 12 * GiB
    assert metrics["n_files"] == man["n_files"]
    assert (out / "config.json").read_bytes() == (tmp_path / "ckpt/config.json").read_bytes()
    first = (out / "manifest.json").read_bytes()
    r = run_stage(tmp_path, params_file)
    assert r.returncode == 0 and (out / "manifest.json").read_bytes() == first

    bad = write_params(tmp_path / "bad.yaml", path="ckpt", draft_over={"aux_layer_ids": [1, 2, 9]})
    r = run_stage(tmp_path, bad, out="out/bad")
    assert r.returncode == 2
    assert "draft.aux_layer_ids" in r.stderr and "bad.yaml" in r.stderr
    assert not (tmp_path / "out/bad").exists()

    gone = write_params(tmp_path / "gone.yaml", path="missing_ckpt")
    r = run_stage(tmp_path, gone, out="out/gone")
    assert r.returncode == 2 and "verifier.path" in r.stderr and "missing_ckpt" in r.stderr


@pytest.mark.slow
def test_stage_script_embedded_build_is_byte_identical(tmp_path, micro_verifier):
    """The stage (fresh process, different hash seed) reproduces the session fixture's
    in-process build byte for byte, and its manifest hashes match those bytes."""
    params_file = write_params(tmp_path / "params.yaml", path=None, embedded=MICRO_EMBEDDED,
                               draft_over={"draft_vocab_size": 256})
    r = run_stage(tmp_path, params_file, env={"PYTHONHASHSEED": "4242"})
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out/verifier"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([p.name for p in micro_verifier.iterdir()] + ["manifest.json"])
    for n in names:
        if n != "manifest.json":
            assert (out / n).read_bytes() == (micro_verifier / n).read_bytes(), n
    man = json.loads((out / "manifest.json").read_text())
    assert man["mode"] == "embedded" and man["path"] is None
    assert {n: e["sha256"] for n, e in man["files"].items()} == \
        {n: sha(out / n) for n in names if n != "manifest.json"}
    assert verifier.model_dir(out) == out
    metrics = json.loads((tmp_path / "metrics/verifier.json").read_text())
    assert metrics["mode"] == "embedded"
    assert math.isclose(metrics["heldout_perplexity"], math.exp(metrics["heldout_loss"]),
                        rel_tol=1e-3)
    assert metrics["heldout_perplexity"] < metrics["vocab_size"]  # it learned something
    assert metrics["parameters"] > 0


# ---------------------------------------------------------------------------------------------
# Malformed verifier checkpoints: refused before anything is written, naming the file (the
# cases, BAD_VERIFIERS: helpers/malformed.py)


@pytest.mark.parametrize("why,edit,file,say", BAD_VERIFIERS, ids=[c[0] for c in BAD_VERIFIERS])
def test_malformed_verifier_is_refused_before_writing(micro_verifier_copy, tmp_path, why, edit,
                                                      file, say):
    from eagle3pipe.errors import Error

    edit(micro_verifier_copy)
    out = tmp_path / "out"
    with pytest.raises(Error) as e:
        verifier_stage.build(vparams(micro_verifier_copy), out, draft=draft(draft_vocab_size=128),
                             progress=False,
                             engine={"trust_remote_code": False, "dtype": "float32"})
    text = str(e.value)
    assert str(micro_verifier_copy) in text and file in text and say in text, text
    assert "fix" in text, text
    assert not out.exists()


@pytest.mark.integration
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "deepseek_v3", "kimi_k2"])
def test_suggested_aux_ids_are_themselves_valid(model_type):
    """The aux-id fix a refusal suggests passes the same checks (arch.derive): three distinct,
    ascending ids inside the verifier, none 0 where vLLM's DeepseekV2Model crashes on it; for 6
    layers it is not vLLM's fallback (2, 3, 3)."""
    from eagle3pipe.verifier import families
    from eagle3pipe.draft.arch import derive

    for layers in range(4, 81):
        ids = families.suggest_aux_ids(layers, {"model_type": model_type})
        info = verifier.VerifierInfo("cfg", 256, layers, 4096, 4, None, None, model_type, ())
        derive(draft(aux_layer_ids=ids), info)  # raises on an invalid suggestion
        assert len(set(ids)) == 3
    assert families.suggest_aux_ids(6, {"model_type": "llama"}) == [2, 3, 5]
    assert families.suggest_aux_ids(4, {"model_type": "kimi_k2"}) == [1, 2, 3]
    assert families.suggest_aux_ids(3, {"model_type": "kimi_k2"}) is None
