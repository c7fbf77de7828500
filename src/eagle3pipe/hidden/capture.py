"""Verifier hidden states, captured by the engine that serves the draft: vLLM.

vLLM's `extract_hidden_states` speculative method (vllm/v1/spec_decode/extract_hidden_states.py,
vllm/model_executor/models/extract_hidden_states.py) caches, for every prompt token, the
residual stream at the layer ids its draft config names, and a KV connector writes them out when
the request finishes; speculators 0.9's data generation runs it the same way
(speculators/data_generation/vllm_client.py). Layer id i < L is the stream entering decoder layer
i; id L is the last layer's output before the final norm (vLLM's `_maybe_add_hidden_state` in
each model's forward), which is the draft's last slot. So the features the draft trains on are
the engine's own, with its dtype, kernels and parallelism, by construction.

The connector is eagle3pipe.engines.connector.SyncHiddenStatesConnector (synchronous, CPU and
GPU alike, only TP rank 0 writes). A request's file appears during the engine step after the
one it finished in, so each batch is followed by engine steps until its files exist.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file

from eagle3pipe.errors import Error
from eagle3pipe.runtime.atomic import writer_tag

FLUSH_TIMEOUT_S = 120.0


class CaptureError(Error, RuntimeError):
    pass


def engine_config(layer_ids: list[int], storage: Path, identity: dict | None = None) -> dict:
    """The speculative_config and kv_transfer_config of a capturing engine; with `identity`,
    every file it writes carries it as metadata (a hidden-state server's, checked per entry by
    eagle3pipe.hidden.on_demand). The connector is named by module path (vLLM's workers import
    it); importing it here also makes it a code dep of the extract stage (eagle3pipe.tools.deps)."""
    from eagle3pipe.engines.connector import IDENTITY, SyncHiddenStatesConnector as connector

    extra = {"shared_storage_path": str(storage), "use_synchronization_lock": False}
    if identity is not None:
        extra[IDENTITY] = json.dumps(identity, sort_keys=True)
    return {
        "speculative_config": {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": list(layer_ids)}}},
        "kv_transfer_config": {
            "kv_connector": connector.__name__, "kv_connector_module_path": connector.__module__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra},
    }


def hidden_states(llm, prompts: list[list[int]], *, batch_size: int
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, hidden_states [T, n_ids, H]) for every prompt, in order, from an engine started
    with engine_config(...), `batch_size` prompts per engine call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sampling,
                            use_tqdm=False)
        paths = [Path((o.kv_transfer_params or {}).get("hidden_states_path", "")) for o in outs]
        _flush(llm, paths)
        for k, (p, path) in enumerate(zip(batch, paths)):
            data = load_file(str(path))
            path.unlink()
            if data["token_ids"].tolist() != list(p):
                raise CaptureError(f"{path}: vLLM captured token ids that differ from prompt "
                                   f"{start + k}'s; the engine reordered or truncated it")
            yield start + k, data["hidden_states"]


def _flush(llm, paths: list[Path]) -> None:
    """Steps the engine until every file of the batch is on disk (bounded in time)."""
    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while not all(p.is_file() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.is_file()][:3]
            raise CaptureError(f"vLLM did not write the hidden states {missing} within "
                               f"{FLUSH_TIMEOUT_S:.0f} s of the requests finishing")
        llm.llm_engine.step()


def storage_dir(parent: Path) -> tempfile.TemporaryDirectory:
    """Where the connector writes (inside the stage's temporary output: same filesystem)."""
    return tempfile.TemporaryDirectory(dir=parent, prefix=f".vllm-hidden.{writer_tag()}.",
                                       suffix=".tmp")  # a dead writer's: eagle3pipe gc removes it
