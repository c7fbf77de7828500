"""formats.py and parsing.py: each layout that describes the draft (draft_config.json,
speculators' nested config, the flat vLLM one) parses back to the architecture it was rendered
from, and a file that lacks a field, or holds it with the wrong type, is an error naming the file
and the key: never a default. Real speculators config classes render; nothing is mocked."""
from __future__ import annotations

import copy
import json
import re
from dataclasses import replace

import pytest

from helpers import drafts
from helpers.micro import ROOT
from eagle3pipe.draft import formats as F
from eagle3pipe.draft import parsing
from eagle3pipe.stages.configs import run as configs
from eagle3pipe.config import params as P
from eagle3pipe.draft.arch import derive
from eagle3pipe.errors import Error
from eagle3pipe.verifier.handle import VerifierInfo

MICRO_VERIFIER = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                  "num_hidden_layers": 4, "vocab_size": 512, "bos_token_id": 0,
                  "eos_token_id": 3}
# (verifier config overrides, draft overrides): head_dim other than hidden/heads (but in the
# micro default, 64/2), rope scaling of several types, list and null token ids, other dtypes
ARCHS = {
    "micro": ({}, {}),
    "mha_head_dim_64": ({}, dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64)),
    "bf16_no_norm_before_residual": ({}, dict(norm_before_residual=False, dtype="bfloat16",
                                              aux_layer_ids=[0, 1, 3])),
    "linear_rope_f16": ({}, dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                 rope_theta=500000.0, rms_norm_eps=1e-5, dtype="float16")),
    "yarn_gelu_full_vocab": ({}, dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 256},
                                      hidden_act="gelu", max_position_embeddings=4096,
                                      draft_vocab_size=512, head_dim=16)),
    "eos_list_no_bos_8_layers": ({"bos_token_id": None, "eos_token_id": [3, 7],
                                  "num_hidden_layers": 8}, dict(aux_layer_ids=[2, 4, 5])),
    # EAGLE-3.1's switches (each alone, the exclusive pair's either side) and the Qwen3 layer
    "norm_before_fc_norm_output": ({}, dict(norm_before_fc=True, norm_output=True)),
    "fc_norm_qwen3": ({}, dict(fc_norm=True, draft_arch="qwen3", dtype="bfloat16")),
    "qwen3_norm_output": ({}, dict(norm_output=True, draft_arch="qwen3")),
}
LAYOUT_FILES = {"draft_config": "draft_config.json", "speculators": "speculators/config.json",
                "vllm": "vllm/config.json"}


def make_arch(tmp_path, name: str):
    vcfg, draft = ARCHS[name]
    verifier = {**MICRO_VERIFIER, **vcfg}
    (tmp_path / "verifier").mkdir(exist_ok=True)
    (tmp_path / "verifier" / "config.json").write_text(json.dumps(verifier))
    return drafts.micro_arch(tmp_path / "verifier", **draft), verifier


def rendered(arch, verifier: dict) -> dict[str, str]:
    return F.render(arch, verifier_config=verifier, verifier_path=None, num_speculative_tokens=3)


def parse(layout: str, cfg: dict, source: str, arch, **kw):
    if layout == "draft_config":
        return parsing.parse_draft_config(cfg, source, dtype=kw.pop("dtype", arch.dtype), **kw)
    fn = parsing.parse_speculators if layout == "speculators" else parsing.parse_flat
    return fn(cfg, source, verifier_num_layers=arch.verifier_num_layers, **kw)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    arch, verifier = make_arch(tmp_path_factory.mktemp("micro"), "micro")
    files = rendered(arch, verifier)
    return arch, {layout: json.loads(files[rel]) for layout, rel in LAYOUT_FILES.items()}


# ---- parse(render(arch)) == arch


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_every_layout_parses_back_to_the_arch_it_renders(tmp_path, name):
    arch, verifier = make_arch(tmp_path, name)
    files = rendered(arch, verifier)
    for layout, rel in LAYOUT_FILES.items():
        back = parse(layout, json.loads(files[rel]), rel, arch)
        assert back == arch, (layout, parsing.differences(back, arch))
    # through the files the configs stage writes, read as training and export read them
    F.write(files, tmp_path / "configs")
    assert parsing.read_draft_config(tmp_path / "configs/draft_config.json") == \
        replace(arch, dtype=F.TRAINED_DTYPE)
    for layout in ("speculators", "vllm"):
        path = tmp_path / "configs" / LAYOUT_FILES[layout]
        raw, back, found = parsing.read_config_file(path,
                                                    verifier_num_layers=arch.verifier_num_layers)
        assert (raw, back, found) == (path.read_bytes(), arch, layout)


def test_the_archs_differ_where_the_files_must_keep_them_apart(tmp_path):
    """Negative control for the round trip: the variants really differ, field by field."""
    archs = []
    for name in sorted(ARCHS):
        (tmp_path / name).mkdir()
        archs.append(make_arch(tmp_path / name, name)[0])
    changed = {f for a in archs[1:] for f, _, _ in parsing.differences(archs[0], a)}
    assert {"head_dim", "num_attention_heads", "norm_before_residual", "aux_layer_ids",
            "rope_scaling", "rope_theta", "rms_norm_eps", "dtype", "hidden_act",
            "max_position_embeddings", "draft_vocab_size", "bos_token_id", "eos_token_id",
            "verifier_num_layers"} <= changed


def test_the_committed_configs_are_what_params_yaml_renders():
    """configs/ is the default pipeline's output: formats renders it byte for byte, and each
    layout in it parses to the architecture params.yaml derives."""
    params = P.load(ROOT / "params.yaml")
    vcfg = ROOT / "configs/verifier_config.json"
    files = configs.render_files(params.draft, params.verifier.path, vcfg,
                           params_file=str(ROOT / "params.yaml"))
    for rel, text in files.items():
        assert (ROOT / "configs" / rel).read_text() == text, rel
    arch = derive(params.draft, VerifierInfo.from_config(vcfg))
    for layout, rel in LAYOUT_FILES.items():
        assert parse(layout, json.loads(files[rel]), rel, arch) == arch, layout


def test_legacy_rope_type_key_compares_equal_across_layouts(tmp_path):
    """rope_scaling {"type": ...} renders as rope_parameters {"rope_type": ...}: the
    speculators layout gives the rope_type form back, and differences() sees no difference."""
    arch, verifier = make_arch(tmp_path, "micro")
    arch = replace(arch, rope_scaling={"type": "linear", "factor": 2.0})
    files = rendered(arch, verifier)
    spec = parse("speculators", json.loads(files["speculators/config.json"]), "s", arch)
    flat = parse("vllm", json.loads(files["vllm/config.json"]), "v", arch)
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert flat == arch
    assert parsing.differences(spec, flat) == []
    assert parsing.differences(spec, replace(flat, rope_scaling={"type": "linear",
                                                                  "factor": 4.0})) \
        == [("rope_scaling", {"rope_type": "linear", "factor": 2.0},
             {"rope_type": "linear", "factor": 4.0})]


# ---- no defaults: every key each layout needs, removed in turn


_DELETE = object()


def _edit(cfg: dict, key: str, value=_DELETE) -> dict:
    """A copy of cfg with the dotted key set to value (deleted by default)."""
    cfg = copy.deepcopy(cfg)
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return cfg


NEEDED = [(layout, key) for layout in LAYOUT_FILES for key in parsing.KEYS[layout].values()]


@pytest.mark.parametrize("layout,key", NEEDED, ids=[f"{lay}:{k}" for lay, k in NEEDED])
def test_a_missing_key_is_an_error_naming_file_and_key(micro, layout, key):
    arch, cfgs = micro
    with pytest.raises(parsing.ConfigError) as e:
        parse(layout, _edit(cfgs[layout], key), f"configs/{LAYOUT_FILES[layout]}", arch)
    msg = str(e.value)
    assert msg.startswith(f"configs/{LAYOUT_FILES[layout]}: missing keys [")
    assert repr(key) in msg and msg.endswith("regenerate it with `dvc repro configs`")
    assert isinstance(e.value, Error)  # the stage runner's one error type: exit 2


def test_every_field_is_read_from_each_layout_or_passed_by_the_caller():
    fields = set(parsing.ARCH_FIELDS)
    assert set(parsing.KEYS["draft_config"]) == fields - {"dtype"}
    assert set(parsing.KEYS["speculators"]) == set(parsing.KEYS["vllm"]) \
        == fields - {"verifier_num_layers"}


def test_draft_config_error_text(micro):
    """The text train.load_draft_config gave (the trainer reads through read_draft_config)."""
    arch, cfgs = micro
    cfg = {**_edit(cfgs["draft_config"], "head_dim"), "heads": 2}
    with pytest.raises(parsing.ConfigError) as e:
        parsing.parse_draft_config(cfg, "c/draft_config.json", dtype="float32")
    assert str(e.value) == ("c/draft_config.json: missing keys ['head_dim']; unknown keys "
                            "['heads']; regenerate it with `dvc repro configs`")
    # a dtype key is tolerated and ignored: the caller's dtype is the one used
    assert parsing.parse_draft_config({**cfgs["draft_config"], "dtype": "bfloat16"}, "c",
                                      dtype="float32").dtype == "float32"


@pytest.mark.parametrize("layout,key,value,says", [
    ("vllm", "head_dim", "128", "head_dim is '128', not an integer"),
    ("vllm", "head_dim", None, "head_dim is None, not an integer"),
    ("vllm", "norm_before_residual", 1, "norm_before_residual is 1, not true or false"),
    ("vllm", "hidden_size", True, "hidden_size is True, not an integer"),
    ("vllm", "eagle_config.eagle_aux_hidden_state_layer_ids", [1, "2", 3],
     "eagle_config.eagle_aux_hidden_state_layer_ids is [1, '2', 3], not a list of integers"),
    ("vllm", "dtype", "fp8", "dtype is 'fp8', not one of ['bfloat16', 'float16', 'float32']"),
    ("speculators", "transformer_layer_config.rms_norm_eps", "1e-6",
     "transformer_layer_config.rms_norm_eps is '1e-6', not a number"),
    ("speculators", "transformer_layer_config.rope_parameters", None,
     "missing keys ['transformer_layer_config.rope_parameters.rope_theta']"),
    ("draft_config", "verifier_num_layers", 4.0, "verifier_num_layers is 4.0, not an integer"),
    ("draft_config", "hidden_act", None, "hidden_act is None, not a string"),
])
def test_a_wrong_type_is_an_error_naming_the_key(micro, layout, key, value, says):
    arch, cfgs = micro
    with pytest.raises(parsing.ConfigError, match="^f.json: .*" + re.escape(says)):
        parse(layout, _edit(cfgs[layout], key, value), "f.json", arch)


def test_nullable_fields_accept_null(micro):
    arch, cfgs = micro
    cfg = _edit(_edit(cfgs["vllm"], "bos_token_id", None), "eos_token_id", None)
    assert parse("vllm", cfg, "f", arch) == replace(arch, bos_token_id=None, eos_token_id=None)


def test_the_flat_configs_redundant_keys_must_agree(micro):
    arch, cfgs = micro
    cfg = _edit(cfgs["vllm"], "rope_parameters.rope_theta", 500000.0)
    with pytest.raises(parsing.ConfigError, match=r"rope_parameters is .*500000.0.*, inconsistent "
                                                  r"with rope_scaling and rope_theta"):
        parse("vllm", cfg, "f", arch)
    with pytest.raises(parsing.ConfigError,
                       match="torch_dtype is 'float16', inconsistent with dtype"):
        parse("vllm", _edit(cfgs["vllm"], "torch_dtype", "float16"), "f", arch)
    # absent is fine: published flat configs often have only one of them
    assert parse("vllm", _edit(cfgs["vllm"], "rope_parameters"), "f", arch) == arch


def test_a_given_dtype_fills_only_a_file_that_states_none(micro):
    """The trained checkpoint's config (speculators, use_diff) states no dtype: the caller says
    float32; a file that states another dtype is an error, not overridden."""
    arch, cfgs = micro
    no_dtype = _edit(cfgs["speculators"], "dtype")
    assert arch.dtype == "float32"
    assert parse("speculators", no_dtype, "t", arch, dtype="float16") == \
        replace(arch, dtype="float16")
    with pytest.raises(parsing.ConfigError,
                       match=r"t: dtype is 'float32', but 'bfloat16' is expected"):
        parse("speculators", cfgs["speculators"], "t", arch, dtype="bfloat16")
    with pytest.raises(parsing.ConfigError, match=r"missing keys \['dtype'\]"):
        parse("speculators", no_dtype, "t", arch)


def test_layout_of_names_the_file():
    assert parsing.layout_of({"speculators_model_type": "eagle3"}, "a") == "speculators"
    assert parsing.layout_of({"architectures": [F.FLAT_ARCHITECTURE]}, "a") == "vllm"
    with pytest.raises(parsing.ConfigError, match=r"^x/config.json: neither speculators' nested"):
        parsing.layout_of({"architectures": ["LlamaForCausalLM"]}, "x/config.json")


def test_read_draft_config_names_file_line_and_fix(tmp_path):
    p = tmp_path / "draft_config.json"
    with pytest.raises(parsing.ConfigError, match="draft config not found; regenerate it with"):
        parsing.read_draft_config(p)
    p.write_text('{\n  "head_dim": 32,\n  oops\n}\n')
    with pytest.raises(parsing.ConfigError, match=rf"^{re.escape(str(p))}:3: invalid JSON"):
        parsing.read_draft_config(p)


def test_differences_is_field_by_field(micro):
    arch, _ = micro
    other = replace(arch, head_dim=64, dtype="float16", aux_layer_ids=(0, 1, 2))
    assert parsing.differences(arch, other) == [("head_dim", 32, 64),
                                                ("aux_layer_ids", [1, 2, 3], [0, 1, 2]),
                                                ("dtype", "float32", "float16")]
    assert parsing.differences(arch, other, ignore=("dtype", "head_dim", "aux_layer_ids")) == []
    assert parsing.differences(arch, replace(arch, aux_layer_ids=[1, 2, 3])) == []
