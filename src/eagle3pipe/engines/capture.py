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

import math
import re
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import load_file

from eagle3pipe.data.samples import Sample
from eagle3pipe.errors import Error
from eagle3pipe.runtime.tensorfile import read_header
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.units import human

FLUSH_TIMEOUT_S = 120.0


class CaptureError(Error, RuntimeError):
    pass


def engine_config(layer_ids: list[int], storage: Path) -> dict:
    """The speculative_config and kv_transfer_config of a capturing engine. The connector is
    named by module path (vLLM's workers import it); importing it here also makes it a code
    dep of the extract stage (eagle3pipe.tools.deps)."""
    from eagle3pipe.engines.connector import SyncHiddenStatesConnector as connector

    return {
        "speculative_config": {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": list(layer_ids)}}},
        "kv_transfer_config": {
            "kv_connector": connector.__name__, "kv_connector_module_path": connector.__module__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage),
                                          "use_synchronization_lock": False}},
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
    return tempfile.TemporaryDirectory(dir=parent, prefix=".vllm-hidden-")

# ---------------------------------------------------------------------------------------------
# The transformers oracle: the same capture semantics with forward pre-hooks


LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def oracle_budget() -> tuple[int | None, str]:
    """(bytes the oracle's float32 weights may take, where that figure comes from):
    $EAGLE3PIPE_ORACLE_MEMORY (a size such as 64G), else half the host's free memory;
    None when neither is known."""
    import os

    name = environment.ORACLE_MEMORY
    n = environment.size(name, unset="half the host's free memory", example="64G",
                         error=CaptureError)
    if n is not None:
        return n, f"${name}={environment.text(name)}"
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None, "free host memory unknown"
    return free // 2, f"half the host's {human(free)} free"


def float32_bytes(v) -> tuple[dict[int, int], int]:
    """The decoder's weights in float32, from the safetensors headers (no weight read):
    bytes per decoder layer, and the rest (embedding, final norm, lm_head)."""
    layers: dict[int, int] = {}
    rest = 0
    for f in sorted(Path(v.model_dir).glob("*.safetensors")):
        for name, (_, shape) in read_header(f).tensors.items():
            if not name.startswith(v.weight_prefix):
                continue  # a wrapper's other towers: the oracle loads the decoder only
            n = 4 * math.prod(shape)
            m = LAYER.search(name)
            if m:
                layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + n
            else:
                rest += n
    return layers, rest


def oracle_layers(v, aux: list[int]) -> tuple[int | None, str]:
    """How many decoder layers the float32 oracle loads, and why: every one when the decoder
    fits oracle_budget(); else the largest aux id L whose prefix (the embedding, layers 0..L-1
    and the final norm) fits, so the slots of aux ids <= L are compared; None when not even
    the lowest aux id's prefix fits."""
    n = v.info.num_hidden_layers
    budget, source = oracle_budget()
    if budget is None:
        return n, source
    per_layer, rest = float32_bytes(v)

    def need(k: int) -> int:
        return rest + sum(b for i, b in per_layer.items() if i < k)

    if need(n) <= budget:
        return n, f"the float32 decoder ({human(need(n))}) fits {source}"
    fits = [a for a in sorted(set(aux)) if a < n and need(a) <= budget]
    if not fits:
        low = min(aux)
        return None, (f"{v.model_dir}: float32 weights {human(need(n))}, the prefix below "
                      f"layer {low} (the lowest aux id) {human(need(low))}: neither fits "
                      f"{source} ({human(budget)})")
    return fits[-1], (f"the float32 decoder ({human(need(n))}) does not fit {source} "
                      f"({human(budget)}); its first {fits[-1]} layers ({human(need(fits[-1]))}) "
                      "do")


def tf_load(v, num_layers: int | None = None):
    """The verifier's decoder in transformers, float32, eval mode (the oracle): a wrapper's
    text_config with its tensors' prefix stripped, kimi_k2 as DeepseekV3
    (eagle3pipe.verifier.families). With `num_layers`, only its first layers: transformers
    reads from the safetensors files only the tensors the truncated model has."""
    from transformers import AutoModelForCausalLM

    config = v.hf_config()
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
    prefix = {"key_mapping": {f"^{re.escape(v.weight_prefix)}": ""}} if v.weight_prefix else {}
    model = AutoModelForCausalLM.from_pretrained(
        v.model_dir, config=config, dtype=torch.float32, attn_implementation="sdpa",
        trust_remote_code=v.trust_remote_code, **prefix)
    model.eval()
    return model


def tf_decoder(model):
    """(decoder layers, final norm) of a decoder-only HF model (Llama-style layout)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if layers is None or norm is None:
        raise CaptureError(f"{type(model).__name__}: expected `.model.layers` and `.model.norm` "
                           "(a Llama-style decoder); extraction of this architecture is not "
                           "supported by the transformers extractor")
    return base, layers, norm


@torch.no_grad()
def tf_capture(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            aux_ids: Iterable[int]) -> torch.Tensor:
    """Hidden states [B, T, len(aux_ids) + 1, H] in the model's dtype: slot k < n_aux is the
    residual stream entering decoder layer aux_ids[k] (id == num_layers: the last layer's
    output), the last slot is the last layer's output before the final norm. Runs the decoder
    only (no lm_head). Right-pad batches and pass the attention mask."""
    aux_ids = list(aux_ids)
    base, layers, norm = tf_decoder(model)
    n_layers = len(layers)
    if any(not 0 <= i <= n_layers for i in aux_ids):
        raise CaptureError(f"aux layer ids {aux_ids} out of range [0, {n_layers}]")
    got: dict[int, torch.Tensor] = {}

    def pre_hook(key: int):
        def hook(module, args, kwargs):
            got[key] = args[0] if args else kwargs["hidden_states"]
        return hook

    # key n_layers = input of the final norm = output of the last decoder layer (pre-norm)
    handles = [layers[i].register_forward_pre_hook(pre_hook(i), with_kwargs=True)
               for i in sorted(set(aux_ids)) if i < n_layers]
    handles.append(norm.register_forward_pre_hook(pre_hook(n_layers), with_kwargs=True))
    try:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([got[i] for i in aux_ids] + [got[n_layers]], dim=2)


def padded_batches(samples: list[Sample], batch_size: int, pad_id: int
                   ) -> Iterable[tuple[list[int], list[int], torch.Tensor, torch.Tensor]]:
    """The batches extract_split runs: samples sorted by length (longest first, ties by row),
    padded right. Yields (sample indices, lengths, input_ids, attention_mask)."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].input_ids), i))
    for k in range(0, len(order), batch_size):
        batch = order[k:k + batch_size]
        lens = [len(samples[i].input_ids) for i in batch]
        ids = torch.full((len(batch), max(lens)), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max(lens)), dtype=torch.long)
        for r, (i, n) in enumerate(zip(batch, lens)):
            ids[r, :n] = torch.tensor(samples[i].input_ids, dtype=torch.long)
            mask[r, :n] = 1
        yield batch, lens, ids, mask
