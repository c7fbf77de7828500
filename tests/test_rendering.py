"""eagle3pipe.engines.rendering: the prompt ids the dataset stage renders with transformers'
apply_chat_template (tokenize=True, return_dict=True, as eagle3pipe.data.prompts.template_ids)
equal what vLLM's OpenAI server renders for the same chat request, and a planted difference is
named at its exact position. A tiny checkpoint directory (a BPE tokenizer trained on a few
lines, a Llama config.json, no weights) and one vLLM renderer serve the whole module."""
from __future__ import annotations

import json

import pytest

from eagle3pipe.engines.rendering import (Renderer, RenderingError, first_difference,
                                          mismatch_message)
from eagle3pipe.verifier import embedded


# the micro verifier's template (embedded.CHAT_TEMPLATE) plus what real templates read: a tools
# block, tool turns, and enable_thinking (Qwen3's: an empty think block when it is false); a
# system turn ends with <|end|> here, where embedded.CHAT_TEMPLATE ends it with "\n" only
SERVED_TEMPLATE = (
    "{% if tools %}<|user|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}<|end|>\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function']['name'] }} "
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}</tool_call>{% endfor %}"
    "<|end|>\n"
    "{% elif m['role'] == 'tool' %}<|user|>\n<tool_response>{{ m['content'] }}"
    "</tool_response><|end|>\n"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
SYSTEM = "You are a helpful assistant."
TEXTS = [SYSTEM, "def add(x, y):\n    return x + y\n", "What is the weather in Paris?",
         "It is sunny. <think>\n\n</think>\n\n", '{"city": "Paris"} get_weather']
ONE_TURN = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "def add(x, y):"}]
MULTI_TURN = ONE_TURN + [{"role": "assistant", "content": "    return x + y"},
                         {"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def tool_turns(arguments) -> list[dict]:
    """MULTI_TURN's opening with an assistant tool call (`arguments`) and its result."""
    return ONE_TURN + [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A checkpoint directory vLLM can render for: tokenizer files with SERVED_TEMPLATE and a
    Llama config.json (rendering reads no weights)."""
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("rendering") / "model"
    tok = embedded.train_tokenizer(320, TEXTS * 4)
    tok.chat_template = SERVED_TEMPLATE
    tok.save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, max_position_embeddings=1024, bos_token_id=ids(embedded.PAD),
                eos_token_id=ids(embedded.END),
                architectures=["LlamaForCausalLM"]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """The tokenizer as the dataset stage loads it (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def renderer(model_dir):
    r = Renderer(model_dir, trust_remote_code=False)
    yield r
    r.close()


def ours(tokenizer, messages, *, tools=None, kwargs=None, template=None) -> list[int]:
    """The dataset stage's prompt ids (eagle3pipe.data.prompts.template_ids' call); `template`
    replaces the tokenizer's chat template (a planted difference)."""
    extra = {"chat_template": template} if template else {}
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=True,
                                        **(kwargs or {}), **extra)
    return list(out["input_ids"])


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([], []) is None
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([1], [1, 2, 3]) == 1
    assert first_difference([], [7]) == 0
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([5, 2], [1, 2]) == 0


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(RenderingError, match=r"no config\.json.*\n    fix: point at"):
        Renderer(tmp_path)


@pytest.mark.integration
def test_a_request_vllm_rejects_names_the_directory(model_dir):
    """A prompt longer than max_model_len, which vLLM's server answers with a 400."""
    short = Renderer(model_dir, max_model_len=8)
    try:
        with pytest.raises(RenderingError, match=rf"{model_dir}: vLLM rejected the chat "
                                                 r"request: .*maximum context length is 8"):
            short.prompt_ids(MULTI_TURN, tools=None, chat_template_kwargs={})
    finally:
        short.close()


@pytest.mark.integration
@pytest.mark.parametrize("messages", [ONE_TURN, MULTI_TURN], ids=["one-turn", "multi-turn"])
def test_vllm_renders_the_dataset_prompt(renderer, tokenizer, messages):
    theirs = renderer.prompt_ids(messages, tools=None, chat_template_kwargs={})
    mine = ours(tokenizer, messages)
    assert mismatch_message("s#0", mine, theirs, tokenizer) is None
    assert theirs == mine
    assert tokenizer.decode(theirs).endswith("<|assistant|>\n")


@pytest.mark.integration
@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}],
                         ids=["json-text", "object"])
def test_tools_and_template_kwargs(renderer, tokenizer, arguments):
    """A tools schema, tool turns and enable_thinking reach vLLM's template as they reach
    transformers': the same ids, with the tools block and the empty think block in them."""
    kwargs = {"enable_thinking": False}
    for messages in (MULTI_TURN, tool_turns(arguments)):
        theirs = renderer.prompt_ids(messages, tools=TOOLS, chat_template_kwargs=kwargs)
        assert theirs == ours(tokenizer, messages, tools=TOOLS, kwargs=kwargs)
        text = tokenizer.decode(theirs)
        assert "# Tools\n" + json.dumps(TOOLS[0]) in text
        assert text.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    thinking = renderer.prompt_ids(MULTI_TURN, tools=None,
                                   chat_template_kwargs={"enable_thinking": True})
    assert tokenizer.decode(thinking).endswith("<|assistant|>\n")


@pytest.mark.integration
def test_kwargs_the_server_lacks_are_caught(renderer, tokenizer):
    """The dataset renders with enable_thinking false, the server without it: vLLM's prompt
    ends where the dataset's empty think block begins."""
    theirs = renderer.prompt_ids(MULTI_TURN, tools=None, chat_template_kwargs={})
    mine = ours(tokenizer, MULTI_TURN, kwargs={"enable_thinking": False})
    at = len(theirs)
    assert mine[:at] == theirs and len(mine) > at
    first = tokenizer.decode([mine[at]])
    assert "<think>".startswith(first)
    assert mismatch_message("conversations/chat.jsonl:3#2", mine, theirs, tokenizer) == (
        "conversations/chat.jsonl:3#2: the prompt the dataset stage rendered differs from "
        f"vLLM's chat rendering at position {at}: {first!r} (id {mine[at]}) here, end of "
        "prompt in vLLM")


@pytest.mark.integration
def test_a_different_template_is_caught(renderer, tokenizer):
    """The dataset renders with the micro verifier's template (a system turn ends with "\\n"),
    the model directory holds SERVED_TEMPLATE (it ends with <|end|>): the first difference is
    the token after the system prompt."""
    theirs = renderer.prompt_ids(MULTI_TURN, tools=None, chat_template_kwargs={})
    mine = ours(tokenizer, MULTI_TURN, template=embedded.CHAT_TEMPLATE)
    at = len(tokenizer(SYSTEM, add_special_tokens=False)["input_ids"])
    end = tokenizer.convert_tokens_to_ids(embedded.END)
    assert first_difference(mine, theirs) == at
    assert theirs[at] == end
    assert mismatch_message("s#7", mine, theirs, tokenizer) == (
        "s#7: the prompt the dataset stage rendered differs from vLLM's chat rendering at "
        f"position {at}: '\\n' (id {mine[at]}) here, '<|end|>' (id {end}) in vLLM")


@pytest.mark.integration
def test_compact_tool_arguments_render_differently(renderer, tokenizer):
    """vLLM parses a tool call's JSON-text arguments into an object before templating
    (chat_utils.py _postprocess_messages); a template that prints text as given and objects
    with tojson then writes '{"city":"Paris"}' from the dataset and '{"city": "Paris"}' in
    vLLM. The check names the place."""
    messages = tool_turns('{"city":"Paris"}')
    theirs = renderer.prompt_ids(messages, tools=None, chat_template_kwargs={})
    mine = ours(tokenizer, messages)
    assert tokenizer.decode(mine) != tokenizer.decode(theirs)
    assert '{"city": "Paris"}' in tokenizer.decode(theirs)
    at = first_difference(mine, theirs)
    assert at is not None and mine[:at] == theirs[:at]
    assert f"at position {at}: " in mismatch_message("s#1", mine, theirs, tokenizer)
