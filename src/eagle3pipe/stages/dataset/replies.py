"""The verifier's greedy replies (vLLM) to chat-templated prompts, kept in the per-sample store
(eagle3pipe.data.store; the dataset kind's database: eagle3pipe.data.store_db) under a key of
what determines each reply. One engine serves a whole
stage run: it starts at the first reply the store lacks and stays up for every later call (the
turn depths of a conversation source); no engine starts when the store has every reply.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

from tqdm import tqdm

from eagle3pipe.data import store
from eagle3pipe.data.prompts import Prompt
from eagle3pipe.data.store_db import Table
from eagle3pipe.engines import engine
from eagle3pipe.verifier.handle import Verifier


def reply_keys(v: Verifier, prompts: list[Prompt], cfg: Any, settings: dict) -> list[str]:
    """Each prompt's store key: what determines the verifier's greedy reply to it (vLLM's
    version included: its kernels decide near-ties between tokens)."""
    base = {"stage": "dataset", "verifier": v.fingerprint, "engine": engine.numeric(settings, v.model_dir),
            "vllm": engine.vllm_version(),
            "sampling": {"temperature": 0.0, "max_tokens": cfg.max_new_tokens,
                         "seed": cfg.seed}}
    return [store.key(**base, prompt=p.ids) for p in prompts]


class Replies:
    """Replies from the store or generated, for use as a context manager (the engine, once
    started, stops when the block ends). `computed` counts the prompts generated so far;
    `timing` (seconds: import_s, engine_start_s, generate_s) goes to the log only."""

    def __init__(self, v: Verifier, cfg: Any, settings: dict, *, progress: bool = True):
        self.v, self.cfg, self.settings, self.progress = v, cfg, settings, progress
        self.computed = 0
        self.timing = {"import_s": 0.0, "engine_start_s": 0.0, "generate_s": 0.0}
        self._stack = contextlib.ExitStack()
        self.store = self._stack.enter_context(Table(store.root()))
        self._llm = None
        self._sampling = None

    def __enter__(self) -> Replies:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)
        self._llm = None

    def _engine(self):
        """The vLLM engine, started at the first call."""
        if self._llm is None:
            t0 = time.perf_counter()
            engine.environment(self.settings)  # before vLLM's import
            from vllm import SamplingParams

            t1 = time.perf_counter()
            self._llm = self._stack.enter_context(
                engine.engine(self.settings, self.v.model_dir, tokenizer=self.v.dir))
            self._sampling = SamplingParams(temperature=0.0, max_tokens=self.cfg.max_new_tokens,
                                            seed=self.cfg.seed)
            self.timing["import_s"] = round(t1 - t0, 2)
            self.timing["engine_start_s"] = round(time.perf_counter() - t1, 2)
        return self._llm

    def get(self, prompts: list[Prompt], keys: list[str], *, desc: str = "generate"
            ) -> tuple[list[list[int]], list[str]]:
        """(token ids, finish reasons) of the replies to `prompts`, whose store keys are `keys`
        (reply_keys). Token ids are exactly what the verifier produced, ending with its stop
        token if it stopped. The replies the store lacks go to the engine dataset.batch_size
        at a time (engine.finished: vLLM batches as many as it runs at once) and the replies
        each engine step finished are stored at once, in one transaction, so a crash loses
        only the replies in flight (a repeated key is generated once); the others are read
        from the store."""
        todo = list({k: i for i, k in enumerate(keys) if not self.store.has(k)}.values())
        fresh: dict[str, dict] = {}
        if todo:
            llm = self._engine()
            t0 = time.perf_counter()
            bar = tqdm(total=len(todo), unit="prompt", desc=desc, disable=not self.progress)
            for c in range(0, len(todo), self.cfg.batch_size):
                chunk = todo[c:c + self.cfg.batch_size]
                for step in engine.finished(llm, [prompts[i].ids for i in chunk],
                                            self._sampling):
                    done = [(keys[chunk[j]], {"reply": list(out.outputs[0].token_ids),
                                              "finish": str(out.outputs[0].finish_reason)})
                            for j, out in step]
                    self.store.put_many((k, store.json_entry(obj)) for k, obj in done)
                    fresh.update(done)
                    bar.update(len(done))
            bar.close()
            self.timing["generate_s"] = round(self.timing["generate_s"]
                                              + time.perf_counter() - t0, 3)
            self.computed += len(todo)
        got = [fresh.get(k) or self.store.get_json(k) for k in keys]
        return [g["reply"] for g in got], [g["finish"] for g in got]
