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
CHUNK = 256  # prompts rendered together (concurrently, in one pass of the event loop)


class RenderingMismatch(Error, ValueError):
    """Prompts the dataset stage rendered differ from vLLM's rendering of the same request."""


class Checker:
    """vLLM's chat rendering, built once (about 5 s) and compared with batch after batch of
    prompts; for use as a context manager. `checked` counts the prompts compared so far."""

    def __init__(self, model_dir: str, template_kwargs: dict, settings: dict, *,
                 progress: bool = True):
        self.model_dir, self.template_kwargs = model_dir, template_kwargs
        self.settings, self.progress = settings, progress
        self.checked = 0
        self._renderer = None

    def __enter__(self) -> Checker:
        return self

    def __exit__(self, *exc) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def check(self, prompts: list[Prompt]) -> None:
        """Renders every prompt's messages (and tools) with vLLM's chat rendering and compares
        the ids. A mismatch raises RenderingMismatch naming the count, the first samples, the
        first differing position and both tokens."""
        if self._renderer is None:
            self._renderer = rendering.Renderer(
                self.model_dir, trust_remote_code=self.settings["trust_remote_code"],
                max_model_len=self.settings["max_model_len"])
        r, bad = self._renderer, []
        bar = tqdm(total=len(prompts), desc="dataset: prompts vs vLLM's chat rendering",
                   disable=not self.progress, mininterval=1.0)
        for c in range(0, len(prompts), CHUNK):
            chunk = prompts[c:c + CHUNK]
            theirs = r.many_prompt_ids([(p.messages, p.tools) for p in chunk],
                                       self.template_kwargs)
            for p, ids in zip(chunk, theirs):
                msg = rendering.mismatch_message(p.source, list(p.ids), ids, r.tokenizer)
                if msg:
                    bad.append(msg)
            bar.update(len(chunk))
        bar.close()
        if bad:
            raise RenderingMismatch(
                f"{len(bad)} of {len(prompts)} prompts differ from what vLLM's chat rendering "
                f"gives at serve time, so the draft would train on other tokens than it is "
                f"served on:\n  " + "\n  ".join(bad[:SHOWN]),
                fix="make the verifier's chat template render the same text for string content "
                    "and content parts (vLLM sends parts to a template that loops over "
                    "message content), keep one chat template in the checkpoint "
                    "(chat_template.jinja or tokenizer_config.json, no processor template), "
                    "and check dataset.chat_template_kwargs")
        self.checked += len(prompts)
        log.info("%d prompts equal vLLM's chat rendering", len(prompts))


def check(prompts: list[Prompt], model_dir: str, template_kwargs: dict, settings: dict, *,
          progress: bool = True) -> int:
    """Checker.check of `prompts` with a renderer of their own; how many were checked."""
    with Checker(model_dir, template_kwargs, settings, progress=progress) as c:
        c.check(prompts)
        return c.checked
