"""The export stage: both formats from one trained checkpoint (real speculators training, real
safetensors), each contract-checked; speculators' own converter round-trips the flat export bit
for bit; a checkpoint trained for another head_dim is refused."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3pipe.draft import arch as archmod
from eagle3pipe.stages.export import run as exportmod
from eagle3pipe.draft import formats
from eagle3pipe.stages.train import run as trainmod
from eagle3pipe.draft.checkpoint import check_checkpoint
from eagle3pipe.verifier.handle import read_config

from helpers.training import MICRO_TRAIN, draft_arch, make_inputs, write_draft_config

pytestmark = pytest.mark.integration  # every test reads a trained, exported micro draft

ROOT = Path(__file__).resolve().parents[1]


def render_configs(verifier: Path, out: Path, **overrides) -> archmod.DraftArch:
    """configs/speculators/config.json and configs/vllm/config.json as the configs stage
    renders them (formats.render, embedded-verifier mode)."""
    a = draft_arch(verifier, **overrides)
    files = formats.render(a, verifier_config=read_config(verifier)[0], verifier_path=None,
                           num_speculative_tokens=3)
    formats.write(files, out)
    return a


def train_briefly(inp, out: Path, metrics: Path) -> None:
    p = types.SimpleNamespace(**{**MICRO_TRAIN, "epochs": 1})
    trainmod.train(p, inp.draft_config, inp.verifier, inp.hidden, inp.vocab, out,
                   metrics_dir=metrics, progress=False, max_steps=2)


@pytest.fixture(scope="module")
def exported(micro_verifier, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    inp = make_inputs(micro_verifier, root / "inputs", n_train=8, n_eval=2)
    train_briefly(inp, root / "train", root / "metrics")
    a = render_configs(micro_verifier, root / "configs")
    summary = exportmod.export(root / "train", root / "configs/speculators/config.json",
                               root / "configs/vllm/config.json", micro_verifier,
                               root / "export")
    return types.SimpleNamespace(root=root, inputs=inp, arch=a, summary=summary,
                                 verifier=micro_verifier)


def test_both_exports_pass_the_contract_check(exported):
    ex = exported.root / "export"
    assert sorted(p.name for p in ex.iterdir()) == ["speculators", "vllm"]
    for fmt in ("speculators", "vllm"):
        d = ex / fmt
        assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
        assert check_checkpoint(d, exported.arch) == []
        # the configs are the configs/ files, byte for byte: drift is impossible
        assert (d / "config.json").read_bytes() == \
            (exported.root / "configs" / fmt / "config.json").read_bytes()
        t = load_file(str(d / "model.safetensors"))
        spec = archmod.contract(exported.arch, fmt)
        assert sorted(t) == sorted(spec)
        assert "embed_tokens.weight" not in t
        assert t["fc.weight"].dtype == torch.bfloat16  # params' draft.dtype
    flat = load_file(str(ex / "vllm" / "model.safetensors"))
    assert any(n.startswith("midlayer.") for n in flat)
    assert not any(n.startswith("layers.") for n in flat)
    # values are the trained float32 weights cast to bf16, renamed
    trained = load_file(str(exported.root / "train" / "model.safetensors"))
    for name, tensor in flat.items():
        src = trained[archmod.rename(name, "vllm", "speculators")]
        assert torch.equal(tensor, src.to(tensor.dtype)), name
    assert torch.equal(torch.arange(len(flat["d2t"])) + flat["d2t"],
                       torch.nonzero(flat["t2d"]).flatten())
    assert exported.summary["vllm"]["tensors"] == len(flat)


def test_speculators_convert_roundtrips_the_flat_export_bit_for_bit(exported, tmp_path):
    ex = exported.root / "export"
    problems = exportmod.speculators_roundtrip(ex / "vllm", ex / "speculators",
                                               exported.verifier, tmp_path / "converted")
    assert problems == []
    # and the converted config kept what the converter drops unless passed explicitly
    cfg = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(exported.arch.aux_layer_ids)
    assert cfg["norm_before_residual"] is exported.arch.norm_before_residual
    assert cfg["transformer_layer_config"]["head_dim"] == exported.arch.head_dim


def test_roundtrip_notices_a_changed_tensor(exported, tmp_path):
    """Negative control: the comparison is real (one flipped bit is reported)."""
    import shutil

    from safetensors.torch import save_file

    ex = exported.root / "export"
    spec = tmp_path / "spec"
    shutil.copytree(ex / "speculators", spec)
    t = load_file(str(spec / "model.safetensors"))
    w = t["norm.weight"].view(torch.int16).clone()
    w[0] ^= 1
    t["norm.weight"] = w.view(torch.bfloat16)
    save_file(t, str(spec / "model.safetensors"))
    problems = exportmod.speculators_roundtrip(ex / "vllm", spec, exported.verifier,
                                               tmp_path / "converted")
    assert problems == ["norm.weight: values differ"]


def test_a_checkpoint_trained_with_another_head_dim_is_rejected(exported, tmp_path):
    root = exported.root
    # train a draft with head_dim 16 (what hidden/heads would derive) on the same data ...
    other_cfg = tmp_path / "draft_config.json"
    write_draft_config(exported.verifier, other_cfg, head_dim=16)
    inp = types.SimpleNamespace(**{**vars(exported.inputs), "draft_config": other_cfg})
    train_briefly(inp, tmp_path / "train16", tmp_path / "metrics16")
    # ... and export it with the head_dim 32 configs: refused, nothing replaced
    out = tmp_path / "export"
    out.mkdir()
    (out / "sentinel").write_text("old export")
    with pytest.raises(exportmod.ExportError) as e:
        exportmod.export(tmp_path / "train16", root / "configs/speculators/config.json",
                         root / "configs/vllm/config.json", exported.verifier, out)
    msg = str(e.value)
    vllm_config = root / "configs/vllm/config.json"
    assert f"head_dim = 16 but {vllm_config} gives 32" in msg
    assert (f"tensor layers.0.self_attn.q_proj.weight has shape [64, 128] but {vllm_config} "
            "needs [128, 128] (head_dim=32 x num_attention_heads=4 = 128)") in msg
    assert "k_proj" in msg and "o_proj" in msg
    assert (out / "sentinel").read_text() == "old export"


def test_a_checkpoint_trained_with_other_aux_ids_is_rejected(exported, tmp_path):
    """Same shapes, other semantics: the trained config's aux ids differ from the configs'."""
    import shutil

    ckpt = tmp_path / "train"
    shutil.copytree(exported.root / "train", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(exportmod.ExportError, match=r"aux_layer_ids = \[0, 1, 2\] but "
                                                    r".*vllm/config.json gives \[1, 2, 3\]"):
        exportmod.export(ckpt, exported.root / "configs/speculators/config.json",
                         exported.root / "configs/vllm/config.json", exported.verifier,
                         tmp_path / "export")


def test_a_missing_field_is_refused_not_defaulted(exported, tmp_path):
    """What the old parser invented (rms eps 1e-6, rope_theta 10000) is now an error naming the
    file and the key, in the trained checkpoint's config and in configs/ alike."""
    import shutil

    from eagle3pipe.draft.parsing import ConfigError

    ckpt = tmp_path / "train"
    shutil.copytree(exported.root / "train", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["transformer_layer_config"]["rms_norm_eps"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(exportmod.ExportError) as e:
        exportmod.export(ckpt, exported.root / "configs/speculators/config.json",
                         exported.root / "configs/vllm/config.json", exported.verifier,
                         tmp_path / "export")
    assert f"{ckpt / 'config.json'}: missing keys ['transformer_layer_config.rms_norm_eps']" \
        in str(e.value)
    flat = tmp_path / "vllm.json"
    cfg = json.loads((exported.root / "configs/vllm/config.json").read_text())
    del cfg["rope_theta"]
    flat.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"^{flat}: missing keys \['rope_theta'\]; "
                                          r"regenerate it with `dvc repro configs`"):
        exportmod.export(exported.root / "train",
                         exported.root / "configs/speculators/config.json", flat,
                         exported.verifier, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_configs_that_disagree_are_rejected(exported, tmp_path):
    """The two configs come from one render; a stale one (another head_dim) is refused."""
    render_configs(exported.verifier, tmp_path / "configs", head_dim=16)
    with pytest.raises(exportmod.ExportError, match="disagree on head_dim"):
        exportmod.export(exported.root / "train",
                         exported.root / "configs/speculators/config.json",
                         tmp_path / "configs/vllm/config.json", exported.verifier,
                         tmp_path / "export")


def test_stage_script(exported, tmp_path):
    from eagle3pipe.errors import EXIT_INPUT

    root = exported.root

    def cmd(checkpoint: Path, out: Path) -> list[str]:
        return [sys.executable, str(ROOT / "stages" / "export.py"),
                "--params", str(ROOT / "params.yaml"), "--dvc-yaml", str(ROOT / "dvc.yaml"),
                "--checkpoint", str(checkpoint),
                "--speculators-config", str(root / "configs/speculators/config.json"),
                "--vllm-config", str(root / "configs/vllm/config.json"),
                "--verifier", str(exported.verifier), "--out", str(out)]

    r = subprocess.run(cmd(root / "train", tmp_path / "export"), capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    for fmt in ("speculators", "vllm"):
        # deterministic: the stage writes the same bytes as the fixture's export
        for name in ("config.json", "model.safetensors"):
            assert (tmp_path / "export" / fmt / name).read_bytes() == \
                (root / "export" / fmt / name).read_bytes()
    bad = subprocess.run(cmd(tmp_path / "nowhere", tmp_path / "x"), capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert bad.returncode == EXIT_INPUT and "run `dvc repro train`" in bad.stderr, bad.stderr
    assert not (tmp_path / "x").exists()
