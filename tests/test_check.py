"""`eagle3pipe check`: the Kimi-K2.5 reference (and copies of it missing fields), the configs
speculators' training CLI writes, corrupted and non-finite checkpoints, hand edits, stale
architecture and serving values in every file kind."""
from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3pipe.draft import arch as A
from eagle3pipe.tools import check as C
from eagle3pipe.tools import scan as S
from eagle3pipe.tools import cli
from eagle3pipe.draft import formats as R
from eagle3pipe.stages.configs import run as configs
from eagle3pipe.config import params as P
from eagle3pipe.draft.checkpoint import check_checkpoint
from eagle3pipe.stages.export.run import TORCH_DTYPE
from eagle3pipe.verifier.handle import VerifierInfo

from helpers.malformed import CORRUPT
from helpers.micro import DATA_PARAMS, ROOT

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


# ---- speculators' training CLI: the config it writes with its defaults (EAGLE-3.1's
# norm_before_fc + norm_output; a Llama or a Qwen3 layer), in speculators' layout

CLI = ROOT / "examples/speculators-cli"
WINDOW = {"layer_types", "sliding_window"}  # the CLI's drafts attend through a 2048 window


def cli_check(tmp_path, ref: str | Path, **sets) -> tuple[int, str, list[str]]:
    """`eagle3pipe check --reference` with the example's params, `draft.` keys replaced; the
    fields whose difference is a problem."""
    text = (CLI / "params.yaml").read_text()
    for key, value in sets.items():
        text, n = re.subn(rf"(?m)^(  {key}:) \S+", rf"\1 {value}", text)
        assert n == 1, key
    f = tmp_path / "params.yaml"
    f.write_text(text)
    rc, out, err = run_cli("check", "--params", f, "--no-configs", "--no-scan",
                           "--verifier-config", ROOT / "configs/verifier_config.json",
                           "--reference", CLI / ref if isinstance(ref, str) else ref)
    assert "Traceback" not in out + err
    return rc, out, re.findall(r"\.json: ([\w.]+): rendered", err)


@pytest.mark.parametrize("layer", ["llama", "qwen3"])
def test_speculators_cli_reference_differs_only_in_its_window(tmp_path, layer):
    rc, out, problems = cli_check(tmp_path, f"{layer}.config.json", draft_arch=layer)
    assert rc == 1 and set(problems) == WINDOW, problems
    assert "against the rendered speculators/config.json" in out
    for field in ("norm_before_fc", "norm_output", "fc_norm", "norm_before_residual"):
        row = next(line for line in out.splitlines() if f"vLLM reads {field} " in line)
        assert not row.startswith("  !!"), row
    arch = "Eagle3Qwen3ForCausalLM" if layer == "qwen3" else "Eagle3LlamaForCausalLM"
    assert f"ours=['{arch}']" in out and f"reference=['{arch}']" in out


@pytest.mark.parametrize("sets,named", [
    ({"norm_output": "false"}, {"norm_output"}),
    ({"norm_before_fc": "false", "fc_norm": "true"}, {"norm_before_fc", "fc_norm"}),
    ({"norm_before_fc": "false"}, {"norm_before_fc"}),
    ({"draft_arch": "qwen3"}, {"architectures", "model_type"}),
])
def test_speculators_cli_reference_names_a_flipped_switch(tmp_path, sets, named):
    rc, _, problems = cli_check(tmp_path, "llama.config.json", **sets)
    assert rc == 1 and set(problems) == WINDOW | named, problems


def test_speculators_layout_omitting_norm_before_residual_is_true_to_vllm(tmp_path):
    """vLLM's speculators path reads an absent norm_before_residual as true, its flat path as
    false (formats.VLLM_READS): the same omission, compared as what each path uses."""
    ref = json.loads((CLI / "llama.config.json").read_text())
    del ref["norm_before_residual"]
    f = tmp_path / "ref.json"
    f.write_text(json.dumps(ref))
    assert set(cli_check(tmp_path, f)[2]) == WINDOW
    rc, _, problems = cli_check(tmp_path, f, norm_before_residual="false")
    assert set(problems) == WINDOW | {"norm_before_residual"}, problems


# ---- checkpoints


MICRO_VERIFIER = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                  "num_hidden_layers": 4, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 3}


def micro_arch(tmp_path, **over) -> A.DraftArch:
    text = (DATA_PARAMS).read_text()
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
    rc, _, err = run_cli("render", "--params", DATA_PARAMS, "--verifier-config", v,
                         "--out", tmp_path / "configs")
    assert rc == 0, err
    return v


def test_hand_edited_config_is_reported(tmp_path):
    v = _repo_with_configs(tmp_path)
    base = ["check", "--params", DATA_PARAMS, "--verifier-config", v,
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
    a = A.derive(P.load(DATA_PARAMS).draft, VerifierInfo.from_config(v))
    base = ["check", "--params", DATA_PARAMS, "--verifier-config", v,
            "--configs", tmp_path / "configs", "--no-scan"]
    rc, out, err = run_cli(*base, "--checkpoint", write_checkpoint(tmp_path / "good", a, "vllm"))
    assert rc == 0 and "check: OK" in out, err
    bad = write_checkpoint(tmp_path / "bad", replace(a, head_dim=64), "speculators")
    rc, out, err = run_cli(*base, "--checkpoint", bad)
    assert rc == 1
    assert f"{bad / 'config.json'}: head_dim = 64 but {DATA_PARAMS} gives 128" in err
    assert "layers.0.self_attn.q_proj.weight has shape [256, 512] but " \
           f"{DATA_PARAMS} needs [512, 512]" in err


def test_render_is_byte_identical_and_idempotent(tmp_path):
    v = _repo_with_configs(tmp_path)
    first = {p: p.read_bytes() for p in (tmp_path / "configs").rglob("*.json")}
    rc, out, _ = run_cli("render", "--params", DATA_PARAMS, "--verifier-config", v,
                         "--out", tmp_path / "configs")
    assert rc == 0 and "written" not in out
    assert first == {p: p.read_bytes() for p in (tmp_path / "configs").rglob("*.json")}


@pytest.mark.integration
def test_make_check_names_hand_edit(tmp_path):
    """`make check` on a clone whose committed config was edited by hand fails naming it."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    f = repo / "configs/draft_config.json"
    if not f.exists():
        pytest.skip("configs/ not committed yet")
    text = f.read_text()
    assert '"head_dim": 112' not in text
    f.write_text(re.sub(r'"head_dim": \d+', '"head_dim": 112', text))
    import os
    import sys
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(repo / "src")}
    r = subprocess.run(["make", "-s", "check", "SKIP_SETUP=1"], cwd=repo, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "configs/draft_config.json: differs from what params.yaml renders (head_dim" in r.stderr


# ---- malformed checkpoints: every tensor finite, every file readable (through the CLI)


VCFG = ROOT / "tests/data/verifier_config.json"


def cli_checkpoint(ck: Path) -> tuple[int, str, str]:
    """`eagle3pipe check --checkpoint ck` against params.yaml (verifier: tests/data's)."""
    rc, out, err = run_cli("check", "--params", DATA_PARAMS, "--verifier-config", VCFG,
                           "--no-configs", "--no-scan", "--checkpoint", ck)
    assert "Traceback" not in out + err
    return rc, out, err


def params_arch() -> A.DraftArch:
    return A.derive(P.load(DATA_PARAMS).draft, VerifierInfo.from_config(VCFG))


def rewrite(ck: Path, **change) -> None:
    """Rewrites model.safetensors with `change` ({tensor: function of the tensor})."""
    from safetensors.torch import load_file
    t = load_file(str(ck / "model.safetensors"))
    save_file({k: change.get(k, lambda x: x)(v) for k, v in t.items()},
              str(ck / "model.safetensors"))


def test_non_finite_in_a_second_file_names_that_file(tmp_path, monkeypatch):
    """A sharded checkpoint: the NaN's file is named; tensors are read in slices (a slice size
    of one row here) so the last row's NaN is found."""
    from eagle3pipe.draft import checkpoint as CK
    monkeypatch.setattr(CK, "CHUNK_BYTES", 1)
    a = params_arch()
    ck = write_checkpoint(tmp_path / "ck", a, "vllm")
    from safetensors.torch import load_file
    t = load_file(str(ck / "model.safetensors"))
    fc = t.pop("fc.weight").clone()
    fc[-1, -1] = float("nan")
    save_file(t, str(ck / "model-00001-of-00002.safetensors"))
    save_file({"fc.weight": fc}, str(ck / "model-00002-of-00002.safetensors"))
    (ck / "model.safetensors").unlink()
    problems = check_checkpoint(ck, a)
    assert problems == [f"{ck / 'model-00002-of-00002.safetensors'}: tensor fc.weight has 1 "
                        f"non-finite values of {fc.numel()} (1 NaN, 0 Inf); vLLM loads it "
                        "without an error and the draft proposes garbage: retrain (did the "
                        "loss diverge?) or export again"], problems


def test_finite_checkpoint_and_integer_maps_pass(tmp_path):
    a = params_arch()
    rc, out, err = cli_checkpoint(write_checkpoint(tmp_path / "ck", a, "vllm"))
    assert rc == 0 and "check: OK" in out, err


# malformed draft checkpoints: the cases (CORRUPT, damages to a good checkpoint) are
# helpers/malformed.py's


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_malformed_checkpoint_is_named_and_nothing_written(tmp_path, case):
    """`eagle3pipe check --checkpoint`: the file and the tensor (or config key) named, exit 1,
    no traceback (cli_checkpoint), and the check writes nothing."""
    from dataclasses import replace

    _, layout, dtype, damage, want = case
    ck = write_checkpoint(tmp_path / "ck", replace(params_arch(), dtype=dtype), layout)
    damage(ck)
    before = _tree(tmp_path)
    rc, out, err = cli_checkpoint(ck)
    assert rc == 1, out + err
    want = want.format(st=ck / "model.safetensors", ck=ck, cfg=ck / "config.json",
                       params=DATA_PARAMS)
    assert want in err, err
    assert _tree(tmp_path) == before


# ---- a published config that omits fields: compared as the value vLLM then uses


def kimi_reference(tmp_path, drop=(), **add) -> Path:
    ref = json.loads((KIMI / "reference.flat.config.json").read_text())
    for key in drop:
        d = ref
        *parents, leaf = key.split(".")
        for p in parents:
            d = d[p]
        del d[leaf]
    ref.update(add)
    f = tmp_path / "reference.json"
    f.write_text(json.dumps(ref, indent=2))
    return f


def kimi_check(tmp_path, ref: Path, params_text: str | None = None) -> tuple[int, str, str]:
    f = tmp_path / "kimi.yaml"
    f.write_text((params_text or kimi_text()).replace("path: examples/", f"path: {ROOT}/examples/"))
    rc, out, err = run_cli("check", "--params", f, "--no-configs", "--no-scan", "--reference", ref)
    assert "Traceback" not in out + err
    return rc, out, err


def test_reference_without_aux_ids_states_vllms_fallback(tmp_path):
    """Kimi-K2.5's verifier has 61 layers: vLLM falls back to (2, 30, 58), which is ours."""
    ref = kimi_reference(tmp_path, drop=[C.AUX])
    rc, out, err = kimi_check(tmp_path, ref)
    assert rc == 0, err
    row = next(line for line in out.splitlines() if C.AUX in line)
    assert "ours=[2, 30, 58]" in row and "reference omits it: vLLM uses (2, 30, 58)" in row
    assert "(2, L // 2, L - 3) for the verifier's L = 61 layers" in row


def test_reference_without_aux_ids_differing_from_ours(tmp_path):
    ref = kimi_reference(tmp_path, drop=[C.AUX])
    rc, _, err = kimi_check(tmp_path, ref, kimi_text().replace("[2, 30, 58]", "[2, 31, 58]"))
    assert rc == 1
    assert f"{ref}: {C.AUX}: rendered [2, 31, 58], reference omits it: vLLM then uses " \
           "(2, 30, 58)" in err, err


def test_reference_top_level_aux_ids_are_what_vllm_reads(tmp_path):
    ref = kimi_reference(tmp_path, drop=[C.AUX], eagle_aux_hidden_state_layer_ids=[1, 30, 58])
    rc, _, err = kimi_check(tmp_path, ref)
    assert rc == 1 and "vLLM then uses (1, 30, 58) (its top-level" in err, err


def test_reference_without_head_dim_is_the_original_bug(tmp_path):
    """A published config without head_dim: vLLM derives 7168 / 64 = 112, not our 128."""
    rc, _, err = kimi_check(tmp_path, kimi_reference(tmp_path, drop=["head_dim"]))
    assert rc == 1
    assert "head_dim: rendered 128, reference omits it: vLLM then uses 112 " \
           "(hidden_size // num_attention_heads" in err, err


@pytest.mark.parametrize("field,fallback", [
    ("rope_theta", "10000.0"), ("draft_vocab_size", "163840"), ("num_key_value_heads", None)])
def test_reference_omitting_other_fields(tmp_path, field, fallback):
    rc, out, err = kimi_check(tmp_path, kimi_reference(tmp_path, drop=[field]))
    if fallback is None:  # 64 kv heads = 64 heads: the fallback equals ours
        assert rc == 0 and "reference omits it: vLLM uses 64" in out, err
    else:
        assert rc == 1 and f"{field}: rendered" in err and \
            f"reference omits it: vLLM then uses {fallback}" in err, err


def test_every_field_vllm_reads_has_a_stated_fallback():
    empty = {}
    for key in R.VLLM_READS:
        value, source = C.vllm_uses(key, empty, 61)
        assert (value == C.ABSENT) == (key in ("architectures", "model_type")), (key, value)
        assert source
    assert C.vllm_uses(C.AUX, empty, 61)[0] == (2, 30, 58)
    assert C.vllm_uses(C.AUX, empty, 4)[0] == (2, 2, 1)


def test_reference_not_json(tmp_path):
    f = tmp_path / "ref.json"
    f.write_text("{\n  \"head_dim\": 128,\n")
    rc, out, err = kimi_check(tmp_path, f)
    assert rc == 2 and f"{f}:3: invalid JSON" in err, err


# ---- hand-written architecture and serving values


def git_repo(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def cli_scan(repo: Path) -> tuple[int, str, str]:
    rc, out, err = run_cli("check", "--params", DATA_PARAMS, "--verifier-config", VCFG,
                           "--no-configs", "--root", repo)
    assert "Traceback" not in out + err
    return rc, out, err


def notebook(*cells: tuple[str, list[str]]) -> str:
    return json.dumps({"cells": [{"cell_type": kind, "metadata": {}, "source": src}
                                 for kind, src in cells], "metadata": {}, "nbformat": 4,
                       "nbformat_minor": 5}, indent=1)


# (file, text, what the problem starts with): params.yaml says k = 3, head_dim 128, aux ids
# [1, 2, 3], norm_before_residual true, rope_theta 1e4, eps 1e-6, draft vocab 1024, bfloat16
STALE = [
    ("serve.sh", "#!/bin/sh\nvllm serve m \\\n  --speculative-config "
     "'{\"method\":\"eagle3\",\"num_speculative_tokens\":5}'\n",
     "serve.sh:3: num_speculative_tokens = 5"),
    ("serve.sh", "vllm serve m --head-dim 96 --port 8000\n",
     "serve.sh:1: --head-dim (head_dim) = 96"),
    ("scripts/run.sh", "python train.py --head_dim=96\n",
     "scripts/run.sh:1: --head_dim (head_dim) = 96"),
    ("launch", "#!/usr/bin/env bash\nARGS=\"{\\\"method\\\": \\\"eagle3\\\", "
     "\\\"num_speculative_tokens\\\": 4}\"\n", "launch:2: num_speculative_tokens = 4"),
    ("README.md", "# x\n\nProse --num-speculative-tokens 9 is not a command.\n\n```bash\n"
     "vllm serve m --num-speculative-tokens 5\n```\n",
     "README.md:6: --num-speculative-tokens (num_speculative_tokens) = 5"),
    ("docs/serve.md", "Run:\n\n~~~\nHEAD_DIM=96 python serve.py\n~~~\n",
     "docs/serve.md:4: HEAD_DIM (head_dim) = 96"),
    ("demo.ipynb", notebook(("markdown", ["head_dim = 112 in prose\n"]),
                            ("code", ["import x\n", "cfg = dict(head_dim=112)\n"])),
     "demo.ipynb (cell 2):2: head_dim = 112"),
    ("draft.py", "aux_layer_ids = [2, 30, 58]\n", "draft.py:1: aux_layer_ids = [2, 30, 58]"),
    ("cfg.json", '{\n  "eagle_config": {\n    "eagle_aux_hidden_state_layer_ids": [\n      1,\n'
     '      2,\n      4\n    ]\n  }\n}\n',
     "cfg.json:3: eagle_aux_hidden_state_layer_ids (aux_layer_ids) = [1, 2, 4]"),
    ("conf/draft.yaml", "draft:\n  aux_layer_ids:\n    - 1\n    - 2\n    - 5\n",
     "conf/draft.yaml:2: aux_layer_ids = [1, 2, 5]"),
    ("run.sh", "python capture.py --aux-layer-ids 1 2 4\n",
     "run.sh:1: --aux-layer-ids (aux_layer_ids) = [1, 2, 4]"),
    ("conf/draft.yaml", "norm_before_residual: false\n",
     "conf/draft.yaml:1: norm_before_residual = False"),
    ("model.py", "ROPE = dict(rope_theta=1e6)\n", "model.py:1: rope_theta = 1000000.0"),
    ("cfg.json", '{"rms_norm_eps": 1e-08}', "cfg.json:1: rms_norm_eps = 1e-08"),
    ("conf/v.yml", "draft_vocab_size: 32000\n", "conf/v.yml:1: draft_vocab_size = 32000"),
    ("cfg.json", '{"vocab_size": 4096, "torch_dtype": "float16"}',
     "cfg.json:1: torch_dtype (dtype) = 'float16'"),
    ("serve.sh", "vllm serve m --dtype float16\n", "serve.sh:1: --dtype (dtype) = 'float16'"),
    ("model.py", "def build(head_dim: int = 112):\n    pass\n", "model.py:1: head_dim = 112"),
    ("model.py", "x = 1\nhead_dim = 7168 // 64\n", "model.py:2: head_dim = 112"),
    ("spec.yaml", "proposal_methods:\n  - proposal_type: greedy\n    speculative_tokens: 5\n",
     "spec.yaml:3: speculative_tokens (num_speculative_tokens) = 5"),
    ("Makefile", "serve:\n\tvllm serve m --num-speculative-tokens=7\n",
     "Makefile:2: --num-speculative-tokens (num_speculative_tokens) = 7"),
    ("bench/b.py", "head_dim = 112\n", "bench/b.py:1: head_dim = 112"),
    ("serve.py", 'ap.add_argument("--head-dim", type=int, default=96)\n',
     "serve.py:1: --head-dim (head_dim) = 96"),
    ("cfg.json", '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}',
     "cfg.json:1: rope_scaling = an object"),
    ("cfg.json", '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}',
     "cfg.json:1: rope_type = 'yarn'"),
    ("hf.py", "cfg.headDim = 96\n", "hf.py:1: headDim (head_dim) = 96"),
    ("hf.py", 'config["head_dim"] = 96\n', "hf.py:1: head_dim = 96"),
    ("Dockerfile", "FROM x\nENV HEAD_DIM=96\n", "Dockerfile:2: HEAD_DIM (head_dim) = 96"),
    ("pyproject.toml", "[tool.draft]\nnum_key_value_heads = 8\n",
     "pyproject.toml:2: num_key_value_heads = 8"),
    ("bad.ipynb", "{\n  not json\n", "bad.ipynb:2: not a valid notebook"),
]


@pytest.mark.parametrize("rel,text,problem", STALE, ids=[f"{i}-{c[0]}" for i, c in
                                                         enumerate(STALE)])
def test_scan_names_file_line_and_key(tmp_path, rel, text, problem):
    rc, out, err = cli_scan(git_repo(tmp_path / "repo", {rel: text}))
    assert rc == 1
    found = [line.strip()[2:] for line in err.splitlines() if line.startswith("  - ")]
    assert any(f.startswith(problem) for f in found), err
    if "not a valid notebook" not in problem:
        assert all("params and the rendered configs say" in f and "fix: " in f for f in found)


def test_scan_message_names_params_value_and_fix(tmp_path):
    rc, _, err = cli_scan(git_repo(tmp_path / "repo", {"serve.sh": "vllm serve m "
                                                       "--num-speculative-tokens 5\n"}))
    assert rc == 1
    assert "serve.sh:1: --num-speculative-tokens (num_speculative_tokens) = 5 written by hand, " \
           f"but params and the rendered configs say 3 ({DATA_PARAMS} " \
           "draft.num_speculative_tokens); fix: derive it from params.yaml or read it from " \
           "configs/; a deliberate difference gets a `check: ignore` comment" in err, err


CLEAN = {
    "tpl.sh": "vllm serve m --dtype \"${DTYPE}\" --head-dim \"$HD\"\n",
    "ok.sh": "vllm serve m --speculative-config '{\"method\":\"eagle3\","
             "\"num_speculative_tokens\":3}' --head-dim 128 --dtype auto /models/x\n"
             "python x.py --head-dim 128 /data/out 2>&1\n",
    "exp.sh": "dvc exp run -S draft.head_dim=112\n"
              "make exp SET=\"draft.num_speculative_tokens=5\"\n",
    "replay.py": "head_dim = 112  # check: ignore (the original bug, replayed)\n",
    "capture.py": 'SPEC = {"method": "extract_hidden_states", "num_speculative_tokens": 1}\n',
    "docs/x.md": "Prose: head_dim = 112 outside a code block.\n\n"
                 "<!-- check: ignore (replays the bug) -->\n```\nhead_dim: 112\n```\n"
                 "```python\nhead_dim = 128\n```\n",
    "code.py": "import torch\nids = torch.zeros(3, dtype=torch.long)\n"
               "head_dim = hidden // heads\nrope_theta = 1e4\nrms_norm_eps = 1.0e-06\n"
               "def f(dtype: str = \"bfloat16\", head_dim: int = 128):\n    pass\n"
               "x = dict(head_dim=head_dim * 2)\nhead_dim = 64 * scale\nnum_hidden_layers = 1\n"
               "cfg = {\"rope_scaling\": None, \"norm_before_residual\": True}\n"
               "aux_layer_ids = (1, 2, 3)\nvocab_size = 4096\nhead_dim = 256 // 2\n",
    "cfg.yaml": "aux_layer_ids: [1, 2, 3]\nhidden_act: silu\ndtype: bfloat16\n",
    "configs/vllm/config.json": '{"head_dim": 112}',      # generated
    "metrics/m.json": '{"head_dim": 112}',                # generated
    "tests/test_x.py": "head_dim = 32\n",                  # fixture
    "examples/k/reference.json": '{"head_dim": 112}',     # fixture
    "sub/params.yaml": "draft:\n  head_dim: 96\n",         # a params file: a source
    "nb.ipynb": notebook(("code", ["head_dim = 128\n"])),
    "msg.py": "print(f\"rope_scaling={rs} head_dim={arch.head_dim} \"\n"
              "      f\"{r['hidden_size']:6d}\")\n",
}


def test_scan_clean_cases(tmp_path):
    rc, out, err = cli_scan(git_repo(tmp_path / "repo", CLEAN))
    assert rc == 0, err
    assert "hand-written architecture and serving values: none contradict params.yaml" in out


def test_scan_reads_only_tracked_files(tmp_path):
    repo = git_repo(tmp_path / "repo", {"a.py": "x = 1\n"})
    (repo / "untracked.py").write_text("head_dim = 112\n")
    assert cli_scan(repo)[0] == 0


def test_scan_keys_cover_every_field_consumers_read():
    from dataclasses import fields as dc_fields

    names = set(S.SCAN_KEYS) | {a for al in S.SCAN_KEYS.values() for a in al} | \
        set(S.NOT_SCANNED)
    read = {k.split(".")[-1] for k in R.VLLM_READS} | {f.name for f in dc_fields(A.DraftArch)}
    assert read <= names, read - names


def test_repository_scans_clean_and_fast():
    import time

    params = P.load(ROOT / "params.yaml")
    files = configs.render_files(params.draft, params.verifier.path,
                           ROOT / "configs/verifier_config.json")
    t = time.perf_counter()
    problems = S.scan_constants(ROOT, params, files)
    assert time.perf_counter() - t < 2.0
    assert problems == [], "\n".join(problems)


@pytest.mark.integration
def test_subprocess_exit_code_and_no_traceback(tmp_path):
    """The issue's two misses, through the installed command line in its own process."""
    import sys

    repo = git_repo(tmp_path / "repo", {"serve.sh": (
        "vllm serve m --speculative-config '{\"method\":\"eagle3\",\"num_speculative_tokens\":5}'"
        "\nvllm serve m --head-dim 96\n")})
    r = subprocess.run([sys.executable, "-m", "eagle3pipe.tools.cli", "check", "--params",
                        str(DATA_PARAMS), "--verifier-config", str(VCFG),
                        "--no-configs", "--root", str(repo)], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert "serve.sh:1: num_speculative_tokens = 5" in r.stderr
    assert "serve.sh:2: --head-dim (head_dim) = 96" in r.stderr
