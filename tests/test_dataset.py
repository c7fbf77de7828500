"""The dataset stage: real vLLM regeneration with the micro verifier, real tokenizer, real files."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from eagle3pipe.stages.dataset import run as dataset
from eagle3pipe.data import prompts as prompt_src
from eagle3pipe.data.prompts import REASONS, BadInputError, PromptsError
from eagle3pipe.stages.dataset.run import DatasetError

from helpers.malformed import (GOOD, GOOD_LINE, MALFORMED_JSONL, MALFORMED_JSONL_FILES,
                               MALFORMED_SAMPLES, SAMPLE, USER)
from helpers.micro import engine_settings

ROOT = Path(__file__).resolve().parents[1]
END = "<|end|>"


def cfg(**kw):
    base = dict(source=None, num_samples=5, max_prompt_tokens=40, max_new_tokens=12,
                max_seq_len=96, batch_size=2, eval_fraction=0.2, on_bad_input="skip", seed=0,
                snippet_lines=[4, 12], snippet_max_chars=600)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture(scope="module")
def tokenizer(micro_verifier):
    from eagle3pipe.verifier.handle import Verifier

    return Verifier(micro_verifier).tokenizer()


@pytest.fixture(scope="module")
def stdlib_run(micro_verifier, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "dataset"
    metrics = dataset.build(cfg(), engine_settings(), micro_verifier, out, progress=False)
    return out, metrics


def samples_of(out: Path) -> list[dict]:
    return dataset.read_jsonl(out / "train.jsonl") + dataset.read_jsonl(out / "eval.jsonl")


def check_masks(samples, tokenizer):
    """Masked tokens decode to exactly the response + <|end|>; the unmasked part is the chat-
    templated prompt of the kept turns; the mask is one contiguous run at the end."""
    for s in samples:
        ids, mask = s["input_ids"], s["loss_mask"]
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        n_prompt = mask.index(1)
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
        assert s["messages"][-1]["role"] == "assistant"
        masked = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert masked == s["messages"][-1]["content"] + END
        assert ids[-1] == tokenizer.convert_tokens_to_ids(END)
        assert ids[-2] != ids[-1]  # the closing token is never doubled
        assert ids[:n_prompt] == prompt_src.template_ids(tokenizer, s["messages"][:-1],
                                                      add_generation_prompt=True)


@pytest.mark.integration
def test_stdlib_prompts_masks_cover_exactly_the_reply(stdlib_run, tokenizer):
    out, metrics = stdlib_run
    samples = samples_of(out)
    assert len(samples) == metrics["kept"] == 5
    assert metrics["read"] == metrics["kept"] + sum(metrics["skipped_by_reason"].values())
    assert metrics["train"] + metrics["eval"] == 5 and metrics["train"] >= 1
    assert metrics["eval"] >= 1  # eval_fraction > 0 guarantees one
    check_masks(samples, tokenizer)
    assert metrics["assistant_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    assert metrics["tokens"] == sum(len(s["input_ids"]) for s in samples)
    for s in samples:
        assert len(s["input_ids"]) - sum(s["loss_mask"]) <= 40  # max_prompt_tokens
        assert sum(s["loss_mask"]) <= 12 + 1  # max_new_tokens + a closing token
        assert s["messages"][0]["role"] == "user" and s["messages"][0]["content"]
    # prompts come from the corpus' "prompt" part (disjoint from verifier training/smoke)
    from eagle3pipe.data.prompts import snippets_of
    snippets = snippets_of("prompt", cfg(), 5)
    for s in samples:
        i = int(s["id"].split("-")[1])
        assert snippets[i].startswith(s["messages"][0]["content"])
    # canonical JSON lines
    for line in (out / "train.jsonl").read_text().splitlines():
        assert line == json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"))
    assert metrics["new_tokens"] > 0
    assert not any("_s" in k.split("_")[-1:] or k.endswith("_s") for k in metrics), \
        "no timings in committed metrics"


@pytest.mark.integration
def test_rerun_is_byte_identical(stdlib_run, micro_verifier, tmp_path):
    out, _ = stdlib_run
    again = tmp_path / "dataset"
    dataset.build(cfg(), engine_settings(), micro_verifier, again, progress=False)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (again / name).read_bytes() == (out / name).read_bytes()


@pytest.mark.integration
def test_reply_closed_by_the_verifier_keeps_a_single_end(stdlib_run, micro_verifier_copy,
                                                          tokenizer, tmp_path):
    """Swap the lm_head rows of <|end|> and the token the verifier chose first for sample 0:
    vLLM now stops on <|end|> at once (finish 'stop'); the sample has exactly one <|end|>."""
    from safetensors.torch import load_file, save_file

    out, _ = stdlib_run
    first = {s["id"]: s for s in samples_of(out)}["stdlib-000000"]
    chosen = first["input_ids"][first["loss_mask"].index(1)]
    end = tokenizer.convert_tokens_to_ids(END)
    f = micro_verifier_copy / "model.safetensors"
    w = load_file(str(f))
    lm = w["lm_head.weight"].clone()
    lm[[end, chosen]] = lm[[chosen, end]]
    w["lm_head.weight"] = lm.contiguous()
    save_file(w, str(f), metadata={"format": "pt"})
    metrics = dataset.build(cfg(), engine_settings(), micro_verifier_copy, tmp_path / "d",
                            progress=False)
    assert metrics["responses_closed"] >= 1
    samples = {s["id"]: s for s in samples_of(tmp_path / "d")}
    s0 = samples["stdlib-000000"]
    assert sum(s0["loss_mask"]) == 1 and s0["input_ids"][-1] == end
    assert s0["messages"][-1]["content"] == ""
    check_masks(samples.values(), tokenizer)


# ---------------------------------------------------------------------------------------------
# JSONL input


def bad_lines(tokenizer) -> dict[str, str]:
    """One line per rejection reason (micro limits: max_seq_len 96, max_prompt_tokens 40)."""
    long = "x = 1\n" * 200
    return {
        "malformed_json": '{"messages": [{"role": "user", "content": "x"}',
        "missing_messages": json.dumps({"conversation": [{"role": "user", "content": "x"}]}),
        "bad_message": json.dumps({"messages": [{"role": "user"}]}),
        "empty_conversation": json.dumps({"messages": []}),
        "no_user_turn": json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                                 {"role": "assistant", "content": "ok"}]}),
        "too_long": json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": long}]}),
        "prompt_too_long": json.dumps({"messages": [
            {"role": "system", "content": "import os\n" * 12},
            {"role": "user", "content": "go"}]}),
    }


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_bad_line_kind_is_an_error_naming_file_and_line(tokenizer, tmp_path):
    bads = bad_lines(tokenizer)
    assert set(bads) == set(REASONS)
    for reason, text in bads.items():
        f = write(tmp_path / f"{reason}.jsonl", [json.dumps(GOOD), "", text])
        with pytest.raises(BadInputError) as e:
            prompt_src.jsonl_prompts(f, cfg(source=str(f), on_bad_input="error"), tokenizer,
                                  progress=False)
        assert e.value.reason == reason
        assert str(e.value).startswith(f"{f}:3: {reason}:")  # blank line 2 still counts
        assert "fix:" in str(e.value)


@pytest.mark.integration
def test_bad_lines_skipped_counted_and_reported(micro_verifier, tokenizer, tmp_path):
    bads = bad_lines(tokenizer)
    conv = {"messages": [{"role": "system", "content": "You write Python."},
                         {"role": "user", "content": "import os"},
                         {"role": "assistant", "content": "dataset reply, dropped"},
                         {"role": "user", "content": "later turn, dropped"}]}
    truncated = {"messages": [{"role": "user", "content": "value = compute()\n" * 10}]}
    lines = [json.dumps(GOOD), *bads.values(), "", json.dumps(conv), json.dumps(truncated),
             json.dumps(GOOD)]  # the last line is beyond num_samples: never read
    f = write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "dataset"
    metrics = dataset.build(cfg(source=str(f), num_samples=10, eval_fraction=0.0),
                            engine_settings(), micro_verifier,
                            out, progress=False)
    assert metrics["read"] == 10
    assert metrics["skipped_by_reason"] == {r: 1 for r in sorted(REASONS)}
    assert metrics["kept"] == 3 and metrics["skipped"] == 7
    assert metrics["read"] == metrics["kept"] + sum(metrics["skipped_by_reason"].values())
    assert metrics["train"] + metrics["eval"] == metrics["kept"] and metrics["eval"] == 0
    assert metrics["skipped_lines"]["malformed_json"] == [2]
    assert metrics["skipped_lines"]["prompt_too_long"] == [8]
    assert metrics["prompts_truncated"] == 1
    samples = {s["id"]: s for s in dataset.read_jsonl(out / "train.jsonl")}
    assert sorted(samples) == ["jsonl-0000001", "jsonl-0000010", "jsonl-0000011"]
    kept = samples["jsonl-0000010"]["messages"]
    assert [m["role"] for m in kept] == ["system", "user", "assistant"]  # cut at 1st assistant
    assert kept[-1]["content"] != "dataset reply, dropped"
    check_masks(samples.values(), tokenizer)
    cut = samples["jsonl-0000011"]
    assert len(cut["input_ids"]) - sum(cut["loss_mask"]) <= 40


def test_all_lines_bad_is_a_clear_error(micro_verifier, tokenizer, tmp_path):
    f = write(tmp_path / "bad.jsonl", list(bad_lines(tokenizer).values()))
    with pytest.raises(DatasetError, match="no usable conversation among 7 read"):
        dataset.build(cfg(source=str(f), num_samples=10), engine_settings(), micro_verifier,
                      tmp_path / "out",
                      progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Malformed JSONL through the stages' own runner (eagle3pipe.stages.runner.main, in this process): each
# names file:line, the reason and the fix, exits 2 with no traceback, and writes nothing (the
# cases, MALFORMED_JSONL and MALFORMED_JSONL_FILES: helpers/malformed.py)


def _dvc_yaml_copy(tmp_path) -> Path:
    """dvc.yaml beside the test's outputs: a stage writes its store counts where dvc.yaml's
    top-level metrics say, relative to it, so never into the checkout."""
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    return tmp_path / "dvc.yaml"


def run_stage(name, run, paths: dict, capsys, tmp_path, **params) -> tuple[int, str]:
    """The stage `name` through eagle3pipe.stages.runner.main on the micro params (edited by
    `params`); (exit code, stderr)."""
    from eagle3pipe.stages import runner as stage

    f = tmp_path / "params.yaml"
    f.write_text(edit_params((ROOT / "tests/micro/params.yaml").read_text(), **params))
    argv = ["--params", str(f), "--dvc-yaml", str(_dvc_yaml_copy(tmp_path)), "--no-progress"]
    for k, v in paths.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    capsys.readouterr()
    rc = stage.main(name, run, paths=tuple(paths), argv=argv, exit=False)
    return rc, capsys.readouterr().err


def dataset_stage(tmp_path, micro_verifier, capsys, data: bytes | str | None
                  ) -> tuple[int, str, Path]:
    """The dataset stage on in.jsonl holding `data` ("dir": a directory, None: no file)."""
    src = tmp_path / "in.jsonl"
    if data == "dir":
        src.mkdir()
    elif data is not None:
        src.write_bytes(data)
    rc, err = run_stage("dataset", dataset.run, {"verifier": micro_verifier,
                                                 "out": tmp_path / "out",
                                                 "metrics": tmp_path / "metrics.json"},
                        capsys, tmp_path, source=json.dumps(str(src)), on_bad_input="error")
    return rc, err, src


def assert_refused(rc: int, err: str, where: str, tmp_path: Path, stage: str = "dataset"):
    assert rc == 2, err
    assert f"{stage}: error: {where}" in err, err
    assert "fix: " in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("case", MALFORMED_JSONL, ids=[c[0] for c in MALFORMED_JSONL])
def test_malformed_jsonl_line_refused_by_the_stage(micro_verifier, tmp_path, capsys, case):
    _, line, reason, detail = case
    rc, err, src = dataset_stage(tmp_path, micro_verifier, capsys,
                                 b"\n".join([GOOD_LINE, b"", line]) + b"\n")
    assert_refused(rc, err, f"{src}:3: {reason}: {detail}", tmp_path)


def test_malformed_jsonl_lines_are_skipped_by_reason(tokenizer, tmp_path):
    """on_bad_input: skip counts every case above under its reason and keeps the good line."""
    import collections

    f = tmp_path / "in.jsonl"
    f.write_bytes(b"\n".join([GOOD_LINE] + [c[1] for c in MALFORMED_JSONL]) + b"\n")
    prompts, report = prompt_src.jsonl_prompts(
        f, cfg(source=str(f), num_samples=100, max_seq_len=128, max_prompt_tokens=48),
        tokenizer, progress=False)
    assert [p.source for p in prompts] == ["jsonl-0000001"]
    want = collections.Counter(c[2] for c in MALFORMED_JSONL)
    assert report.skipped_by_reason == {r: want[r] for r in REASONS}


@pytest.mark.parametrize("case", MALFORMED_JSONL_FILES, ids=[c[0] for c in MALFORMED_JSONL_FILES])
def test_malformed_jsonl_file_refused_by_the_stage(micro_verifier, tmp_path, capsys, case):
    _, data, want = case
    rc, err, src = dataset_stage(tmp_path, micro_verifier, capsys, data)
    line = next(i for i, t in enumerate((tmp_path / "params.yaml").read_text().splitlines(), 1)
                if t.startswith("  source:"))
    assert_refused(rc, err, want.format(src=src, params=tmp_path / "params.yaml", line=line),
                   tmp_path)


def test_tolerated_jsonl_variants(tokenizer, tmp_path):
    """Not malformed: a UTF-8 byte-order mark on line 1, CRLF line ends, whitespace-only lines,
    keys the stage does not read; line numbers (the sample ids) still count every line."""
    extra = json.dumps({"id": "mine", "messages": [{**USER, "name": "bob"}], "meta": {"a": 1}})
    f = tmp_path / "in.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE + b"\r\n \t\r\n\r\n" + extra.encode() + b"\r\n")
    prompts, report = prompt_src.jsonl_prompts(f, cfg(source=str(f), on_bad_input="error"),
                                            tokenizer, progress=False)
    assert [p.source for p in prompts] == ["jsonl-0000001", "jsonl-0000004"]
    assert prompts[1].messages == [USER] and report.read == 2


@pytest.mark.slow
def test_malformed_jsonl_in_the_stage_process(micro_verifier, tmp_path):
    """The stage script in its own process: exit 2, file:line, no traceback, nothing written."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(GOOD_LINE + b'\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    params = tmp_path / "params.yaml"
    params.write_text(edit_params((ROOT / "tests/micro/params.yaml").read_text(),
                                  source=json.dumps(str(src)), on_bad_input="error"))
    r = subprocess.run([sys.executable, str(ROOT / "stages/dataset.py"), "--params", str(params),
                        "--dvc-yaml", str(_dvc_yaml_copy(tmp_path)), "--verifier", str(micro_verifier),
                        "--out", "out", "--metrics", "metrics.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert_refused(r.returncode, r.stderr, f"{src}:2: malformed_json: not UTF-8", tmp_path)


# ---------------------------------------------------------------------------------------------
# Malformed sample files (artifacts/dataset/*.jsonl, written by the dataset stage, read by vocab
# and extract through samples.read) through the vocab stage's runner (the cases,
# MALFORMED_SAMPLES: helpers/malformed.py)


@pytest.mark.parametrize("case", MALFORMED_SAMPLES, ids=[c[0] for c in MALFORMED_SAMPLES])
def test_malformed_sample_file_refused_by_the_vocab_stage(tmp_path, capsys, case):
    from eagle3pipe.stages.vocab import run as vocab
    _, line, detail = case
    f = tmp_path / "train.jsonl"
    f.write_bytes(json.dumps(SAMPLE).encode() + b"\n" + line + b"\n")
    config = tmp_path / "config.json"  # the fields VerifierInfo reads; vocab 512
    config.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 512}))
    rc, err = run_stage("vocab", vocab.run, {"dataset": f, "verifier_config": config,
                                             "out": tmp_path / "out"}, capsys, tmp_path)
    assert_refused(rc, err, f"{f}:2: {detail}", tmp_path, stage="vocab")


def test_settings_that_cannot_fit_are_refused(micro_verifier, tmp_path):
    with pytest.raises(DatasetError, match="dataset.max_seq_len"):
        dataset.build(cfg(max_prompt_tokens=60, max_new_tokens=40, max_seq_len=96),
                      engine_settings(), micro_verifier, tmp_path / "o", progress=False)
    with pytest.raises(DatasetError, match="max_position_embeddings"):
        dataset.build(cfg(max_seq_len=4096), engine_settings(), micro_verifier, tmp_path / "o",
                      progress=False)
    with pytest.raises(PromptsError, match="not found"):
        dataset.build(cfg(source=str(tmp_path / "missing.jsonl")), engine_settings(), micro_verifier,
                      tmp_path / "o", progress=False)


def test_assemble_closed_and_cut_replies(tokenizer):
    end = tokenizer.convert_tokens_to_ids(END)
    assert dataset.closing_token_id(tokenizer) == end
    msgs = [{"role": "user", "content": "def f():"}]
    p = prompt_src.Prompt(prompt_src.template_ids(tokenizer, msgs, add_generation_prompt=True),
                          "x", msgs)
    body = tokenizer("x = f(1)", add_special_tokens=False)["input_ids"]
    closed = dataset.assemble(p, body + [end], tokenizer, end)
    cut = dataset.assemble(p, body, tokenizer, end)
    assert closed == cut  # a cut reply gets the closing token the template writes
    assert closed["messages"][-1] == {"role": "assistant", "content": "x = f(1)"}
    assert closed["input_ids"] == p.ids + body + [end]
    assert closed["loss_mask"] == [0] * len(p.ids) + [1] * (len(body) + 1)
    # here the sample equals the chat template's tokenization of its messages; a reply that
    # starts with whitespace would not (BPE merges the generation prompt's "\n" with it), and
    # input_ids keep the tokens the verifier really saw and produced
    assert closed["input_ids"] == prompt_src.template_ids(tokenizer, closed["messages"],
                                                       add_generation_prompt=False)


def test_split_is_deterministic_and_stable():
    samples = [{"id": f"s{i:03d}"} for i in range(200)]
    train, evals = dataset.split(samples, 0.1, seed=0)
    assert 5 < len(evals) < 40 and len(train) + len(evals) == 200
    again = dataset.split(list(reversed(samples)), 0.1, seed=0)[1]
    assert {s["id"] for s in again} == {s["id"] for s in evals}
    more = dataset.split(samples + [{"id": "new"}], 0.1, seed=0)[1]
    assert {s["id"] for s in evals} <= {s["id"] for s in more}  # adding samples moves none
    assert {s["id"] for s in dataset.split(samples, 0.1, seed=1)[1]} != {s["id"] for s in evals}
    assert dataset.split(samples[:2], 0.01, seed=0)[1] != []  # at least one eval sample
    assert len(dataset.split(samples[:2], 0.99, seed=0)[0]) == 1  # at least one train sample
    assert dataset.split(samples, 0.0, seed=0)[1] == []


# ---------------------------------------------------------------------------------------------
# The stage scripts end to end


def edit_params(text: str, **values) -> str:
    for key, value in values.items():
        text, n = re.subn(rf"(?m)^(\s+{key}:)[^\n#]*", rf"\g<1> {value}  ", text)
        assert n == 1, key
    return text


@pytest.mark.slow
def test_dataset_and_vocab_stage_scripts(micro_verifier, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(edit_params((ROOT / "params.yaml").read_text(), num_samples=4,
                                  max_prompt_tokens=32, max_new_tokens=8, max_seq_len=64,
                                  eval_fraction=0.25, draft_vocab_size=64))
    trace = tmp_path / "trace.jsonl"
    env = dict(os.environ, EAGLE3PIPE_PARAMS_TRACE=str(trace))
    common = ["--params", str(params), "--dvc-yaml", str(_dvc_yaml_copy(tmp_path))]
    r = subprocess.run([sys.executable, str(ROOT / "stages/dataset.py"), *common,
                        "--verifier", str(micro_verifier), "--out", "artifacts/dataset",
                        "--metrics", "metrics/dataset.json", "--no-progress"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "metrics/dataset.json").read_text())
    assert (m["read"], m["kept"], m["train"] + m["eval"]) == (4, 4, 4)
    assert len(dataset.read_jsonl(tmp_path / "artifacts/dataset/train.jsonl")) == m["train"]
    r = subprocess.run([sys.executable, str(ROOT / "stages/vocab.py"), *common,
                        "--dataset", "artifacts/dataset/train.jsonl",
                        "--verifier-config", str(micro_verifier / "config.json"),
                        "--out", "artifacts/vocab", "--no-progress"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    from eagle3pipe.draft import vocab_map
    d2t, t2d = vocab_map.load(tmp_path / "artifacts/vocab")
    assert d2t.shape == (64,) and t2d.shape == (512,) and int(t2d.sum()) == 64
    stats = json.loads((tmp_path / "artifacts/vocab/stats.json").read_text())
    assert stats["masked_tokens"] > 0 and stats["draft_vocab_size"] == 64
    reads = {}
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        reads.setdefault(rec["stage"], set()).update(rec["keys"])
    assert reads["vocab"] == {"draft.draft_vocab_size"}
    assert reads["dataset"] and all(k.startswith(("dataset.", "vllm.")) for k in reads["dataset"])
    assert "vllm.tensor_parallel_size" in reads["dataset"]
    # a bad params value fails cleanly, naming the file
    params.write_text(edit_params(params.read_text(), max_seq_len=16))
    r = subprocess.run([sys.executable, str(ROOT / "stages/dataset.py"), *common,
                        "--verifier", str(micro_verifier), "--out", "artifacts/dataset2",
                        "--metrics", "m2.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    line = next(i for i, t in enumerate(params.read_text().splitlines(), 1)
                if t.strip().startswith("max_seq_len:"))
    assert r.returncode == 2 and f"{params}:{line}: dataset.max_seq_len" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "artifacts/dataset2").exists()
    assert "Traceback" not in r.stderr and not (tmp_path / "artifacts/dataset2").exists()
    shutil.rmtree(tmp_path / "artifacts")
