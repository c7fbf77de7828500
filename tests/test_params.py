"""params.yaml schema: every malformed input names file, line and key, and writes nothing."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3pipe.tools import cli
from eagle3pipe.config import params as P
from eagle3pipe.config import dvcfile, view

from helpers.micro import ROOT

DEFAULT = (ROOT / "params.yaml").read_text()
KIMI_VERIFIER = ROOT / "examples/kimi-k2.5/verifier/config.json"


def line_no(text: str, needle: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith(needle):
            return i
    raise AssertionError(f"{needle!r} not in params text")


def replace_line(text: str, needle: str, new: str) -> tuple[str, int]:
    n = line_no(text, needle)
    lines = text.splitlines()
    lines[n - 1] = new
    return "\n".join(lines) + "\n", n


def section_line(text: str, section: str) -> int:
    return line_no(text, f"{section}:")


def _case(needle, new, key, msg=None):
    return (needle, new, key, msg)


# (line to find, replacement line, key the error must name, regex the message must match)
CASES = [
    _case("  head_dim: 64", "  head_dim: 127", "draft.head_dim", "even"),
    _case("  head_dim: 64", "  head_dim: -128", "draft.head_dim", ">="),
    _case("  head_dim: 64", "  head_dim: '128'", "draft.head_dim", "integer"),
    _case("  head_dim: 64", "  head_dim: 128.0", "draft.head_dim", "integer"),
    _case("  head_dim: 64", "  head_dim: null", "draft.head_dim", "null"),
    _case("  head_dim: 64", "  head_dmi: 128", "draft.head_dmi", "unknown key"),
    _case("  num_attention_heads: 4", "  num_attention_heads: 0", "draft.num_attention_heads",
          ">="),
    _case("  num_key_value_heads: 2", "  num_key_value_heads: 3", "draft.num_key_value_heads",
          "divide"),
    _case("  aux_layer_ids:", "  aux_layer_ids: [1, 2, 3, 3]", "draft.aux_layer_ids",
          "exactly 3"),
    _case("  aux_layer_ids:", "  aux_layer_ids: [1, 2, 2]", "draft.aux_layer_ids", "duplicated"),
    _case("  aux_layer_ids:", "  aux_layer_ids: [3, 1, 2]", "draft.aux_layer_ids", "ascending"),
    _case("  draft_arch:", "  draft_arch: mistral", "draft.draft_arch", "llama"),
    _case("  norm_output:", "  norm_output: 1", "draft.norm_output", "true or false"),
    _case("  aux_layer_ids:", "  aux_layer_ids: [1, 2]", "draft.aux_layer_ids", "exactly 3"),
    _case("  aux_layer_ids:", "  aux_layer_ids: [1, two, 3]", "draft.aux_layer_ids[1]",
          "integer"),
    _case("  aux_layer_ids:", "  aux_layer_ids: 3", "draft.aux_layer_ids", "list"),
    _case("  norm_before_residual:", "  norm_before_residual: yes please",
          "draft.norm_before_residual", "true or false"),
    _case("  draft_vocab_size:", "  draft_vocab_size: -5", "draft.draft_vocab_size", ">="),
    _case("  rms_norm_eps: 1.0e-06", "  rms_norm_eps: 1e-6x", "draft.rms_norm_eps", "number"),
    _case("  dtype: bfloat16", "  dtype: bf16", "draft.dtype", "not one of"),
    _case("  hidden_act: silu", "  hidden_act: gelu", "draft.hidden_act", "not one of"),
    _case("  hash_mode: headers", "  hash_mode: sometimes", "verifier.hash_mode", "not one of"),
    _case("  on_bad_input: skip", "  on_bad_input: ignore", "dataset.on_bad_input", "not one of"),
    _case("  eval_fraction: 0.1", "  eval_fraction: 1.5", "dataset.eval_fraction", r"\[0, 1\)"),
    _case("  batch_tokens: 2048", "  batch_tokens: lots", "train.batch_tokens", "integer"),
    _case("  device: cpu", "  device: tpu", "train.device", "not one of"),
    _case("    adam_betas:", "    adam_betas: [0.9, 1.0]", "verifier.embedded.adam_betas",
          "below 1"),
    _case("    adam_betas:", "    adam_betas: [0.9]", "verifier.embedded.adam_betas",
          "exactly 2"),
    _case("  snippet_lines: [4, 12]    # source", "  snippet_lines: [12, 4]",
          "dataset.snippet_lines", "min <= max"),
    _case("  snippet_lines: [4, 12]    # prompts", "  snippet_lines: [0, 4]",
          "smoke.snippet_lines", "1 <= min"),
    _case("  cpu_chunk_tokens:", "  cpu_chunk_tokens: 8", "train.cpu_chunk_tokens", ">="),
    _case("  checkpoint_every:", "  checkpoint_every: -50", "train.checkpoint_every", ">="),
    _case("  min_acceptance_length:", "  min_acceptance_length: 0.5",
          "smoke.min_acceptance_length", ">="),
    _case("  ngram_prompt_lookup_min: 1", "  ngram_prompt_lookup_min: 9",
          "smoke.ngram_prompt_lookup_min", "larger"),
    _case("  batch1_prompts:", "  batch1_prompts: 99", "smoke.batch1_prompts", "more than"),
    _case("  loss_impl: auto", "  loss_impl: fused", "train.loss_impl", "cuda only"),
    _case("  loss_impl: auto", "  loss_impl: triton", "train.loss_impl", "not one of"),
    _case("  nnodes: 1", "  nnodes: 2", "train.nnodes", "train.rdzv_endpoint is null"),
    _case("  nnodes: 1", "  nnodes: 0", "train.nnodes", ">="),
    _case("  mode: offline", "  mode: streaming", "extract.mode", "not one of"),
    _case("  endpoint: null", "  endpoint: infer0", "extract.endpoint", "is not host:port"),
    _case("  endpoint: null", "  endpoint: infer0:8100", "extract.endpoint",
          "extract.mode is offline"),
    _case("  rms_norm_eps: 1.0e-06", "  rms_norm_eps: .nan", "draft.rms_norm_eps", "finite"),
    _case("  rope_theta: 10000.0", "  rope_theta: .inf", "draft.rope_theta",
          "finite"),
    _case("  rope_scaling: null", "  rope_scaling: {type: yarn}", "draft.rope_scaling",
          "needs factor, original_max_position_embeddings"),
    _case("  rope_scaling: null", "  rope_scaling: {rope_type: linear, factor: .inf}",
          "draft.rope_scaling", "finite"),
    _case("  rope_scaling: null", "  rope_scaling: {rope_type: ntk}", "draft.rope_scaling",
          "not one of"),
    _case("  chat_template_kwargs: {}", "  chat_template_kwargs: enable_thinking",
          "dataset.chat_template_kwargs", "expected a mapping"),
    _case("  chat_template_kwargs: {}", "  chat_template_kwargs: {enable-thinking: true}",
          "dataset.chat_template_kwargs", "not a name a Jinja template can read"),
    _case("  chat_template_kwargs: {}", "  chat_template_kwargs: {thinking: null}",
          "dataset.chat_template_kwargs", "cannot tell it from absent"),
    _case("  chat_template_kwargs: {}", "  chat_template_kwargs: null",
          "dataset.chat_template_kwargs", "must not be null"),
    _case("  min_acceptance_length:", "  min_acceptance_length: 5.0",
          "smoke.min_acceptance_length", r"never be reached.*k \+ 1 = 4"),
    _case("  tensor_parallel_size: 1", "  tensor_parallel_size: 3", "vllm.tensor_parallel_size",
          "does not divide the draft's num_attention_heads"),
    _case("  max_model_len: 1024", "  max_model_len: 256", "vllm.max_model_len",
          "shorter than dataset.max_seq_len"),
    _case("  gpu_memory_utilization: 0.9", "  gpu_memory_utilization: 1.5",
          "vllm.gpu_memory_utilization", r"\(0, 1\]"),
    _case("  dtype: float32", "  dtype: auto", "vllm.dtype", "not one of"),
    _case("  nproc_per_node: 1", "  nproc_per_node: 0", "train.nproc_per_node", ">="),
    _case("  num_samples: 1296", "  num_samples: 1", "dataset.num_samples",
          "cannot fill both a train and an eval split"),
    _case("  batch_size: 1024", "  batch_size: 0", "dataset.batch_size", ">="),
    _case("  loss: ce", "  loss: mse", "train.loss", "not one of"),
    _case("    threads: 2", "    threads: 0", "verifier.embedded.threads", ">="),
    _case("    seed: 0", "    seed: -1", "verifier.embedded.seed", ">="),
    # sizes no machine can hold (arch.LARGEST_ACCELERATOR_BYTES), or the verifier forbids
    _case("  head_dim: 64", "  head_dim: 100000000000", "draft.head_dim",
          r"512\.0 TB of weights .*the largest: NVIDIA B300"),
    _case("  intermediate_size: 344", "  intermediate_size: 100000000000",
          "draft.intermediate_size", r"76\.8 TB of weights .*no machine can train or serve it"),
    _case("  num_attention_heads: 4", "  num_attention_heads: 100000000000",
          "draft.num_attention_heads", "does not divide the verifier hidden size 128"),
    _case("  draft_vocab_size:", "  draft_vocab_size: 100000000000", "draft.draft_vocab_size",
          "exceeds the verifier's vocab_size 4096"),
]


def refused(rc: int, err: str, out: Path, where: str) -> None:
    """The shape of every refusal: exit 2, `where` (file:line: key:) named, a fix, no
    traceback, nothing written."""
    assert rc == 2, err
    assert where in err, err
    assert "fix: " in err and "Traceback" not in err, err
    assert not out.exists(), "a refused input must write nothing"


def run_render(tmp_path: Path, text: str) -> tuple[int, str, Path]:
    pfile = tmp_path / "params.yaml"
    pfile.write_text(text)
    out = tmp_path / "out"
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["render", "--params", str(pfile), "--out", str(out),
                       "--verifier-config", str(KIMI_VERIFIER if "kimi" in text else
                                                tmp_path / "verifier.json")])
    return rc, err.getvalue(), out


# a verifier like the embedded default: H=128, 16 layers, vocab 4096
VERIFIER_JSON = ('{"architectures": ["LlamaForCausalLM"], "hidden_size": 128, '
                 '"num_hidden_layers": 16, "vocab_size": 4096, "num_attention_heads": 2, '
                 '"bos_token_id": 0, "eos_token_id": 3}')


@pytest.fixture
def verifier_json(tmp_path):
    (tmp_path / "verifier.json").write_text(VERIFIER_JSON)


def test_default_params_render(tmp_path, verifier_json):
    rc, err, out = run_render(tmp_path, DEFAULT)
    assert rc == 0, err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.json")) == sorted(
        ["capture.json", "draft_config.json", "speculators/config.json", "vllm/config.json",
         "verifier_config.json", "serve/vllm.json", "serve/speculators.json",
         "serve/sglang.json"])


@pytest.mark.parametrize("needle,new,key,msg", CASES, ids=[f"{c[2]}:{c[1].strip()}" for c in CASES])
def test_malformed_value(tmp_path, verifier_json, needle, new, key, msg):
    text, line = replace_line(DEFAULT, needle, new)
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, f"params.yaml:{line}: {key}:")
    assert re.search(msg, err), err


def test_exclusive_norm_switches_refused(tmp_path, verifier_json):
    """norm_before_fc and fc_norm together: one RMSNorm over the concatenated aux states and one
    per state (speculators' Eagle3SpeculatorConfig refuses the pair); named at fc_norm."""
    text, _ = replace_line(DEFAULT, "  norm_before_fc:", "  norm_before_fc: true")
    text, line = replace_line(text, "  fc_norm:", "  fc_norm: true")
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, f"params.yaml:{line}: draft.fc_norm:")
    assert "set one of draft.norm_before_fc and draft.fc_norm to false" in err, err


def test_missing_key_names_section_line(tmp_path, verifier_json):
    n = line_no(DEFAULT, "  intermediate_size: 344")
    lines = DEFAULT.splitlines()
    del lines[n - 1]
    rc, err, out = run_render(tmp_path, "\n".join(lines) + "\n")
    refused(rc, err, out, f"params.yaml:{section_line(DEFAULT, 'draft')}: "
            "draft.intermediate_size: missing required key")


def test_missing_section(tmp_path, verifier_json):
    start = DEFAULT.index("\nsmoke:")
    rc, err, out = run_render(tmp_path, DEFAULT[:start] + "\n")
    refused(rc, err, out, "params.yaml:1: smoke: missing required key")


def test_unknown_top_level_section(tmp_path, verifier_json):
    text = DEFAULT + "extras:\n  foo: 1\n"
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, f"params.yaml:{len(DEFAULT.splitlines()) + 1}: extras: unknown key")


def test_yaml_syntax_error(tmp_path, verifier_json):
    text, line = replace_line(DEFAULT, "  head_dim: 64", "  head_dim: [128")
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, "(yaml): YAML syntax error")
    assert re.search(rf"params\.yaml:{line + 1}: \(yaml\)", err), err  # where the list breaks


def test_empty_file(tmp_path, verifier_json):
    rc, err, out = run_render(tmp_path, "\n  \n")
    refused(rc, err, out, "params.yaml:1: (file): is empty")


def test_section_not_mapping(tmp_path, verifier_json):
    text, line = replace_line(DEFAULT, "extract:", "extract: fast")
    text = text.replace("  dtype: bfloat16\n  batch_size: 8\n  threads: 2\n", "", 1)
    text = re.sub(r"(?m)^(  endpoint: .*\n)  seed: 0\n", r"\1", text, count=1)
    text = "\n".join(t for t in text.split("\n")
                     if not t.startswith(("  oracle_", "  mode: ", "  endpoint: ")))
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, f"params.yaml:{line}: extract: expected a mapping")


def test_an_engine_inside_the_train_stage_needs_one_training_process(tmp_path, verifier_json):
    text, _ = replace_line(DEFAULT, "  nproc_per_node: 1", "  nproc_per_node: 2")
    text, line = replace_line(text, "  mode: offline", "  mode: online")
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, f"params.yaml:{line}: extract.mode:")
    assert "extract.endpoint" in err and "eagle3pipe serve --hidden-states" in err
    text, _ = replace_line(text, "  endpoint: null", "  endpoint: infer0:8100")
    rc, err, _ = run_render(tmp_path, text)
    assert rc == 0, err  # a server elsewhere serves every training process


def test_all_problems_listed_at_once(tmp_path, verifier_json):
    text, _ = replace_line(DEFAULT, "  head_dim: 64", "  head_dim: 127")
    text, _ = replace_line(text, "  device: cpu", "  device: tpu")
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, "2 problem(s)")
    assert "draft.head_dim" in err and "train.device" in err


# ---- cross-checks against the verifier config


CROSS_CASES = [
    _case("  aux_layer_ids:", "  aux_layer_ids: [1, 2, 16]", "draft.aux_layer_ids",
          r"outside the verifier's layers 0\.\.15"),
    _case("  draft_vocab_size:", "  draft_vocab_size: 5000", "draft.draft_vocab_size",
          "exceeds the verifier's vocab_size 4096"),
    _case("  num_attention_heads: 4", "  num_attention_heads: 6", "draft.num_attention_heads",
          "hidden % heads"),
    _case("  dtype: bfloat16", "  dtype: bfloat16\n  hidden_size: 512", "draft.hidden_size",
          "differs from the verifier's hidden_size 128"),
]


def cross_case_text(needle: str, new: str, key: str) -> tuple[str, int]:
    text, line = replace_line(DEFAULT, needle, new)
    if key == "draft.num_attention_heads":  # keep kv heads a divisor so only H % heads fails
        text, _ = replace_line(text, "  num_key_value_heads: 2", "  num_key_value_heads: 3")
    if key == "draft.hidden_size":
        line += 1
    return text, line


@pytest.mark.parametrize("needle,new,key,msg", CROSS_CASES)
def test_verifier_cross_checks(tmp_path, verifier_json, needle, new, key, msg):
    text, line = cross_case_text(needle, new, key)
    rc, err, out = run_render(tmp_path, text)
    refused(rc, err, out, f"params.yaml:{line}: {key}:")
    assert re.search(msg, err), err


@pytest.mark.parametrize("script,paths", [
    ("verifier", ["--out", "artifacts/verifier", "--metrics", "metrics/verifier.json"]),
    ("configs", ["--verifier", "verifier.json", "--out", "configs"])])
def test_stage_refuses_a_draft_that_fits_nowhere(tmp_path, verifier_json, script, paths):
    """`dvc repro`'s first stage that reads draft.* (verifier: for validation, before building
    the embedded verifier) and the configs stage refuse it, in their own process."""
    import subprocess
    import sys

    text, line = replace_line(DEFAULT, "  head_dim: 64", "  head_dim: 100000000000")
    (tmp_path / "params.yaml").write_text(text)
    r = subprocess.run([sys.executable, str(ROOT / f"stages/{script}.py"), "--params",
                        "params.yaml", "--dvc-yaml", str(ROOT / "dvc.yaml"), *paths],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    where = f"{script}: error: params.yaml:{line}: draft.head_dim: 100000000000 makes the draft"
    refused(r.returncode, r.stderr, tmp_path / paths[paths.index("--out") + 1], where)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "verifier.json"]


def test_verifier_config_missing_fields(tmp_path):
    (tmp_path / "verifier.json").write_text('{"hidden_size": 256}')
    rc, err, out = run_render(tmp_path, DEFAULT)
    assert rc == 2 and "verifier.json" in err and "num_hidden_layers" in err
    assert not out.exists()


# ---- the stage view


def test_stage_view_refuses_undeclared_keys():
    v = view.for_stage("vocab", ROOT / "params.yaml", ROOT / "dvc.yaml")
    assert v.draft.draft_vocab_size == 1024
    with pytest.raises(view.UndeclaredParamError, match=r"draft\.head_dim.*stages\.vocab\.params"):
        v.draft.head_dim
    with pytest.raises(view.UndeclaredParamError):
        v.train.seed


def test_every_leaf_key_is_declared_by_some_stage():
    from ruamel.yaml import YAML
    stages = YAML(typ="safe").load((ROOT / "dvc.yaml").read_text())["stages"]
    declared = set().union(*(dvcfile.declared_params(s, ROOT / "dvc.yaml") for s in stages))
    params = P.load(ROOT / "params.yaml")
    for key in P.leaf_keys():
        if key.startswith("verifier.embedded.") and params.verifier.embedded is None:
            continue
        if key == "draft.hidden_size":  # optional: read only to refuse a mismatch
            assert "draft" in declared
            continue
        assert any(key == d or key.startswith(d + ".") for d in declared), \
            f"{key} is in params.yaml but no stage in dvc.yaml declares it"


def test_stage_view_names_never_shadow_a_params_key():
    """A view's own attributes (params_file, key_lines, params_at, for_validation) win over
    params keys of the same name: none may be one."""
    own = {n for n in dir(view.StageView) if not n.startswith("_")}
    clash = {k for k in P.leaf_keys() for part in k.split(".") if part in own}
    assert own >= {"params_file", "key_lines", "params_at", "for_validation"} and not clash, clash


# ---- docs/inputs.md: the table of every malformed input the suite tries, generated from the
# case lists (`python tests/test_params.py > docs/inputs.md`)

# params inputs outside CASES and CROSS_CASES: (what was given, what it got, the test)
PARAMS_OTHER = [
    ("`draft.intermediate_size` deleted", "`FILE:LINE: draft.intermediate_size: missing required "
     "key` (LINE: the `draft:` section)", "test_missing_key_names_section_line"),
    ("the `smoke:` section deleted", "`FILE:1: smoke: missing required key`",
     "test_missing_section"),
    ("an `extras:` section", "`FILE:LINE: extras: unknown key`",
     "test_unknown_top_level_section"),
    ("`head_dim: [128` (unclosed list)", "`FILE:LINE: (yaml): YAML syntax error: ...`",
     "test_yaml_syntax_error"),
    ("an empty file", "`FILE:1: (file): is empty`", "test_empty_file"),
    ("`extract: fast` (a section as a scalar)", "`FILE:LINE: extract: expected a mapping of "
     "keys`", "test_section_not_mapping"),
    ("`head_dim: 127` and `device: tpu` together", "`2 problem(s) in params:`, then each",
     "test_all_problems_listed_at_once"),
    ("`norm_before_fc: true` and `fc_norm: true` together", "`FILE:LINE: draft.fc_norm: true "
     "together with draft.norm_before_fc: ...` (LINE: fc_norm's)",
     "test_exclusive_norm_switches_refused"),
]
VERIFIER_CONFIG_OTHER = [
    ("`{\"hidden_size\": 256}` only", "`FILE: ... num_hidden_layers ...` (missing fields)",
     "test_params.py::test_verifier_config_missing_fields"),
]


def _code(text: str) -> str:
    text = text.replace("|", "\\|").replace("\n", "\\n")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _plain(pattern: str) -> str:
    """A message regex as the text it matches (.* as an ellipsis)."""
    return re.sub(r"\\(.)", r"\1", pattern.replace(".*", " ... "))


def _params_message(text: str, key: str) -> str:
    """The line of what `eagle3pipe render` says about `key` in a params text, paths generic."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "verifier.json").write_text(VERIFIER_JSON)
        _, err, _ = run_render(Path(d), text)
        err = err.replace(str(Path(d) / "verifier.json"), "verifier.json")
    line = next(t for t in err.splitlines() if f": {key}: " in t)
    return re.sub(r"^(eagle3pipe render: (error: )?)?\S*params\.yaml:\d+:", "FILE:LINE:", line)


def _shown(raw: bytes) -> str:
    """Bytes as printable ASCII (escapes for the rest), long ones cut."""
    text = "".join(c if " " <= c <= "~" else repr(c)[1:-1]
                   for c in raw.decode("utf-8", "backslashreplace"))
    return _code(text if len(text) <= 72 else f"{text[:60]}... ({len(raw):,} bytes)")


def defined_tests(module: str) -> list[str]:
    """The test functions a test module of tests/ defines, sorted (read from its source: no
    test module imports another)."""
    import ast

    tree = ast.parse((Path(__file__).parent / module).read_text())
    return sorted(n.name for n in tree.body
                  if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"))


def input_kinds() -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """(kind, what every refusal of that kind looks like, [(input, what it got, test)])."""
    from helpers import malformed as M

    refusals = [name for name in defined_tests("test_families.py") if "refused" in name]

    params = [(_code(new.strip()), _code(_params_message(replace_line(DEFAULT, needle, new)[0],
                                                         key)),
               "test_params.py::test_malformed_value") for needle, new, key, _ in CASES]
    params += [(_code(new.split("\n")[-1].strip()),
                _code(_params_message(cross_case_text(needle, new, key)[0], key)),
                "test_params.py::test_verifier_cross_checks")
               for needle, new, key, _ in CROSS_CASES]
    params += [(i, g, f"test_params.py::{t}") for i, g, t in PARAMS_OTHER]
    verifier = list(VERIFIER_CONFIG_OTHER)
    verifier += [(why, _code(f"FILE: ...{file}...: ...{say}..."),
                  "test_verifier.py::test_malformed_verifier_is_refused_before_writing")
                 for why, _, file, say in M.BAD_VERIFIERS]
    verifier += [(name.replace("test_", "").replace("_", " "), "refused through `dvc repro`",
                  f"test_families.py::{name}") for name in refusals]
    generated = [(f"`{name}`: {_shown(raw)}", _code(f"FILE{_plain(what)}"),
                  f"test_runtime.py::test_broken_generated_json_names_file_line_and_fix "
                  f"(x {len(M.READERS)} readers)") for name, (raw, what) in M.BROKEN.items()]
    key = {r: f"dataset.{M.JSONL_KEY_OF.get(r, 'source')}" for _, _, r, _ in M.MALFORMED_JSONL}
    jsonl = [(f"`{name}`: {_shown(raw)}", _code(f"FILE:3: {key[reason]} (PARAMS:LINE): {detail}"),
              "test_dataset.py::test_malformed_jsonl_line_refused_by_the_stage")
             for name, raw, reason, detail in M.MALFORMED_JSONL]
    jsonl += [(f"`{name}`", _code(want.format(src="FILE", params="PARAMS",
                                                         line="LINE")),
               "test_dataset.py::test_malformed_jsonl_file_refused_by_the_stage")
              for name, _, want in M.MALFORMED_JSONL_FILES]
    samples = [(f"`{name}`: {_shown(raw)}", _code(f"FILE:2: {detail}"),
                "test_dataset.py::test_malformed_sample_file_refused_by_the_vocab_stage")
               for name, raw, detail in M.MALFORMED_SAMPLES]
    checkpoints = [(f"`{name}` ({layout} layout, {dtype})",
                    _code(want.format(st="CKPT/model.safetensors", ck="CKPT",
                                      cfg="CKPT/config.json", params="PARAMS")),
                    "test_check.py::test_malformed_checkpoint_is_named_and_nothing_written")
                   for name, layout, dtype, _, want in M.CORRUPT]
    return [
        ("params.yaml", "`eagle3pipe render/check/plan` and every stage: exit 2, "
         "`FILE:LINE: KEY: MESSAGE` + `    fix: ...`, nothing written", params),
        ("verifier checkpoint (config.json, tokenizer)", "the verifier stage, before it writes "
         "anything (config checks and the preflight): exit 2, `FILE[: KEY]: MESSAGE` + "
         "`    fix: ...`", verifier),
        ("generated JSON (capture.json, draft_config.json, an export's config.json, the "
         "verifier manifest)", "the reading stage: exit 2, `FILE:LINE: WHAT; FIX`, nothing "
         "written", generated),
        ("JSONL conversations (dataset.source)", "the dataset stage (on_bad_input: error): "
         "exit 2, `FILE:LINE: dataset.KEY (PARAMS:LINE): DETAIL` + `    fix: ...`, nothing "
         "written; with `skip` each is counted under its reason in metrics/dataset.json", jsonl),
        ("JSONL sample files (artifacts/dataset/*.jsonl)", "the vocab (and extract) stage: "
         "exit 2, `FILE:LINE: DETAIL` + `    fix: regenerate it with dvc repro dataset`, "
         "nothing written", samples),
        ("draft checkpoint", "`eagle3pipe check --checkpoint CKPT` (and the export stage): "
         "exit 1 listing `  - FILE: tensor NAME ...` or `  - CKPT (LAYOUT layout): tensor NAME "
         "...`, the checkpoint untouched", checkpoints),
    ]


def inputs_doc() -> str:
    kinds = input_kinds()
    out = ["# Malformed inputs", "", "[← README](../README.md) · [tests](tests.md)", "",
           "Every malformed input the suite hands the pipeline, by kind: what was given, what "
           "it got, and the test that asserts it. Each test asserts the file, the line (or "
           "tensor, or key), that nothing was written and that no traceback was printed. "
           "Generated from the tests' case lists by `python tests/test_params.py > "
           "docs/inputs.md`; `test_params.py::test_inputs_doc_is_generated_from_the_case_lists`"
           " fails when it is stale. FILE, LINE, CKPT, PARAMS stand for the test's own paths.",
           "", "| kind | malformed inputs |", "|---|---|"]
    out += [f"| {kind} | {len(rows)} |" for kind, _, rows in kinds]
    out += [f"| **total** | **{sum(len(rows) for _, _, rows in kinds)}** |", ""]
    for kind, shape, rows in kinds:
        out += [f"## {kind}", "", shape, "", "| # | input | what it got | test |",
                "|---|---|---|---|"]
        out += [f"| {i} | {a} | {b} | `{c}` |" for i, (a, b, c) in enumerate(rows, 1)]
        out.append("")
    out += ["Not malformed, and accepted: a UTF-8 byte-order mark on line 1 of a JSONL "
            "source, CRLF line ends, blank and whitespace-only lines (their numbers still "
            "count), keys the stage does not read (`test_dataset.py::"
            "test_tolerated_jsonl_variants`)."]
    return "\n".join(out) + "\n"


@pytest.mark.integration
def test_inputs_doc_is_generated_from_the_case_lists():
    kinds = {kind: rows for kind, _, rows in input_kinds()}
    assert sum(len(rows) for rows in kinds.values()) >= 60
    for rows in kinds.values():  # every test the table names exists
        for _, _, test in rows:
            module, name = test.split(" ")[0].split("::")
            assert name in defined_tests(module), test
    assert (ROOT / "docs/inputs.md").read_text() == inputs_doc(), \
        "docs/inputs.md is stale: run `python tests/test_params.py > docs/inputs.md`"


if __name__ == "__main__":
    import sys  # `python tests/test_params.py`: tests/ is sys.path[0], so `helpers` imports

    sys.stdout.write(inputs_doc())
