"""The verifier preflight's tensor-name check (eagle3pipe.engines.verifier_names, reported by
preflight._tensor_names) on real tiny Llama checkpoints built from a config by transformers (no
hub): what the checkpoint lacks is named, a wrong shape names the tensor, and only torch's
meta-device errors skip the check."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3pipe.engines import preflight, verifier_names
from eagle3pipe.engines.engine import probe_settings

SETTINGS = probe_settings("bfloat16", False)


def build(out: Path, *, tied: bool, shard: str | None = None) -> Path:
    """A tiny random Llama checkpoint (2 layers), tied embeddings or not; `shard`: save it in
    shards of that size (with model.safetensors.index.json)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("llama") / "ckpt", tied=False)


def edited(src: Path, dst: Path, change) -> Path:
    """A copy of the single-file checkpoint src with change({name: tensor}) applied."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def findings(d: Path) -> list:
    found: list = []
    preflight._tensor_names(d, False, "bfloat16", found)
    return found


def test_a_complete_checkpoint_passes(llama):
    rep = verifier_names.check_verifier_names(SETTINGS, llama)
    assert (rep.skipped, rep.problem, rep.missing, rep.unchecked) == ("", None, (), "")
    assert rep.architecture == "LlamaForCausalLM"
    assert rep.tensors == len(load_file(str(llama / "model.safetensors"))) == 21
    assert findings(llama) == []


@pytest.mark.parametrize("drop", ["model.layers.1.self_attn.o_proj.weight",
                                  "model.layers.0.post_attention_layernorm.weight",
                                  "model.embed_tokens.weight", "lm_head.weight"])
def test_a_dropped_tensor_is_named_as_missing(llama, tmp_path, drop):
    d = edited(llama, tmp_path / "ckpt", lambda t: t.pop(drop))
    rep = verifier_names.check_verifier_names(SETTINGS, d)
    assert rep.problem is None and not rep.skipped
    assert rep.missing == (drop,)  # vLLM's name is the checkpoint's for these
    [f] = findings(d)
    assert f.file == str(d / "model.safetensors") and f.key == "tensors"
    assert "lacks tensors vLLM's LlamaForCausalLM needs: 1 of its parameters" in f.message
    assert drop in f.message and "*.safetensors" in f.fix


def test_many_missing_are_counted_and_the_first_named(llama, tmp_path):
    def drop_layers(t):
        for n in [n for n in t if n.startswith("model.layers.")]:
            t.pop(n)

    d = edited(llama, tmp_path / "ckpt", drop_layers)
    rep = verifier_names.check_verifier_names(SETTINGS, d)
    # per layer vLLM's qkv_proj, o_proj, gate_up_proj, down_proj and the two layernorms
    assert len(rep.missing) == 12 and rep.missing == tuple(sorted(rep.missing))
    [f] = findings(d)
    assert "12 of its parameters" in f.message and "... (2 more)" in f.message
    assert "model.layers.0.self_attn.qkv_proj.weight" in f.message


def test_a_tied_checkpoint_without_lm_head_passes(tmp_path):
    d = build(tmp_path / "tied", tied=True)
    assert "lm_head.weight" not in load_file(str(d / "model.safetensors"))
    rep = verifier_names.check_verifier_names(SETTINGS, d)
    assert (rep.skipped, rep.problem, rep.missing) == ("", None, ())
    assert findings(d) == []


def test_a_missing_shard_names_the_index_and_the_shard(tmp_path):
    d = build(tmp_path / "sharded", tied=False, shard="100KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    gone = index["model.layers.1.self_attn.o_proj.weight"]
    assert len(set(index.values())) > 2
    assert verifier_names.check_verifier_names(SETTINGS, d).missing == ()
    (d / gone).unlink()
    [f] = findings(d)
    assert f.file == str(d / "model.safetensors.index.json") and f.key == "weight_map"
    assert "model.layers.1.self_attn.o_proj.weight" in f.message
    assert f"lists shards that are not here: {gone}" in f.message
    assert "copy every shard listed in model.safetensors.index.json" in f.fix


def test_a_module_that_returns_no_loaded_set_leaves_missing_unchecked(llama, tmp_path,
                                                                     monkeypatch):
    """vLLM's AutoWeightsLoader only warns when a submodule's load_weights returns None: the
    loaded set is then partial, so nothing is called missing (and nothing refused)."""
    from vllm.model_executor.models.llama import LlamaModel

    original = LlamaModel.load_weights
    monkeypatch.setattr(LlamaModel, "load_weights",
                        lambda self, weights: original(self, weights) and None)
    d = edited(llama, tmp_path / "ckpt", lambda t: t.pop("model.norm.weight"))
    rep = verifier_names.check_verifier_names(SETTINGS, d)
    assert (rep.skipped, rep.problem, rep.missing) == ("", None, ())
    assert "returned no set of loaded parameters" in rep.unchecked
    assert findings(d) == []


def test_a_wrong_shape_names_the_tensor(llama, tmp_path):
    d = edited(llama, tmp_path / "ckpt",
               lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    rep = verifier_names.check_verifier_names(SETTINGS, d)
    assert rep.problem is not None and not rep.skipped and rep.missing == ()
    file, tensor, said = rep.problem
    assert (file, tensor) == (str(d / "model.safetensors"), "model.norm.weight")
    assert "65" in said and "64" in said, said
    [f] = findings(d)
    assert f.key == "model.norm.weight" and "cannot load this tensor" in f.message


def test_a_loader_that_reads_values_skips_the_check(llama, monkeypatch):
    """A weight loader that needs the tensor's values (a scale's .item()) meets torch's
    meta-device error: the check is skipped, not a finding."""
    from vllm.model_executor.models import utils

    monkeypatch.setattr(utils, "default_weight_loader", lambda p, w: w.abs().max().item())
    rep = verifier_names.check_verifier_names(SETTINGS, llama)
    assert rep.problem is None and "cannot be called on meta tensors" in rep.skipped
    assert findings(llama) == []


def test_another_error_mentioning_meta_is_a_finding(llama, monkeypatch):
    from vllm.model_executor.models import utils

    def loader(param, weight):
        raise ValueError("the tensor's metadata disagrees with the config")

    monkeypatch.setattr(utils, "default_weight_loader", loader)
    rep = verifier_names.check_verifier_names(SETTINGS, llama)
    assert not rep.skipped and rep.problem is not None
    # the first tensor, in the header's order, that vLLM hands to default_weight_loader
    assert rep.problem[:2] == (str(llama / "model.safetensors"),
                               "model.layers.0.input_layernorm.weight")
    assert "metadata disagrees" in rep.problem[2]


def test_the_meta_error_patterns_match_what_torch_raises():
    m = torch.empty(3, device="meta")
    raising = [lambda: m.sum().item(), lambda: bool(m.sum()), m.cpu, m.tolist, m.numpy,
               lambda: torch.empty(3).copy_(m), lambda: torch.equal(m, m), lambda: m[m > 0],
               lambda: torch.repeat_interleave(torch.empty(3, dtype=torch.long,
                                                           device="meta"))]
    for op in raising:
        with pytest.raises(Exception) as e:
            op()
        assert verifier_names.is_meta_error(e.value), repr(e.value)
    assert not verifier_names.is_meta_error(ValueError("metadata mismatch for model.meta"))
    assert not verifier_names.is_meta_error(
        AssertionError("Attempted to load weight (torch.Size([65])) into parameter "
                       "(torch.Size([64]))"))
