"""The prompt token ids vLLM's OpenAI server feeds its engine for a chat request, rendered with
vLLM's own code and no engine or weights, and the check that the dataset stage's prompt ids
(eagle3pipe.data.prompts.template_ids) equal them.

`Renderer` builds what vLLM's GPU-less render server builds, in this process:
- the config: vllm/entrypoints/launchers/render/entry.py `run_launch_fastapi` (EngineArgs
  `create_model_config`, quantization cleared, `VllmConfig` with the logging and
  structured-outputs configs; no device, KV cache or parallel setup);
- the renderer: vllm/renderers/registry.py `renderer_from_config` (the tokenizer through
  vllm/tokenizers/registry.py `cached_tokenizer_from_config`, and the renderer class its
  tokenizer mode picks: `HfRenderer` in hf.py for a Jinja template, `KimiK3Renderer`,
  `DeepseekV32Renderer`, ...);
- the request front: vllm/renderers/online_renderer.py `OnlineRenderer`, as
  vllm/entrypoints/launchers/render/app_state.py `init_render_app_state` makes it.

`prompt_ids` sends a `ChatCompletionRequest` through `OnlineRenderer.render_chat`, the call both
/v1/chat/completions (entrypoints/openai/chat_completion/serving.py `render_chat_request`) and
/v1/chat/completions/render (entrypoints/scale_out/render/serving.py `render_chat_request`)
make. Behind it, `preprocess_chat` merges the server's default_chat_template_kwargs,
`HfRenderer.render_messages_async` resolves the template (hf.py `resolve_chat_template`),
detects the content format (`resolve_chat_template_content_format`), parses the messages
(chat_utils.py `parse_chat_messages_async`: tool-call arguments become objects), filters the
kwargs (`resolve_chat_template_kwargs`) and renders text (`safe_apply_chat_template`), which
BaseRenderer (base.py `_tokenize_prompt`) tokenizes with the request's add_special_tokens
(False for chat requests).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from eagle3pipe.errors import Error


class RenderingError(Error, ValueError):
    """vLLM could not build its renderer for a model directory, or rejected a chat request."""


class Renderer:
    """vLLM's chat rendering for one model directory (config.json and tokenizer files), built
    once (vLLM's imports and the tokenizer load dominate) and reused for any number of
    requests, outside a running event loop (the calls share one event loop of the Renderer's
    own, closed by close(): a loop per call costs more than the rendering). vLLM caches
    tokenizers by path for the process (tokenizers/registry.py `cached_get_tokenizer`): a
    directory whose tokenizer files change is read anew only by a new process."""

    def __init__(self, model_dir: str | Path, *, trust_remote_code: bool = False,
                 max_model_len: int | None = None):
        self.model_dir = str(model_dir)
        self.vllm_config = _vllm_config(self.model_dir, trust_remote_code, max_model_len)
        from vllm.renderers import renderer_from_config

        try:
            self.renderer = renderer_from_config(self.vllm_config)
        except (OSError, ValueError) as e:
            raise RenderingError(f"{self.model_dir}: vLLM cannot load its tokenizer: {e}",
                                 "save the tokenizer files (tokenizer.json, "
                                 "tokenizer_config.json) in the model directory") from None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fronts: dict[str, object] = {}

    @property
    def tokenizer(self):
        """The tokenizer vLLM renders with (the renderer's own copy)."""
        return self.renderer.get_tokenizer()

    def prompt_ids(self, messages: list[dict], *, tools: list | None,
                   chat_template_kwargs: dict) -> list[int]:
        """The token ids vLLM feeds its engine for a chat request of `messages` (and the OpenAI
        `tools` schema list) with add_generation_prompt, on a server started with
        `--default-chat-template-kwargs chat_template_kwargs` (the serve recipe's, from
        dataset.chat_template_kwargs: eagle3pipe.engines.serving). A request with tools asks
        tool_choice "auto" (the API's default with tools), accepted as by a server with
        --enable-auto-tool-choice; a tool parser acts after rendering and changes no id.
        Tool-call arguments given as objects are sent as JSON text, as the API requires
        (_wire_messages); vLLM parses them back into the same objects."""
        return self.many_prompt_ids([(messages, tools)], chat_template_kwargs)[0]

    def many_prompt_ids(self, requests: list[tuple[list[dict], list | None]],
                        chat_template_kwargs: dict) -> list[list[int]]:
        """prompt_ids of each (messages, tools) request, rendered concurrently in one pass of
        the event loop, as a server renders the requests that arrive together (vLLM batches
        their tokenization); the first request vLLM rejects raises RenderingError."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.exceptions import VLLMClientError

        front = self._online(chat_template_kwargs)

        async def render_all():
            return await asyncio.gather(*(front.render_chat(ChatCompletionRequest(
                model=self.model_dir, messages=_wire_messages(messages), tools=tools,
                add_generation_prompt=True)) for messages, tools in requests))

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        try:
            results = self._loop.run_until_complete(render_all())
        except (ValueError, VLLMClientError) as e:
            raise RenderingError(f"{self.model_dir}: vLLM rejected the chat request: {e}",
                                 _TEMPLATE_FIX) from None
        out = []
        for result in results:
            if isinstance(result, ErrorResponse):
                raise RenderingError(f"{self.model_dir}: vLLM rejected the chat request: "
                                     f"{result.error.message}", _TEMPLATE_FIX)
            _, (engine_input,) = result
            out.append(list(engine_input["prompt_token_ids"]))
        return out

    def close(self) -> None:
        """Stops the renderer's tokenizer threads (BaseRenderer.shutdown) and closes the event
        loop."""
        self.renderer.shutdown()
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _online(self, chat_template_kwargs: dict):
        """vLLM's request front as init_render_app_state builds it from the server's flags:
        no --chat-template (the tokenizer's), content format "auto", no tool or reasoning
        parser, `chat_template_kwargs` as --default-chat-template-kwargs; one per kwargs."""
        from vllm.renderers.online_renderer import OnlineRenderer

        key = json.dumps(chat_template_kwargs, sort_keys=True, default=str)
        if key not in self._fronts:
            self._fronts[key] = OnlineRenderer(
                self.vllm_config.model_config, self.renderer, request_logger=None,
                chat_template=None, chat_template_content_format="auto",
                enable_auto_tools=True, default_chat_template_kwargs=dict(chat_template_kwargs))
        return self._fronts[key]


def _wire_messages(messages: list[dict]) -> list[dict]:
    """`messages` as an OpenAI client sends them: a tool call's `arguments` object as JSON
    text (the API's type; chat_utils.py `_postprocess_messages` parses it back)."""
    return [{**m, "tool_calls": [_wire_call(c) for c in m["tool_calls"]]}
            if isinstance(m.get("tool_calls"), list) else m for m in messages]


def _wire_call(call):
    """One tool call with an `arguments` object as JSON text; anything else as given."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("arguments"), dict)):
        return call
    return {**call, "function": {**fn, "arguments": json.dumps(fn["arguments"],
                                                                ensure_ascii=False)}}


_TEMPLATE_FIX = ("vLLM's server refuses this request too (a 400): fix what it names in the "
                 "messages, tools or dataset.chat_template_kwargs (the model's chat template "
                 "is in tokenizer_config.json or chat_template.jinja), or serve a longer "
                 "max_model_len")


def _vllm_config(model_dir: str, trust_remote_code: bool, max_model_len: int | None):
    """The VllmConfig of vLLM's GPU-less render server (render/entry.py `run_launch_fastapi`)
    for `model_dir`, as the pipeline serves it (eagle3pipe.engines.engine.engine_kwargs: the
    language model only, so a multimodal wrapper renders text as it is served)."""
    if not (Path(model_dir) / "config.json").is_file():
        raise RenderingError(f"{model_dir}: no config.json, so vLLM cannot resolve the model",
                             "point at a Hugging Face checkpoint directory (config.json and "
                             "tokenizer files)")
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model_dir, tokenizer=model_dir,
                      trust_remote_code=trust_remote_code, max_model_len=max_model_len,
                      language_model_only=True, renderer_num_workers=1)
    try:
        model_config = args.create_model_config()
    except (OSError, ValueError) as e:
        raise RenderingError(f"{model_dir}/config.json: vLLM cannot build its model config: "
                             f"{e}", "fix config.json (or set trust_remote_code for a model "
                             "with its own code)") from None
    model_config.quantization = None  # rendering runs no quantized kernel (run_launch_fastapi)
    return VllmConfig(model_config=model_config,
                      logging_config=args.create_logging_config(),
                      structured_outputs_config=args.create_structured_outputs_config())


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where the two id lists differ (the shorter length when one is a
    prefix of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _token(ids: list[int], i: int, tokenizer) -> str:
    """The token at position i as 'text' (id N), or "end of prompt" past the end."""
    if i >= len(ids):
        return "end of prompt"
    text = tokenizer.decode([ids[i]], skip_special_tokens=False)
    return f"{text!r} (id {ids[i]})"


def mismatch_message(sample_id: str, ours: list[int], theirs: list[int],
                     tokenizer) -> str | None:
    """None when the dataset stage's prompt ids (`ours`) equal vLLM's (`theirs`); else one line
    naming the sample, the first differing position and the token each side has there."""
    i = first_difference(ours, theirs)
    if i is None:
        return None
    return (f"{sample_id}: the prompt the dataset stage rendered differs from vLLM's chat "
            f"rendering at position {i}: {_token(ours, i, tokenizer)} here, "
            f"{_token(theirs, i, tokenizer)} in vLLM")
