"""`eagle3pipe check`: the Kimi-K2.5 reference, corrupted checkpoints, hand edits, stale constants."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3pipe import arch as A
from eagle3pipe import check as C
from eagle3pipe import cli
from eagle3pipe import formats as R
from eagle3pipe import params as P
from eagle3pipe.checkpoint import check_checkpoint
from eagle3pipe.export import TORCH_DTYPE
from eagle3pipe.verifier import VerifierInfo, read_config

from conftest import ROOT

KIMI = ROOT / "examples/kimi-k2.5"


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def kimi_text(head_dim: int = 128) -> str:
    return (KIMI / "params.yaml").read_text().replace("  head_dim: 128", f"  head_dim: {head_dim}")


def kimi_arch(tmp_path: Path, head_dim: int = 128) -> A.DraftArch:
    f = tmp_path / "kimi.yaml"
    f.write_text(kimi_text(head_dim).replace("path: examples/", f"path: {ROOT}/examples/"))
    p = P.load(f)
    return A.derive(p.draft, VerifierInfo.from_config(KIMI / "verifier/config.json"))


# ---- Kimi-K2.5: the case that started the project


def test_kimi_renders_the_published_flat_config(tmp_path):
    f = tmp_path / "kimi.yaml"
    f.write_text(kimi_text().replace("path: examples/", f"path: {ROOT}/examples/"))
    rc, out, err = run_cli("check", "--params", f, "--no-configs", "--no-scan",
                           "--reference", KIMI / "reference.flat.config.json")
    assert rc == 0, err
    assert "check: OK" in out


def test_kimi_contract_shapes(tmp_path):
    c = A.contract(kimi_arch(tmp_path), "vllm", embed_tokens=True)
    assert c["midlayer.self_attn.q_proj.weight"].shape == (8192, 14336)
    assert c["midlayer.self_attn.o_proj.weight"].shape == (7168, 8192)
    assert c["fc.weight"].shape == (7168, 21504)
    assert c["lm_head.weight"].shape == (32000, 7168)
    assert c["d2t"].shape == (32000,) and c["t2d"].shape == (163840,)
    assert c["embed_tokens.weight"].shape == (163840, 7168)
    s = A.contract(kimi_arch(tmp_path), "speculators")
    assert s["layers.0.self_attn.q_proj.weight"].shape == (8192, 14336)
    assert "embed_tokens.weight" not in s


def test_kimi_head_dim_112_fails_reference_and_changes_contract(tmp_path):
    f = tmp_path / "kimi112.yaml"
    f.write_text(kimi_text(112).replace("path: examples/", f"path: {ROOT}/examples/"))
    rc, out, err = run_cli("check", "--params", f, "--no-configs", "--no-scan",
                           "--reference", KIMI / "reference.flat.config.json")
    assert rc == 1
    assert "head_dim: rendered 112, reference 128 (vLLM reads this field)" in err
    assert A.contract(kimi_arch(tmp_path, 112), "vllm")[
        "midlayer.self_attn.q_proj.weight"].shape == (7168, 14336)


# ---- checkpoints


MICRO_VERIFIER = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                  "num_hidden_layers": 4, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 3}


def micro_arch(tmp_path, **over) -> A.DraftArch:
    text = (ROOT / "params.yaml").read_text()
    text = text.replace("  head_dim: 128", f"  head_dim: {over.get('head_dim', 32)}")
    text = text.replace("  draft_vocab_size: 1024", "  draft_vocab_size: 64")
    text = text.replace("  num_attention_heads: 4\n  num_key_value_heads: 2",
                        "  num_attention_heads: 2\n  num_key_value_heads: 1")
    f = tmp_path / "micro.yaml"
    f.write_text(text)
    v = tmp_path / "vcfg.json"
    v.write_text(json.dumps(MICRO_VERIFIER))
    return A.derive(P.load(f).draft, VerifierInfo.from_config(v))


def write_checkpoint(d: Path, a: A.DraftArch, layout: str, *, drop=(), extra=None, shapes=None,
                     dtypes=None, d2t=None, config_arch: A.DraftArch | None = None) -> Path:
    """A real safetensors draft checkpoint built from the contract, then corrupted as asked."""
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, spec in A.contract(a, layout).items():
        shape = (shapes or {}).get(name, spec.shape)
        dt = TORCH_DTYPE[(dtypes or {}).get(name, spec.dtype)]
        tensors[name] = torch.zeros(shape, dtype=dt)
    marked = torch.arange(a.draft_vocab_size) * 2  # every other target id
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[marked] = True
    tensors["t2d"] = t2d
    tensors["d2t"] = (marked - torch.arange(a.draft_vocab_size)) if d2t is None else d2t
    for name in drop:
        tensors.pop(name)
    tensors.update(extra or {})
    save_file(tensors, str(d / "model.safetensors"))
    ca = config_arch or a
    cfg = R.flat_config(ca) if layout == "vllm" else R.speculators_config(
        ca, num_speculative_tokens=3, verifier_name_or_path="v", verifier_architectures=[])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_good_checkpoint_passes(tmp_path, layout):
    a = micro_arch(tmp_path)
    assert check_checkpoint(write_checkpoint(tmp_path / "ck", a, layout), a) == []


def test_head_dim_112_config_over_128_weights(tmp_path):
    """vLLM silently trims such weights; the check names the tensor and head_dim."""
    big, small = micro_arch(tmp_path, head_dim=48), micro_arch(tmp_path, head_dim=32)
    ck = write_checkpoint(tmp_path / "ck", big, "vllm", config_arch=small)
    problems = check_checkpoint(ck)
    q = [p for p in problems if "midlayer.self_attn.q_proj.weight" in p]
    assert q and "head_dim=32" in q[0] and "[96, 128]" in q[0] and "[64, 128]" in q[0]
    assert any("o_proj" in p for p in problems)


def test_missing_fc_weight(tmp_path):
    a = micro_arch(tmp_path)
    problems = check_checkpoint(write_checkpoint(tmp_path / "ck", a, "vllm", drop=["fc.weight"]))
    assert any("fc.weight missing" in p for p in problems), problems


def test_extra_and_wrong_layout_names(tmp_path):
    a = micro_arch(tmp_path)
    ck = write_checkpoint(tmp_path / "ck", a, "vllm",
                          extra={"layers.0.hidden_norm.weight": torch.zeros(64, dtype=torch.bfloat16),
                                 "verifier_lm_head.weight": torch.zeros(2, 2)})
    problems = check_checkpoint(ck)
    assert any("unexpected tensor layers.0.hidden_norm.weight (a speculators-layout name" in p
               for p in problems), problems
    assert any("unexpected tensor verifier_lm_head.weight" in p for p in problems)


def test_wrong_dtype(tmp_path):
    a = micro_arch(tmp_path)
    ck = write_checkpoint(tmp_path / "ck", a, "vllm", dtypes={"norm.weight": "F32"})
    assert any("norm.weight has dtype F32, expected BF16" in p for p in check_checkpoint(ck))


def test_fc_input_not_three_target_hidden(tmp_path):
    a = micro_arch(tmp_path)
    ck = write_checkpoint(tmp_path / "ck", a, "vllm", shapes={"fc.weight": (64, 256)})
    problems = check_checkpoint(ck)
    assert any("fc.weight has shape [64, 256]" in p and "3 aux layers" in p for p in problems)


def test_all_zero_d2t_is_wrong_unless_t2d_marks_the_first_ids(tmp_path):
    a = micro_arch(tmp_path)
    ck = write_checkpoint(tmp_path / "ck", a, "vllm", d2t=torch.zeros(64, dtype=torch.int64))
    problems = check_checkpoint(ck)
    assert any("d2t is not consistent with t2d" in p and "draft id 1" in p for p in problems)
    # an all-zero d2t is right exactly when t2d marks ids 0..draft_vocab-1
    ok = tmp_path / "ok"
    write_checkpoint(ok, a, "vllm")
    from safetensors.torch import load_file
    t = load_file(str(ok / "model.safetensors"))
    t["d2t"] = torch.zeros(64, dtype=torch.int64)
    t["t2d"] = torch.zeros(512, dtype=torch.bool)
    t["t2d"][:64] = True
    save_file(t, str(ok / "model.safetensors"))
    assert check_checkpoint(ok) == []


def test_config_vs_params_mismatch(tmp_path):
    a112, a128 = micro_arch(tmp_path, head_dim=48), micro_arch(tmp_path, head_dim=32)
    ck = write_checkpoint(tmp_path / "ck", a112, "vllm")
    problems = check_checkpoint(ck, a128)
    assert any("head_dim = 48 but params.yaml gives 32" in p for p in problems), problems
    # the weights are checked against params' architecture too, naming the field
    assert any("q_proj.weight has shape [96, 128] but params.yaml needs [64, 128] "
               "(head_dim=32 x num_attention_heads=2 = 64)" in p for p in problems), problems
    assert check_checkpoint(ck, a112) == []


def test_config_without_head_dim(tmp_path):
    a = micro_arch(tmp_path)
    ck = write_checkpoint(tmp_path / "ck", a, "vllm")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["head_dim"]
    (ck / "config.json").write_text(json.dumps(cfg))
    problems = check_checkpoint(ck)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{ck / 'config.json'}: missing keys ['head_dim']")


# ---- derived configs on disk


def _repo_with_configs(tmp_path) -> Path:
    v = tmp_path / "verifier.json"
    v.write_text(json.dumps({**MICRO_VERIFIER, "hidden_size": 256, "vocab_size": 4096}))
    rc, _, err = run_cli("render", "--params", ROOT / "params.yaml", "--verifier-config", v,
                         "--out", tmp_path / "configs")
    assert rc == 0, err
    return v


def test_hand_edited_config_is_reported(tmp_path):
    v = _repo_with_configs(tmp_path)
    base = ["check", "--params", ROOT / "params.yaml", "--verifier-config", v,
            "--configs", tmp_path / "configs", "--no-scan"]
    assert run_cli(*base)[0] == 0
    f = tmp_path / "configs/vllm/config.json"
    f.write_text(f.read_text().replace('"head_dim": 128', '"head_dim": 112'))
    rc, out, err = run_cli(*base)
    assert rc == 1
    assert f"{f}: differs from what params.yaml renders (head_dim: on disk 112, params.yaml " \
           "renders 128)" in err


def test_cli_checks_a_checkpoint_against_params(tmp_path):
    """`eagle3pipe check --checkpoint`: the contract of the checkpoint's own config and the
    architecture params.yaml derives (here for another head_dim than the checkpoint's)."""
    from dataclasses import replace

    v = _repo_with_configs(tmp_path)
    a = A.derive(P.load(ROOT / "params.yaml").draft, VerifierInfo.from_config(v))
    base = ["check", "--params", ROOT / "params.yaml", "--verifier-config", v,
            "--configs", tmp_path / "configs", "--no-scan"]
    rc, out, err = run_cli(*base, "--checkpoint", write_checkpoint(tmp_path / "good", a, "vllm"))
    assert rc == 0 and "check: OK" in out, err
    bad = write_checkpoint(tmp_path / "bad", replace(a, head_dim=64), "speculators")
    rc, out, err = run_cli(*base, "--checkpoint", bad)
    assert rc == 1
    assert f"{bad / 'config.json'}: head_dim = 64 but {ROOT / 'params.yaml'} gives 128" in err
    assert "layers.0.self_attn.q_proj.weight has shape [256, 512] but " \
           f"{ROOT / 'params.yaml'} needs [512, 512]" in err


def test_render_is_byte_identical_and_idempotent(tmp_path):
    v = _repo_with_configs(tmp_path)
    first = {p: p.read_bytes() for p in (tmp_path / "configs").rglob("*.json")}
    rc, out, _ = run_cli("render", "--params", ROOT / "params.yaml", "--verifier-config", v,
                         "--out", tmp_path / "configs")
    assert rc == 0 and "written" not in out
    assert first == {p: p.read_bytes() for p in (tmp_path / "configs").rglob("*.json")}


def test_make_check_names_hand_edit(tmp_path):
    """`make check` on a clone whose committed config was edited by hand fails naming it."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    f = repo / "configs/draft_config.json"
    if not f.exists():
        pytest.skip("configs/ not committed yet")
    f.write_text(f.read_text().replace('"head_dim": 128', '"head_dim": 112'))
    import os
    import sys
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(repo / "src")}
    r = subprocess.run(["make", "-s", "check", "SKIP_SETUP=1"], cwd=repo, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "configs/draft_config.json: differs from what params.yaml renders (head_dim" in r.stderr


# ---- hand-written constants


def test_scan_finds_stale_constants(tmp_path):
    repo = tmp_path / "r"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts/old.py").write_text("x = 1\nhead_dim = 112  # 7168 / 64\n")
    (repo / "draft_config.json").write_text('{\n  "head_dim": 112,\n  "hidden_size": 256\n}\n')
    (repo / "ok.py").write_text("head_dim = 128\n")
    (repo / "configs").mkdir()
    (repo / "configs/x.json").write_text('{"head_dim": 112}')  # generated: exempt
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    params = P.load(ROOT / "params.yaml")
    problems = C.scan_constants(repo, params, {"hidden_size": 256, "vocab_size": 4096})
    assert any(p.startswith("scripts/old.py:2: head_dim = 112") for p in problems), problems
    assert any(p.startswith("draft_config.json:2: head_dim = 112") for p in problems)
    assert not any("ok.py" in p or "configs/" in p or "hidden_size" in p for p in problems)


def test_repository_has_no_stale_constants():
    params = P.load(ROOT / "params.yaml")
    vcfg = read_config(ROOT / "configs/verifier_config.json")[1] \
        if (ROOT / "configs/verifier_config.json").exists() else None
    assert C.scan_constants(ROOT, params, vcfg) == []
