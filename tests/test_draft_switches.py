"""The draft switches params.yaml holds beyond EAGLE-3 (EAGLE-3.1's norm_before_fc / fc_norm /
norm_output, the Qwen3 decoder layer) trained by speculators' own classes, and train.init_from:
a draft continued from an export starts at that export's held-out loss. Real speculators
Eagle3DraftModel, real hidden states of the micro verifier, real safetensors files."""
from __future__ import annotations

import dataclasses
import json
import shutil
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3pipe.draft import arch as archmod
from eagle3pipe.draft import formats
from eagle3pipe.draft import init_from
from eagle3pipe.stages.export import run as exportmod
from eagle3pipe.stages.train import run as trainmod
from helpers.training import MICRO_TRAIN, make_inputs

pytestmark = pytest.mark.slow  # each trains the micro draft (about 10 s)

SWITCHES = {
    "norm_before_fc+norm_output": dict(norm_before_fc=True, norm_output=True),
    "fc_norm+norm_output+qwen3": dict(fc_norm=True, norm_output=True, draft_arch="qwen3"),
}


def _train(inp, root, **overrides):
    p = types.SimpleNamespace(**{**MICRO_TRAIN, **overrides})
    return trainmod.train(p, inp.draft_config, inp.verifier, inp.hidden, inp.vocab,
                          root / "train", metrics_dir=root / "metrics", progress=False)


def _eval_loss_at(metrics, step: int) -> float:
    rows = (metrics / "plots" / "metrics" / "eval" / "loss.tsv").read_text().splitlines()
    head = rows[0].split("\t")
    by_step = {int(r.split("\t")[head.index("step")]): float(r.split("\t")[-1]) for r in rows[1:]}
    return by_step[step]


@pytest.mark.parametrize("name", list(SWITCHES))
def test_switches_train_through_speculators(micro_verifier, tmp_path, name):
    """The checkpoint holds exactly the contract's tensors for the switches (input_norm,
    fc_norm.i, q/k norms), its config states each switch, and the norms a switch adds train."""
    sw = SWITCHES[name]
    inp = make_inputs(micro_verifier, tmp_path / "in", n_train=8, n_eval=2, **sw)
    _train(inp, tmp_path, epochs=1)
    spec = archmod.contract(dataclasses.replace(inp.arch, dtype="float32"), "speculators")
    with safe_open(str(tmp_path / "train" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(spec)
    t = load_file(str(tmp_path / "train" / "model.safetensors"))
    added = [n for n in spec if n.startswith(("input_norm", "fc_norm")) or "_norm." in n
             and "self_attn" in n]
    assert added, spec
    for n in added:  # initialised to 1 by speculators; trained away from it
        assert not torch.equal(t[n], torch.ones_like(t[n])), n
    cfg = json.loads((tmp_path / "train" / "config.json").read_text())
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        assert cfg.get(key, False) is getattr(inp.arch, key), key
    assert cfg["transformer_layer_config"]["model_type"] == inp.arch.draft_arch


@pytest.fixture(scope="module")
def exported(micro_verifier, tmp_path_factory):
    """The micro draft trained for 2 epochs and exported in both layouts (the export stage's
    function), beside its inputs."""
    root = tmp_path_factory.mktemp("init_from")
    inp = make_inputs(micro_verifier, root / "in")
    final = _train(inp, root)
    files = formats.render(inp.arch, verifier_config=json.loads(
        (micro_verifier / "config.json").read_text()), verifier_path=str(micro_verifier),
        num_speculative_tokens=3)
    formats.write({k: v for k, v in files.items() if k.endswith("config.json")}, root / "configs")
    exportmod.export(root / "train", root / "configs/speculators/config.json",
                     root / "configs/vllm/config.json", micro_verifier, root / "export")
    return types.SimpleNamespace(inp=inp, root=root, final=final)


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_init_from_starts_at_the_exports_loss(exported, tmp_path, layout):
    """Step 0 of a run started from the export evaluates at the export's held-out loss (bf16
    rounding of the export aside), far below a random init's step 0; metrics name it."""
    drafts = tmp_path / "drafts" / "previous"
    shutil.copytree(exported.root / "export" / layout, drafts)
    _train(exported.inp, tmp_path, init_from=str(drafts), epochs=1)
    start = _eval_loss_at(tmp_path / "metrics", 0)
    trained_end = exported.final["eval"]["loss"]
    random_start = _eval_loss_at(exported.root / "metrics", 0)
    assert start == pytest.approx(trained_end, rel=0.02), (start, trained_end)
    assert start < 0.8 * random_start, (start, random_start)
    m = json.loads((tmp_path / "metrics" / "metrics.json").read_text())
    assert m["init_from"] == {"path": str(drafts), "layout": layout,
                              "sha256": init_from.fingerprint(drafts), "vocab_map_equal": True}


def test_init_from_another_architecture_is_named_tensor_by_tensor(exported, tmp_path):
    drafts = tmp_path / "drafts" / "other"
    shutil.copytree(exported.root / "export" / "vllm", drafts)
    cfg = json.loads((drafts / "config.json").read_text())
    cfg["head_dim"] = 16
    (drafts / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(init_from.InitFromError) as e:
        _train(exported.inp, tmp_path, init_from=str(drafts))
    msg = str(e.value)
    assert "head_dim = 16 but params.yaml (configs/draft_config.json) gives 32" in msg, msg
    assert "midlayer.self_attn.q_proj.weight" in msg and "train.init_from" in msg, msg
    assert not (tmp_path / "train").exists()
