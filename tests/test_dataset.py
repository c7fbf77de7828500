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
from eagle3pipe.stages.dataset import output, served, turns
from eagle3pipe.data.samples import line
from eagle3pipe.runtime.jsonio import dumps
from eagle3pipe.data import conversations as conv
from eagle3pipe.data import prompts as prompt_src
from eagle3pipe.data.conversations import ConversationsError
from eagle3pipe.errors import ParamsAt
from eagle3pipe.stages.dataset.run import DatasetError
from eagle3pipe.verifier.handle import Verifier

from helpers.malformed import (GOOD, GOOD_LINE, JSONL_KEY_OF, MALFORMED_JSONL,
                               MALFORMED_JSONL_FILES, MALFORMED_SAMPLES, SAMPLE, USER)
from helpers.micro import engine_settings

ROOT = Path(__file__).resolve().parents[1]
END = "<|end|>"


def cfg(**kw):
    base = dict(source=None, format=None, max_turns=None, chat_template_kwargs={},
                num_samples=5, max_prompt_tokens=40,
                max_new_tokens=12,
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
        assert ids[:n_prompt] == prompt_src.template_ids(
            tokenizer, s["messages"][:-1], add_generation_prompt=True, template_kwargs={})


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
# Conversation sources (dataset.source, dataset.format): one sample per user turn


SYSTEM = {"role": "system", "content": "You write Python."}
THREE = [SYSTEM, {"role": "user", "content": "import os"},
         {"role": "assistant", "content": "dataset reply one, dropped"},
         {"role": "user", "content": "def add(a, b):"},
         {"role": "assistant", "content": "dataset reply two, dropped"},
         {"role": "user", "content": "class Stack:"},
         {"role": "assistant", "content": "dataset reply three, dropped"}]
FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def write(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conv_cfg(src, **kw):
    base = dict(source=str(src), format="messages", num_samples=10, eval_fraction=0.0,
                max_prompt_tokens=80)
    return cfg(**(base | kw))


def counts(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.integration
def test_each_user_turn_is_one_sample_answered_with_the_verifiers_own_history(
        micro_verifier, tokenizer, tmp_path):
    """Three user turns, three samples; turn d's prompt holds the verifier's own replies to
    turns 1..d-1 (as decoded), never the dataset's; the conversation stays in one split."""
    other = {"messages": [{"role": "user", "content": "x = 1"}]}
    f = write(tmp_path / "conversations/chat.jsonl", [{"messages": THREE}, other])
    out = tmp_path / "dataset"
    metrics = dataset.build(conv_cfg(f, eval_fraction=0.5), engine_settings(), micro_verifier,
                            out, progress=False, record_to=tmp_path / "counts.json")
    samples = {s["id"]: s for s in samples_of(out)}
    ids = [f"{f}:1#1", f"{f}:1#2", f"{f}:1#3"]
    assert sorted(samples) == sorted(ids + [f"{f}:2#1"])
    assert (metrics["read"], metrics["kept"], metrics["skipped"]) == (2, 2, 0)
    assert metrics["samples"] == 4
    assert metrics["turns_by_depth"] == {"1": 2, "2": 1, "3": 1}
    assert metrics["conversations_stopped_at_prompt_limit"] == 0
    assert counts(tmp_path / "counts.json")["computed"] == 4
    check_masks(samples.values(), tokenizer)
    first, second, third = (samples[i] for i in ids)
    reply1 = first["messages"][-1]["content"]
    assert reply1 and reply1 != "dataset reply one, dropped"
    assert second["messages"][:3] == [SYSTEM, THREE[1], {"role": "assistant", "content": reply1}]
    n = second["loss_mask"].index(1)
    prompt2 = tokenizer.decode(second["input_ids"][:n], skip_special_tokens=False)
    assert reply1 in prompt2 and "dropped" not in prompt2
    assert third["messages"][:5] == second["messages"]  # reply 2, the verifier's
    assert third["messages"][5] == THREE[5]
    # the first reply's tokens as generated are in sample 1; later samples re-render its text
    assert first["input_ids"][:first["loss_mask"].index(1)] == prompt_src.template_ids(
        tokenizer, first["messages"][:-1], add_generation_prompt=True, template_kwargs={})
    train = {s["id"] for s in dataset.read_jsonl(out / "train.jsonl")}
    assert set(ids) <= train or not set(ids) & train  # one conversation, one split
    assert metrics["train"] + metrics["eval"] == 4 and metrics["eval"] >= 1
    # a history too long for max_prompt_tokens even with an empty user turn: the conversation
    # stops at that depth, counted
    short = dataset.build(conv_cfg(f, max_prompt_tokens=40), engine_settings(), micro_verifier,
                          tmp_path / "short", progress=False)
    assert short["conversations_stopped_at_prompt_limit"] == 1 and short["kept"] == 2
    assert short["samples"] == sum(short["turns_by_depth"].values()) < 4


# a reasoning verifier's template, as Qwen3's: enable_thinking primes "<think>" after the
# generation prompt (the reply is reasoning until it closes the block), false writes an empty
# block; earlier replies keep only what follows their "</think>"
REASONING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}<|end|>\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n"
    "{{ m['content'].split('</think>')[-1] }}<|end|>\n"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.mark.integration
def test_chat_template_kwargs_reach_every_turn_and_generated_reasoning_is_supervised(
        micro_verifier_copy, tokenizer, tmp_path):
    """dataset.chat_template_kwargs reach the template at every depth: thinking on, each
    prompt ends in the template's priming "<think>" (prompt, not supervised) and every reply
    token is reasoning (supervised, counted); thinking off, the template's empty think block is
    prompt and no reply token is reasoning. The two settings are different store entries."""
    (micro_verifier_copy / "chat_template.jinja").write_text(REASONING_TEMPLATE)
    f = write(tmp_path / "conversations/chat.jsonl",
              [{"messages": THREE}, {"messages": [{"role": "user", "content": "x = 1"}]}])
    tok = Verifier(micro_verifier_copy).tokenizer()
    runs = {}
    for on in (True, False):
        out = tmp_path / f"thinking-{on}"
        m = dataset.build(conv_cfg(f, chat_template_kwargs={"enable_thinking": on},
                                   max_prompt_tokens=120, max_seq_len=160),
                          engine_settings(), micro_verifier_copy, out, progress=False,
                          record_to=tmp_path / f"counts-{on}.json")
        assert counts(tmp_path / f"counts-{on}.json")["computed"] == m["samples"] == 4
        runs[on] = m, samples_of(out)
    for on, (m, samples) in runs.items():
        reasoning = 0
        for s in samples:
            n = s["loss_mask"].index(1)
            assert s["input_ids"][:n] == prompt_src.template_ids(
                tok, s["messages"][:-1], add_generation_prompt=True,
                template_kwargs={"enable_thinking": on})
            prompt = tok.decode(s["input_ids"][:n], skip_special_tokens=False)
            assert prompt.endswith("<think>\n" if on else "<think>\n\n</think>\n\n")
            assert "</think>" not in s["messages"][-1]["content"]  # never closed here
            reasoning += sum(s["loss_mask"]) - 1  # all but the closing token
        assert m["reasoning_tokens"] == (reasoning if on else 0) and reasoning > 0
        assert m["reasoning_tags"] == ["<think>", "</think>"]
        assert m["tool_calls"] == 0 and m["tool_call_tags"] == ["<tool_call>", "</tool_call>"]


# renders string content and content parts differently; vLLM sees the loop over content, so
# it sends text as parts ([{"type": "text", "text": ...}]: hf.py _detect_content_format)
PARTS_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
    "<|end|>\n{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}<|end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.integration
def test_prompts_that_vllm_renders_otherwise_stop_the_stage_before_any_output(
        micro_verifier_copy, tmp_path):
    """A template that renders string content and content parts differently: vLLM's server
    sends parts, transformers strings; the stage names the sample, the position and both
    tokens, and writes nothing. (Every other dataset test passes the same check.)"""
    (micro_verifier_copy / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    tok = Verifier(micro_verifier_copy).tokenizer()
    with pytest.raises(served.RenderingMismatch) as e:
        dataset.build(cfg(), engine_settings(), micro_verifier_copy, tmp_path / "d",
                      progress=False)
    msg = str(e.value)
    n = len(tok("<|user|>\n", add_special_tokens=False)["input_ids"])
    assert msg.startswith("5 of 5 prompts differ from what vLLM's chat rendering gives"), msg
    # the first token of the user's text, unless BPE merged it with the "\n" before it
    assert re.search(r"stdlib-000001: the prompt the dataset stage rendered differs from "
                     rf"vLLM's chat rendering at position {n}: '.+' \(id \d+\) here, "
                     r"'\[' \(id \d+\) in vLLM", msg), msg
    assert "fix: make the verifier's chat template render the same text" in msg
    assert not (tmp_path / "d").exists()


def test_reasoning_tokens_are_the_reply_tokens_inside_a_think_block(tokenizer):
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    think, plain = ids("<|assistant|>\n<think>\n"), ids("<|assistant|>\n")
    body, close, after = ids("abc def"), ids("</think>"), ids(" xyz")
    assert turns.reasoning_tokens(tokenizer, think, body + close + after) == len(body)
    assert turns.reasoning_tokens(tokenizer, plain, body + close + after) == 0
    assert turns.reasoning_tokens(tokenizer, plain, ids("<think>") + body) == len(body)
    empty = ids("<|assistant|>\n<think>\n\n</think>\n\n")
    assert turns.reasoning_tokens(tokenizer, empty, body) == 0
    # given the reply's text (Totals.add), the same counts; without the opening tag in the
    # reply or an open block in the prompt its tokens are not decoded one by one
    for prompt, reply in ((think, body + close + after), (plain, body + close + after),
                          (plain, ids("<think>") + body), (empty, body)):
        text = tokenizer.decode(reply, skip_special_tokens=False)
        assert (turns.reasoning_tokens(tokenizer, prompt, reply, text)
                == turns.reasoning_tokens(tokenizer, prompt, reply))


def test_tool_calls_are_the_tool_call_blocks_a_reply_opens(tokenizer):
    """metrics/dataset.json `tool_calls`: the Hermes blocks (turns.TOOL_CALL_TAGS) the
    verifier's replies hold, matched on text whatever the tokens."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    reply = tokenizer(f"Let me check.\n{call}\n{call}", add_special_tokens=False)["input_ids"]
    assert turns.tool_calls(tokenizer, reply) == 2
    assert turns.tool_calls(tokenizer, tokenizer("no call here", add_special_tokens=False)
                            ["input_ids"]) == 0


@pytest.mark.integration
def test_formats_give_identical_files_and_max_turns_caps(micro_verifier, tmp_path,
                                                         monkeypatch):
    """The same conversation as messages and as sharegpt (the same file name in two folders)
    gives byte-identical outputs from the store alone; max_turns: 2 answers two turns."""
    sharegpt = [{"from": FROM[m["role"]], "value": m["content"]} for m in THREE]
    rows = {"m": ("messages", {"messages": THREE}), "s": ("sharegpt", {"conversations": sharegpt})}
    outs = {}
    for name, (fmt, row) in rows.items():
        write(tmp_path / name / "conversations/chat.jsonl", [row])
        monkeypatch.chdir(tmp_path / name)
        dataset.build(conv_cfg("conversations/chat.jsonl", format=fmt), engine_settings(),
                      micro_verifier, tmp_path / name / "out", progress=False,
                      record_to=tmp_path / name / "counts.json")
        outs[name] = tmp_path / name / "out"
    for f in ("train.jsonl", "eval.jsonl", "store_keys.json"):
        assert (outs["m"] / f).read_bytes() == (outs["s"] / f).read_bytes(), f
    assert counts(tmp_path / "m/counts.json")["computed"] == 3
    assert counts(tmp_path / "s/counts.json") == {"computed": 0, "reused": 3, "skipped": 0,
                                                       "total": 3}
    monkeypatch.chdir(tmp_path / "m")
    metrics = dataset.build(conv_cfg("conversations/chat.jsonl", max_turns=2),
                            engine_settings(), micro_verifier, tmp_path / "two",
                            progress=False, record_to=tmp_path / "two.json")
    assert metrics["turns_by_depth"] == {"1": 1, "2": 1} and metrics["samples"] == 2
    assert counts(tmp_path / "two.json")["computed"] == 0  # the same prompts: reused
    full = [s for s in samples_of(outs["m"]) if not s["id"].endswith("#3")]
    assert samples_of(tmp_path / "two") == full


@pytest.mark.integration
def test_editing_one_conversation_regenerates_only_its_turns(micro_verifier, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"def f{i}():"},
                          {"role": "user", "content": f"x{i} = f{i}()"}]} for i in range(3)]
    f = write(tmp_path / "conversations/chat.jsonl", rows)
    c = conv_cfg(f)
    dataset.build(c, engine_settings(), micro_verifier, tmp_path / "a", progress=False,
                  record_to=tmp_path / "a.json")
    assert counts(tmp_path / "a.json")["computed"] == 6
    rows[1]["messages"][0]["content"] = "def g():"
    write(f, rows)
    dataset.build(c, engine_settings(), micro_verifier, tmp_path / "b", progress=False,
                  record_to=tmp_path / "b.json")
    assert counts(tmp_path / "b.json") == {"computed": 2, "reused": 4, "skipped": 0, "total": 6}
    a, b = ({s["id"]: s for s in samples_of(tmp_path / d)} for d in "ab")
    assert {i for i in a if a[i] != b[i]} == {f"{f}:2#1", f"{f}:2#2"}


@pytest.mark.integration
def test_bad_rows_skipped_counted_and_reported(micro_verifier, tokenizer, tmp_path):
    """on_bad_input: skip counts each bad row under its reason (the reader's and the stage's
    own), cuts a conversation at its first tool call and counts conversations, not turns."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tooled = {"messages": [{"role": "user", "content": "import os"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                           {"role": "user", "content": "never answered"}],
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    long_first = {"messages": [{"role": "system", "content": "import os\n" * 12},
                               {"role": "user", "content": "go"}]}
    truncated = {"messages": [{"role": "user", "content": "value = compute()\n" * 10}]}
    f = write(tmp_path / "conversations/in.jsonl", [
        GOOD, '{"messages": [', {"messages": []}, "", long_first, tooled, truncated, GOOD])
    out = tmp_path / "dataset"
    metrics = dataset.build(conv_cfg(f, num_samples=6, max_prompt_tokens=40), engine_settings(),
                            micro_verifier,
                            out, progress=False)
    assert metrics["read"] == 6 and metrics["kept"] == 3 and metrics["skipped"] == 3
    assert metrics["read"] == metrics["kept"] + sum(metrics["skipped_by_reason"].values())
    assert set(metrics["skipped_by_reason"]) == set(conv.REASONS) | set(turns.STAGE_REASONS)
    assert {k: n for k, n in metrics["skipped_by_reason"].items() if n} == {
        "malformed_json": 1, "empty_conversation": 1, "prompt_too_long": 1}
    assert metrics["skipped_examples"]["malformed_json"][0].startswith(f"{f}:2: ")
    assert metrics["skipped_examples"]["prompt_too_long"][0].startswith(f"{f}:5: ")
    assert metrics["conversations_cut_at_tool_call"] == 1
    assert metrics["samples"] == 3 and metrics["turns_by_depth"] == {"1": 3}
    assert metrics["prompts_truncated"] == 1
    samples = {s["id"]: s for s in dataset.read_jsonl(out / "train.jsonl")}
    assert sorted(samples) == [f"{f}:1#1", f"{f}:6#1", f"{f}:7#1"]  # line 8: not read
    check_masks([samples[f"{f}:1#1"], samples[f"{f}:7#1"]], tokenizer)
    tool = samples[f"{f}:6#1"]  # cut at its tool call, rendered with its tools schema
    n = tool["loss_mask"].index(1)
    assert tool["input_ids"][:n] == prompt_src.template_ids(
        tokenizer, tool["messages"][:-1], add_generation_prompt=True, template_kwargs={},
        tools=tooled["tools"])


def test_all_rows_bad_is_a_clear_error(micro_verifier, tmp_path):
    f = write(tmp_path / "bad.jsonl", ['{"messages": [', {"messages": []}, {"turns": ["x"]}])
    with pytest.raises(DatasetError, match="no usable conversation among 3 read"):
        dataset.build(conv_cfg(f), engine_settings(), micro_verifier, tmp_path / "out",
                      progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Malformed conversation rows through the stages' own runner (eagle3pipe.stages.runner.main, in
# this process): each names file:line, the key and the fix, exits 2 with no traceback, and
# writes nothing (the cases, MALFORMED_JSONL and MALFORMED_JSONL_FILES: helpers/malformed.py)


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


SOURCE = Path("conversations/in.jsonl")


def dataset_stage(tmp_path, micro_verifier, capsys, monkeypatch, data: bytes | str | None,
                  source: str = str(SOURCE)) -> tuple[int, str, Path]:
    """The dataset stage, run in tmp_path, on conversations/in.jsonl holding `data` ("dir": a
    directory, None: no file)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conversations").mkdir()
    src = tmp_path / SOURCE
    if data == "dir":
        src.mkdir()
    elif data is not None:
        src.write_bytes(data)
    rc, err = run_stage("dataset", dataset.run, {"verifier": micro_verifier,
                                                 "out": tmp_path / "out",
                                                 "metrics": tmp_path / "metrics.json"},
                        capsys, tmp_path, source=json.dumps(source), format="messages",
                        on_bad_input="error")
    return rc, err, SOURCE


def assert_refused(rc: int, err: str, where: str, tmp_path: Path, stage: str = "dataset"):
    assert rc == 2, err
    assert f"{stage}: error: {where}" in err, err
    assert "fix: " in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "metrics.json").exists()


def params_line(tmp_path: Path, key: str) -> int:
    return next(i for i, t in enumerate((tmp_path / "params.yaml").read_text().splitlines(), 1)
                if t.startswith(f"  {key}:"))


KEY_OF = JSONL_KEY_OF


@pytest.mark.parametrize("case", MALFORMED_JSONL, ids=[c[0] for c in MALFORMED_JSONL])
def test_malformed_jsonl_line_refused_by_the_stage(micro_verifier, tmp_path, capsys,
                                                   monkeypatch, case):
    _, line, reason, detail = case
    rc, err, src = dataset_stage(tmp_path, micro_verifier, capsys, monkeypatch,
                                 b"\n".join([GOOD_LINE, b"", line]) + b"\n")
    key = KEY_OF.get(reason, "source")
    at = f"{tmp_path / 'params.yaml'}:{params_line(tmp_path, key)}"
    assert_refused(rc, err, f"{src}:3: dataset.{key} ({at}): {detail}", tmp_path)


def test_malformed_jsonl_lines_are_skipped_by_reason(micro_verifier, tokenizer, tmp_path):
    """on_bad_input: skip counts every case above under its reason and keeps the good line
    (the stage's own reason, prompt_too_long, is found at depth 1 before any engine starts)."""
    import collections

    f = tmp_path / "in.jsonl"
    f.write_bytes(b"\n".join([GOOD_LINE] + [c[1] for c in MALFORMED_JSONL]) + b"\n")
    c = conv_cfg(f, num_samples=100, max_seq_len=128, max_prompt_tokens=48)
    r = turns.read(c)
    kept, prompts, stopped = turns.prompts_at(r, next(r.batches(1000)), 1, tokenizer, c, ParamsAt())
    assert [p.source for p in prompts] == [f"{f}:1#1"] and stopped == 0
    want = collections.Counter(case[2] for case in MALFORMED_JSONL)
    assert turns.skipped_by_reason(r) == {k: want[k] for k in sorted(
        set(conv.REASONS) | set(turns.STAGE_REASONS))}


@pytest.mark.parametrize("case", MALFORMED_JSONL_FILES, ids=[c[0] for c in MALFORMED_JSONL_FILES])
def test_malformed_jsonl_file_refused_by_the_stage(micro_verifier, tmp_path, capsys,
                                                   monkeypatch, case):
    _, data, want = case
    rc, err, src = dataset_stage(tmp_path, micro_verifier, capsys, monkeypatch, data)
    assert_refused(rc, err, want.format(src=src, params=tmp_path / "params.yaml",
                                        line=params_line(tmp_path, "source")), tmp_path)


@pytest.mark.parametrize("source", ["elsewhere.jsonl", "conversations/../elsewhere.jsonl",
                                    "conversations", "ABS"])
def test_source_outside_conversations_refused_by_the_stage(micro_verifier, tmp_path, capsys,
                                                           monkeypatch, source):
    """run() keeps dataset.source inside conversations/, the stage's DVC dep (build() takes any
    path); a file elsewhere would not rerun the stage when it changes."""
    (tmp_path / "elsewhere.jsonl").write_bytes(GOOD_LINE + b"\n")
    source = str(tmp_path / "elsewhere.jsonl") if source == "ABS" else source
    rc, err, _ = dataset_stage(tmp_path, micro_verifier, capsys, monkeypatch, GOOD_LINE,
                               source=source)
    line = params_line(tmp_path, "source")
    assert_refused(rc, err, f"{tmp_path / 'params.yaml'}:{line}: dataset.source: {source} is "
                            "not inside conversations/", tmp_path)
    assert "fix: put the file under conversations/" in err


@pytest.mark.parametrize("source,fmt,turns_,key", [
    ('"conversations/in.jsonl"', "null", "null", "format"),
    ("null", "messages", "null", "format"),
    ("null", "null", "2", "max_turns"),
])
def test_source_and_format_cross_checked(tmp_path, source, fmt, turns_, key):
    """A source's format is declared, never guessed; the stdlib source has none."""
    from eagle3pipe.config import params as P

    f = tmp_path / "params.yaml"
    f.write_text(edit_params((ROOT / "tests/micro/params.yaml").read_text(), source=source,
                             format=fmt, max_turns=turns_))
    with pytest.raises(Exception) as e:
        P.load(f)
    line = params_line(tmp_path, key)
    assert f"{f}:{line}: dataset.{key}: " in str(e.value) and "fix: " in str(e.value)


def test_tolerated_jsonl_variants(tokenizer, tmp_path):
    """Not malformed: a UTF-8 byte-order mark on line 1, CRLF line ends, whitespace-only lines,
    keys the stage does not read; line numbers (the sample ids) still count every line."""
    extra = json.dumps({"id": "mine", "messages": [{**USER, "name": "bob"}], "meta": {"a": 1}})
    f = tmp_path / "in.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE + b"\r\n \t\r\n\r\n" + extra.encode() + b"\r\n")
    c = conv_cfg(f, on_bad_input="error")
    r = turns.read(c)
    _, prompts, _ = turns.prompts_at(r, next(r.batches(1000)), 1, tokenizer, c, ParamsAt())
    assert [p.source for p in prompts] == [f"{f}:1#1", f"{f}:4#1"]
    assert prompts[1].messages == [{**USER, "name": "bob"}] and r.report.read == 2


@pytest.mark.slow
def test_malformed_jsonl_in_the_stage_process(micro_verifier, tmp_path):
    """The stage script in its own process: exit 2, file:line, no traceback, nothing written."""
    src = tmp_path / "conversations/in.jsonl"
    src.parent.mkdir()
    src.write_bytes(GOOD_LINE + b'\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    params = tmp_path / "params.yaml"
    params.write_text(edit_params((ROOT / "tests/micro/params.yaml").read_text(),
                                  source='"conversations/in.jsonl"', format="messages",
                                  on_bad_input="error"))
    r = subprocess.run([sys.executable, str(ROOT / "stages/dataset.py"), "--params", str(params),
                        "--dvc-yaml", str(_dvc_yaml_copy(tmp_path)), "--verifier", str(micro_verifier),
                        "--out", "out", "--metrics", "metrics.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    line = next(i for i, t in enumerate(params.read_text().splitlines(), 1)
                if t.startswith("  source:"))
    assert_refused(r.returncode, r.stderr, f"conversations/in.jsonl:2: dataset.source "
                   f"({params}:{line}): not UTF-8", tmp_path)


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
    with pytest.raises(ConversationsError, match="not found"):
        dataset.build(cfg(source=str(tmp_path / "missing.jsonl"), format="messages"),
                      engine_settings(), micro_verifier,
                      tmp_path / "o", progress=False)


def test_assemble_closed_and_cut_replies(tokenizer):
    end = tokenizer.convert_tokens_to_ids(END)
    assert dataset.closing_token_id(tokenizer, {}) == end
    msgs = [{"role": "user", "content": "def f():"}]
    p = prompt_src.Prompt(prompt_src.template_ids(tokenizer, msgs, add_generation_prompt=True,
                                                   template_kwargs={}),
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
    assert closed["input_ids"] == prompt_src.template_ids(
        tokenizer, closed["messages"], add_generation_prompt=False, template_kwargs={})


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 0.99])
def test_the_streamed_split_writes_what_the_in_memory_split_gives(tmp_path, fraction):
    """SplitWriter (the stage's, sample by sample) against split(): the same files and store
    keys, including the moves that give each split a conversation (fractions 0.01 and 0.99
    leave one split empty by the hash alone)."""
    samples = [{"id": f"c.jsonl:{i}#{d}", "input_ids": [i, d], "loss_mask": [0, 1]}
               for i in range(5) for d in range(1, i % 3 + 2)]
    keys = {s["id"]: f"{n:064x}" for n, s in enumerate(samples)}  # data.store.key's shape
    with output.SplitWriter(tmp_path, fraction, 0, group=output.group_of) as w:
        for s in samples:
            w.add(s, keys[s["id"]])
        counts = w.finish()
    train, evals = output.split(samples, fraction, 0, group=output.group_of)
    assert counts == (len(train), len(evals))
    assert bool(evals) == (fraction > 0) and train
    for name, want in (("train", train), ("eval", evals)):
        assert (tmp_path / f"{name}.jsonl").read_text() == "".join(map(line, want))
    assert (tmp_path / "store_keys.json").read_text() == dumps(
        {"eval": [keys[s["id"]] for s in evals], "train": [keys[s["id"]] for s in train]})


def test_the_split_writer_keeps_no_key_alive(tmp_path):
    """32 bytes per sample, not the key strings (bench/conversations.py's memory figure)."""
    import sys

    key = "".join(["a"] * 64)  # a string of its own (not interned), data.store.key's shape
    before = sys.getrefcount(key)
    with output.SplitWriter(tmp_path, 0.0, 0) as w:
        w.add({"id": "s0", "input_ids": [1], "loss_mask": [1]}, key)
        assert sys.getrefcount(key) == before
        assert w.finish() == (1, 0)
    assert json.loads((tmp_path / "store_keys.json").read_text()) == {"eval": [],
                                                                      "train": [key]}
    with output.SplitWriter(tmp_path, 0.0, 0) as w, pytest.raises(ValueError, match="store key"):
        w.add({"id": "s1", "input_ids": [1], "loss_mask": [1]}, "key-1")


def test_split_is_deterministic_and_stable():
    samples = [{"id": f"s{i:03d}"} for i in range(200)]
    train, evals = output.split(samples, 0.1, seed=0)
    assert 5 < len(evals) < 40 and len(train) + len(evals) == 200
    again = output.split(list(reversed(samples)), 0.1, seed=0)[1]
    assert {s["id"] for s in again} == {s["id"] for s in evals}
    more = output.split(samples + [{"id": "new"}], 0.1, seed=0)[1]
    assert {s["id"] for s in evals} <= {s["id"] for s in more}  # adding samples moves none
    assert {s["id"] for s in output.split(samples, 0.1, seed=1)[1]} != {s["id"] for s in evals}
    assert output.split(samples[:2], 0.01, seed=0)[1] != []  # at least one eval sample
    assert len(output.split(samples[:2], 0.99, seed=0)[0]) == 1  # at least one train sample
    assert output.split(samples, 0.0, seed=0)[1] == []


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


def test_a_rows_tools_reach_the_chat_template(micro_verifier, tmp_path):
    """The row's OpenAI tools schema is passed to apply_chat_template(tools=...) for every turn
    (the embedded template ignores tools; this one renders their names)."""
    from eagle3pipe.verifier.handle import Verifier

    tok = Verifier(micro_verifier).tokenizer()  # a fresh instance: its template is changed
    tok.chat_template = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}"
                         "{% endfor %}\n{% endif %}" + tok.chat_template)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    f = write(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "x"}],
                                       "tools": tools}])
    c = conv_cfg(f)
    r = turns.read(c)
    _, (p,), _ = turns.prompts_at(r, next(r.batches(1000)), 1, tok, c, ParamsAt())
    assert tok.decode(p.ids, skip_special_tokens=False).startswith("tools: weather<|user|>")


@pytest.mark.integration
def test_stage_runs_a_source_inside_conversations(micro_verifier, tmp_path, capsys,
                                                  monkeypatch):
    """run() on conversations/in.jsonl (relative to the project root, as dvc.yaml runs it):
    one sample per user turn, ids named by the relative path, metrics that add up."""
    two = json.dumps({"messages": [USER, {"role": "assistant", "content": "a"},
                                   {"role": "user", "content": "y = 2"}]}).encode()
    rc, err, src = dataset_stage(tmp_path, micro_verifier, capsys, monkeypatch,
                                 b"\n".join([GOOD_LINE, two, GOOD_LINE]) + b"\n")
    assert rc == 0, err
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert (m["read"], m["kept"], m["skipped"], m["samples"]) == (3, 3, 0, 4)
    assert m["turns_by_depth"] == {"1": 3, "2": 1} and m["format"] == "messages"
    ids = {s["id"] for s in samples_of(tmp_path / "out")}
    assert ids == {f"{src}:1#1", f"{src}:2#1", f"{src}:2#2", f"{src}:3#1"}
