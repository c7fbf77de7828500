"""The dataset stage's check that the draft trains on the tokens the server will feed the
verifier: every prompt's ids (eagle3pipe.data.prompts.template_ids, transformers' chat
template) equal what vLLM's own chat rendering gives at serve time for the same messages, tools
and dataset.chat_template_kwargs (eagle3pipe.engines.rendering, the OpenAI server's path).

They can differ without an error anywhere else: vLLM detects a template that iterates over
message content and sends text as content parts (hf.py `resolve_chat_template_content_format`),
prefers a processor's template without tools, renders some architectures with its own Python
encoders (DeepSeek-V3.2, V4, Kimi-K3), and parses tool-call arguments into objects. A draft
trained on other tokens than those it is served on loses acceptance silently, so a mismatch
stops the stage before anything is written.
"""
from __future__ import annotations

import logging
from typing import Any

from tqdm import tqdm

from eagle3pipe.data.prompts import Prompt
from eagle3pipe.engines import rendering
from eagle3pipe.errors import Error

log = logging.getLogger("eagle3pipe.stages.dataset")
SHOWN = 3  # mismatches named in the error


class RenderingMismatch(Error, ValueError):
    """Prompts the dataset stage rendered differ from vLLM's rendering of the same request."""


def check(prompts: list[Prompt], model_dir: str, template_kwargs: dict, settings: dict, *,
          progress: bool = True) -> int:
    """Renders every prompt's messages (and tools) with vLLM's chat rendering and compares
    the ids; returns how many were checked. A mismatch raises RenderingMismatch naming the
    count, the first samples, the first differing position and both tokens."""
    r = rendering.Renderer(model_dir, trust_remote_code=settings["trust_remote_code"],
                           max_model_len=settings["max_model_len"])
    bad: list[str] = []
    try:
        for p in tqdm(prompts, desc="dataset: prompts vs vLLM's chat rendering",
                      disable=not progress, mininterval=1.0):
            theirs = r.prompt_ids(p.messages, tools=p.tools,
                                  chat_template_kwargs=template_kwargs)
            msg = rendering.mismatch_message(p.source, list(p.ids), theirs, r.tokenizer)
            if msg:
                bad.append(msg)
    finally:
        r.close()
    if bad:
        raise RenderingMismatch(
            f"{len(bad)} of {len(prompts)} prompts differ from what vLLM's chat rendering "
            f"gives at serve time, so the draft would train on other tokens than it is "
            f"served on:\n  " + "\n  ".join(bad[:SHOWN]),
            fix="make the verifier's chat template render the same text for string content "
                "and content parts (vLLM sends parts to a template that loops over "
                "message content), keep one chat template in the checkpoint "
                "(chat_template.jinja or tokenizer_config.json, no processor template), and "
                "check dataset.chat_template_kwargs")
    log.info("%d prompts equal vLLM's chat rendering", len(prompts))
    return len(prompts)
