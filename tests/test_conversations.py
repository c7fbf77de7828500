"""eagle3pipe.data.conversations: each format and source read into one Conversation form; each
bad-input reason counted under skip and refused under error with file:line and the fix."""
from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pytest

from eagle3pipe.data import conversations as conv
from eagle3pipe.data.conversations import BadInputError, ConversationsError

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]
FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
SHAREGPT = [{"from": FROM[m["role"]], "value": m["content"]}
            | {k: v for k, v in m.items() if k in ("tool_calls", "tool_call_id")}
            for m in MESSAGES]
USER = {"role": "user", "content": "hi"}
GOOD = {"messages": [USER]}


def write(tmp_path, rows, name="in.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_all(path, fmt="messages", **kw):
    reader = conv.read(path, fmt, on_bad_input=kw.pop("on_bad_input", "error"), **kw)
    return list(reader), reader.report


def test_messages_read_with_tools_tool_calls_and_domain(tmp_path):
    path = write(tmp_path, [{"messages": MESSAGES, "tools": TOOLS, "domain": "weather"}, "",
                            {"messages": [USER, {"role": "assistant", "content": "yo"}]}])
    (a, b), report = read_all(path)
    assert (a.source, b.source) == (f"{path}:1", f"{path}:3")  # blank line 2 still counts
    assert a.tools == tuple(TOOLS) and a.category == "weather" and a.user_turns == 3
    assert a.messages[4] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert a.messages[5] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert b.messages == (USER, {"role": "assistant", "content": "yo"})
    assert (b.tools, b.category, b.user_turns) == (None, None, 1)
    assert (report.read, report.kept, sum(report.skipped.values())) == (2, 2, 0)


def test_messages_and_sharegpt_give_equal_conversations(tmp_path):
    m = write(tmp_path, [{"messages": MESSAGES, "tools": TOOLS}], "m.jsonl")
    s = write(tmp_path, [{"conversations": SHAREGPT, "tools": TOOLS}], "s.jsonl")
    (cm,), _ = read_all(m)
    (cs,), _ = read_all(s, "sharegpt")
    assert cm.user_turns == 3 and cm.source != cs.source
    assert cm == dataclasses.replace(cs, source=cm.source)


def test_sharegpt_accepts_user_and_assistant_as_from(tmp_path):
    path = write(tmp_path, [{"conversations": [{"from": "user", "value": "q"},
                                               {"from": "assistant", "value": "r"}]}])
    (c,), _ = read_all(path, "sharegpt")
    assert [m["role"] for m in c.messages] == ["user", "assistant"]


def test_mtbench_gives_user_turns_and_category(tmp_path):
    path = write(tmp_path, [{"question_id": 81, "category": "writing", "turns": ["q1", "q2"]}])
    (c,), _ = read_all(path, "mtbench")
    assert c.messages == ({"role": "user", "content": "q1"}, {"role": "user", "content": "q2"})
    assert (c.category, c.user_turns, c.tools) == ("writing", 2, None)


def test_text_parts_are_joined_as_vllm_joins_them(tmp_path):
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, "c"]
    path = write(tmp_path, [{"messages": [{"role": "user", "content": parts}]}])
    (c,), _ = read_all(path)
    assert c.messages[0]["content"] == "a\nb\nc"


def test_tool_call_arguments_kept_as_given(tmp_path):
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "index": 0}
    path = write(tmp_path, [{"messages": [USER, {"role": "assistant", "tool_calls": [call]},
                                          {"role": "tool", "content": "r", "name": "f"}]}])
    (c,), _ = read_all(path)
    assert c.messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert c.messages[2] == {"role": "tool", "content": "r", "name": "f"}


def test_bom_skipped_and_empty_tool_calls_dropped(tmp_path):
    row = {"messages": [USER, {"role": "assistant", "content": "a", "tool_calls": []}]}
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(row).encode() + b"\n")
    (c,), _ = read_all(path)
    assert c.messages[1] == {"role": "assistant", "content": "a"}


def test_max_turns_cuts_before_the_next_user_turn(tmp_path):
    path = write(tmp_path, [{"messages": MESSAGES}])
    assert [len(read_all(path, max_turns=n)[0][0].messages) for n in (1, 2, 3, None)] \
        == [3, 7, 8, 8]
    with pytest.raises(ConversationsError, match="dataset.max_turns"):
        conv.read(path, "messages", on_bad_input="skip", max_turns=0)


def test_parquet_and_arrow_sources_read_like_jsonl(tmp_path):
    import datasets

    rows = [{"messages": MESSAGES, "tools": json.dumps(TOOLS)},
            {"messages": [USER], "tools": None}]
    (want, _), report = read_all(write(tmp_path, rows))
    table = datasets.Dataset.from_list(rows).data.table
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "in.parquet"))
    for name, writer in (("s.arrow", pa.ipc.new_stream), ("f.arrow", pa.ipc.new_file)):
        with pa.OSFile(str(tmp_path / name), "wb") as sink, writer(sink, table.schema) as w:
            w.write_table(table)
    for name in ("in.parquet", "s.arrow", "f.arrow"):
        (a, b), report = read_all(tmp_path / name)
        assert (a.source, b.source) == (f"{tmp_path / name}:row 0", f"{tmp_path / name}:row 1")
        assert dataclasses.replace(a, source=want.source) == want, name
        assert b.messages == (USER,) and b.tools is None and report.kept == 2


def test_unreadable_parquet_is_an_error(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet" * 10)
    with pytest.raises(ConversationsError, match=r"dataset.source.*cannot read it as parquet"):
        read_all(tmp_path / "bad.parquet")


M = "messages"
BAD = [  # (format, bad row, reason, words of what is wrong)
    (M, '{"messages": [', "malformed_json", "not valid JSON"),
    (M, {"conversations": SHAREGPT}, "wrong_format",
     'a "conversations" key: set dataset.format: sharegpt'),
    ("sharegpt", GOOD, "wrong_format", "set dataset.format: messages"),
    ("mtbench", {"prompt": "x"}, "wrong_format", 'no "turns" key'),
    (M, {"messages": []}, "empty_conversation", '"messages" is empty'),
    (M, {"messages": ["hi"]}, "bad_message", "not an object"),
    (M, {"messages": [{"role": "robot", "content": "x"}]}, "unknown_role", "messages[0].role"),
    ("sharegpt", {"conversations": [{"from": "bard", "value": "x"}]}, "unknown_role",
     "conversations[0].from"),
    (M, {"messages": [{"role": "user", "content": 5}]}, "bad_content", "not a string"),
    (M, {"messages": [{"role": "user", "content": None}]}, "bad_content", "null"),
    (M, {"messages": [{"role": "user", "content": "\udc80"}]}, "bad_content", "surrogate"),
    ("mtbench", {"turns": ["q", 2]}, "bad_content", "turns[1]"),
    (M, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "bad_content_part", "content[0]"),
    (M, {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "bad_content_part", "empty text part"),
    (M, {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "bad_tool_call", "tool_calls[0]"),
    (M, {"messages": [USER], "tools": {"a": 1}}, "bad_tools", '"tools"'),
    (M, {"messages": [USER, {"role": "tool", "content": "r"}]}, "orphan_tool_result",
     "no assistant tool_calls"),
    (M, {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "c9", "content": "r"}]},
     "orphan_tool_result", "'c9' answers none"),
    (M, {"messages": [{"role": "assistant", "content": "a"}, USER]}, "bad_turn_order",
     "(assistant) comes before the first user turn"),
    (M, {"messages": [USER, {"role": "system", "content": "s"}]}, "bad_turn_order",
     "after the first turn"),
    (M, {"messages": [{"role": "system", "content": "s"}]}, "no_user_turn", "no user turn"),
]
GOOD_ROW = {M: GOOD, "sharegpt": {"conversations": [{"from": "human", "value": "hi"}]},
            "mtbench": {"turns": ["hi"]}}


@pytest.mark.parametrize("fmt,row,reason,words", BAD, ids=[f"{b[2]}-{i}" for i, b in
                                                           enumerate(BAD)])
def test_bad_input_counted_under_skip_and_refused_under_error(tmp_path, fmt, row, reason,
                                                              words):
    path = write(tmp_path, [GOOD_ROW[fmt], row])
    kept, report = read_all(path, fmt, on_bad_input="skip")
    assert len(kept) == report.kept == 1 and report.read == 2
    assert report.skipped == dict.fromkeys(conv.REASONS, 0) | {reason: 1}
    assert report.examples[reason][0].startswith(f"{path}:2: ") and words in \
        report.examples[reason][0]
    with pytest.raises(BadInputError) as e:
        read_all(path, fmt)
    key = "dataset.format" if reason == "wrong_format" else "dataset.source"
    assert e.value.reason == reason and e.value.source == f"{path}:2"
    assert str(e.value).startswith(f"{path}:2: {key} (params.yaml): ") and words in str(e.value)
    assert "\n    fix: " in str(e.value)


def test_skip_examples_are_capped_per_reason(tmp_path):
    path = write(tmp_path, [{"messages": []}] * 5 + [GOOD])
    kept, report = read_all(path, on_bad_input="skip")
    assert report.skipped["empty_conversation"] == 5 and len(kept) == 1
    assert len(report.examples["empty_conversation"]) == conv.EXAMPLES


@pytest.mark.parametrize("name,fmt,key,words", [
    ("absent.jsonl", M, "dataset.source", "not found"),
    ("in.csv", M, "dataset.source", "no reader for the suffix '.csv'"),
    ("in.jsonl", "alpaca", "dataset.format", "'alpaca' is not a conversation format"),
])
def test_bad_source_or_format_refused_when_made(tmp_path, name, fmt, key, words):
    write(tmp_path, [GOOD], "in.csv"), write(tmp_path, [GOOD])
    with pytest.raises(ConversationsError) as e:
        conv.read(tmp_path / name, fmt, on_bad_input="skip")
    assert f"{key}: " in str(e.value) and words in str(e.value) and "fix: " in str(e.value)


def test_empty_source_and_json_array_file_refused(tmp_path):
    with pytest.raises(ConversationsError, match="no conversation in it"):
        read_all(write(tmp_path, ["", " "]))
    (tmp_path / "a.json").write_text(json.dumps([GOOD], indent=1))
    with pytest.raises(ConversationsError, match=r"a.json:1: the file is one JSON array.*\n"
                                                 r".*jq -c '\.\[\]'"):
        read_all(tmp_path / "a.json", on_bad_input="skip")
