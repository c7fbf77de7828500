"""A synchronous, device-agnostic subclass of vLLM's ExampleHiddenStatesConnector.

vLLM's `extract_hidden_states` speculative method caches the verifier's aux-layer hidden states
in a KV-cache-like buffer; a KV connector copies them out when a request finishes. The stock
connector (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py)
copies through CUDA streams, events and pinned memory on a thread pool, so it cannot run on a
CPU build. This subclass does the same extraction (`extract_from_kv_cache` over the request's
block table, as `_submit_async_write` does) synchronously, and publishes each file atomically
(written to a temporary name, then renamed), so a reader never sees a half-written file. Only TP
rank 0 writes, as in the stock connector (`get_finished_count` is 1).

Files hold `hidden_states [T, n_ids, H]` (the model's dtype) and `token_ids [T]` for the prompt
tokens, and, when the engine was started with one (kv_connector_extra_config IDENTITY), the
capture's identity as the file's metadata (eagle3pipe.hidden.on_demand checks it per entry). A request's file is written during the engine step AFTER the one it finished in (the
scheduler hands its block ids to the worker in the next step's connector metadata), so the
caller steps the engine once more after its last batch (eagle3pipe.engines.engine.capture does).

The class is named in `kv_transfer_config` by module path, so vLLM's worker processes (tensor
parallelism) import it by name: keep this module importable without side effects.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    extract_from_kv_cache,
)

IDENTITY = "eagle3pipe_identity"  # extra-config key and metadata key: what captured the file
_WRITTEN = object()  # marks a request whose file is on disk (the stock class keeps a CUDA event)


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tmp = f"{pending.filename}.tmp"
        identity = self._kv_transfer_config.get_from_extra_config(IDENTITY, None)
        save_file({"hidden_states": hidden.to("cpu").contiguous().clone(),
                   "token_ids": pending.token_ids.clone()}, tmp,
                  metadata={IDENTITY: identity} if identity else None)
        os.replace(tmp, pending.filename)
        self._req_copy_events[pending.req_id] = _WRITTEN
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        # a request is done sending once its file is written; it may finish (finished_req_ids)
        # a step before the metadata that carries its blocks arrives, so keep it until then
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = {r for r in self._accumulated_finished_req_ids
                if self._req_copy_events.get(r) is _WRITTEN}
        for req_id in done:
            self._accumulated_finished_req_ids.discard(req_id)
            self._req_copy_events.pop(req_id)
        return done or None, None
