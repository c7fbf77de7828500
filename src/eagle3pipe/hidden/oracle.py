"""The transformers oracle: vLLM's capture, as stored, checked slot by slot against the
verifier recomputed in transformers (float32) on a few samples, one decoder layer at a time
(eagle3pipe.hidden.streaming), each slot from the previous slot's vLLM capture, so that a slot's
error is its own segment's. The extract stage runs it before anything is published (Oracle,
oracle_check). tf_load/tf_capture, the whole decoder with forward pre-hooks (the same capture
semantics), serve the tests and the benchmarks.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from eagle3pipe.data.samples import Sample
from eagle3pipe.hidden.capture import CaptureError
from eagle3pipe.hidden.spec import ExtractError, slot_names
from eagle3pipe.hidden.streaming import NEAR_TIE, segments, span, stream
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.units import human
from eagle3pipe.verifier.handle import Verifier

log = logging.getLogger("eagle3pipe.stages.extract")



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


def oracle_memory(v) -> tuple[str | None, str]:
    """(why the oracle is skipped, or None; what it holds): the embedding and the largest
    decoder layer in float32 (streaming holds one layer at a time), against oracle_budget()."""
    per_layer, embedding = v.float32_bytes()
    sizes = {i: per_layer.get(i, 0) for i in range(v.info.num_hidden_layers)}
    big = max(sizes, key=lambda i: (sizes[i], -i))
    need = embedding + sizes[big]
    holds = (f"one layer at a time: the embedding ({human(embedding)}) and the largest layer "
             f"(layer {big}, {human(sizes[big])}) in float32, {human(need)} of the decoder's "
             f"{human(embedding + sum(sizes.values()))}")
    budget, source = oracle_budget()
    if budget is not None and need > budget:
        return (f"{v.model_dir}: the oracle needs the embedding ({human(embedding)}) and its "
                f"largest decoder layer (layer {big}, {human(sizes[big])}) in float32, "
                f"{human(need)}: more than {source} ({human(budget)})"), holds
    return None, holds


def tf_load(v):
    """The verifier's decoder in transformers, float32, eval mode: a wrapper's text_config with
    its tensors' prefix stripped, kimi_k2 as DeepseekV3 (eagle3pipe.verifier.families; its
    checkpoint conversions: families.register_with_transformers, which v.hf_config() calls)."""
    from transformers import AutoModelForCausalLM

    config = v.hf_config()  # registers kimi_k2 and its checkpoint conversions
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
    """vLLM's states, as the stage stores them (in extract.dtype: the comparison includes that
    rounding, ~2e-3 for bfloat16), for the first extract.oracle_samples distinct training
    samples (they share the chat template's prefix; the metrics count the positions compared
    after it, where attention mixes what differs), against transformers' float32 recomputation (eagle3pipe.hidden.streaming.stream): slot k
    from vLLM's slot k - 1 through its segment's layers, slot 0 from the token ids, at every
    position but those where a MoE router of the slot's segment chose at a near tie
    (streaming.NEAR_TIE: a bf16 engine may rightly pick the other expert there; counted). Per
    slot the relative error ||stored - hf|| / ||hf|| over a sample, the largest recorded, and where the largest per-position one is; above extract.oracle_tolerance the
    stage fails, naming the sample, the slot, its segment and the worst position. Skipped, and
    said so, when the embedding and the largest layer do not fit oracle_budget().

    vLLM's states are its input, so it runs on what the engine hands over (`see`, by store
    key: a repeated sample is captured once): it holds the oracle samples back and, once the
    last of those the engine computes (`expect`) has arrived, runs one pass over them (every
    layer loaded once), then releases them for storing; `finish` runs one over those the store
    already held, and returns the metrics."""

    def __init__(self, v: Verifier, samples: list[Sample], keys: list[str], aux: list[int], e):
        self.v, self.samples, self.aux, self.e = v, samples, aux, e
        self.chosen = distinct(samples, e.oracle_samples)
        self.n = len(self.chosen)
        self.names = slot_names(aux)
        self.segments = segments(aux, v.info.num_hidden_layers)
        self.worst = [0.0] * len(self.names)
        self.where: list[tuple[float, int, int] | None] = [None] * len(self.names)
        self.near_ties = [0] * len(self.names)  # positions left out: a MoE router's near tie
        self.by_key: dict[str, list[int]] = {}  # oracle samples not handed over yet
        self.states: dict[int, torch.Tensor] = {}  # handed over, waiting for a pass
        self.held: dict[str, torch.Tensor] = {}  # held back from the store until it passes
        self.waiting: set[str] = set()
        self.skipped = self.memory = None
        if self.n == 0:
            self.skipped = "extract.oracle_samples is 0"
            return
        self.skipped, self.memory = oracle_memory(v)
        if self.skipped:
            log.warning("transformers oracle skipped: %s", self.skipped)
            return
        for i in self.chosen:
            self.by_key.setdefault(keys[i], []).append(i)
        self.waiting = set(self.by_key)

    def expect(self, keys: Iterable[str]) -> None:
        """The store keys the engine is about to hand over: the pass runs once the oracle
        samples among them have all arrived (the others are in the store: `finish`)."""
        self.waiting = set(self.by_key) & set(keys)

    def see(self, key: str, got: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A sample the engine handed over, as stored: the (key, states) that may be stored
        now (an oracle sample's once the pass over them passed; it raises otherwise)."""
        if key not in self.by_key:
            return [(key, got)]
        for i in self.by_key.pop(key):
            self.states[i] = got
        self.held[key] = got
        self.waiting.discard(key)
        if self.waiting:
            return []
        self._pass()
        released, self.held = list(self.held.items()), {}
        return released

    def finish(self, stored: Callable[[int], torch.Tensor]) -> dict:
        if self.skipped:
            return {"samples": 0, "skipped": self.skipped}
        for i in sorted(i for ids in self.by_key.values() for i in ids):
            self.states[i] = stored(i)
        self.by_key.clear()
        self._pass()
        return self._metrics()

    def _pass(self) -> None:
        todo = sorted(self.states)
        if not todo:
            return
        log.info("transformers oracle: %d samples through %d decoder layers, %s", len(todo),
                 self.v.info.num_hidden_layers, self.memory)
        refs, ties = stream(self.v, self.aux,
                            [(self.samples[i].input_ids, self.states[i]) for i in todo])
        for i, ref, tie in zip(todo, refs, ties):
            self._compare(i, self.states.pop(i), ref, tie)

    def _metrics(self) -> dict:
        segs = {}
        for k, (src, first, last) in enumerate(self.segments):
            err, i, p = self.where[k] or (0.0, None, None)
            segs[self.names[k]] = {"from": src, "layers": [first, last] if first <= last else [],
                                   "worst_sample": i, "worst_position": p,
                                   "worst_position_error": float(f"{err:.2g}"),
                                   "router_near_ties": self.near_ties[k]}
        prefix = common_prefix([self.samples[i].input_ids for i in self.chosen])
        after = sum(len(self.samples[i].input_ids) - prefix for i in self.chosen)
        return {"samples": self.n, "tolerance": self.e.oracle_tolerance,
                "common_prefix_tokens": prefix, "positions_after_common_prefix": after,
                "compared": f"every position of {self.n} samples but a MoE router's near ties "
                            f"(NEAR_TIE {NEAR_TIE}); each slot recomputed in float32 from the "
                            "previous slot's vLLM capture (the first from the token ids) "
                            "through its segment's layers",
                "memory": self.memory,
                "max_rel_error": {name: float(f"{w:.2g}")
                                  for name, w in zip(self.names, self.worst)},
                "segments": segs}

    def _compare(self, i: int, got: torch.Tensor, ref: torch.Tensor, tie: torch.Tensor) -> None:
        """Sample i's stored states against the recomputed ones, slot by slot, at every
        position but those where a router of the slot's segment chose at a near tie (`tie`
        [T, slots]: there a bf16 engine may rightly route to another expert)."""
        keep = (~tie).to(torch.float32)[..., None]
        diff, ref = (got.to(torch.float32) - ref) * keep, ref * keep
        norm = torch.linalg.vector_norm
        errs = (norm(diff, dim=(0, 2)) / norm(ref, dim=(0, 2)).clamp_min(1e-30)).tolist()
        at, pos = (norm(diff, dim=2) / norm(ref, dim=2).clamp_min(1e-30)).max(dim=0)
        for k, n in enumerate(tie.sum(dim=0).tolist()):
            self.near_ties[k] += n
        for k, err in enumerate(errs):
            self.worst[k] = max(self.worst[k], err)
            if self.where[k] is None or float(at[k]) > self.where[k][0]:
                self.where[k] = (float(at[k]), i, int(pos[k]))
        tol = self.e.oracle_tolerance
        bad = [k for k, err in enumerate(errs) if err > tol]
        if bad:
            raise ExtractError(
                f"vLLM's hidden states differ from transformers' beyond "
                f"extract.oracle_tolerance {tol} on train sample {i} ({self.samples[i].id}), "
                "nothing published: " + "; ".join(
                    f"{self.names[k]} {errs[k]:.4f} (its segment: {_segment(self.segments[k])}"
                    f"; worst at position {int(pos[k])}, {float(at[k]):.4f})" for k in bad),
                fix=CAUSES)


def distinct(samples: list[Sample], n: int) -> list[int]:
    """The first n training samples whose token ids differ (a repeated prompt is checked once:
    the oracle's samples share the chat template's prefix and differ after it)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for i, s in enumerate(samples):
        if len(out) == n:
            break
        if tuple(s.input_ids) not in seen:
            seen.add(tuple(s.input_ids))
            out.append(i)
    return out


def common_prefix(ids: list[list[int]]) -> int:
    """The number of leading tokens every one of `ids` shares (the chat template's prefix)."""
    if not ids:
        return 0
    n = min(map(len, ids))
    return next((p for p in range(n) if len({t[p] for t in ids}) > 1), n)


@dataclass(frozen=True)
class OracleSettings:
    """The extract section's oracle keys, as the on-demand manifest carries them to the train
    stage (the Oracle reads these two of whatever settings object it is given)."""
    oracle_samples: int
    oracle_tolerance: float


def check_engine(compute: Callable[[list[list[int]]], Iterable[tuple[int, torch.Tensor]]],
                 v: Verifier, m, keys: list[str], tokens: dict[str, list[int]]) -> dict:
    """The on-demand producer's engine (extract.mode online or hybrid: an engine in the train
    stage, or the server at extract.endpoint) through the extract stage's oracle, with the
    settings the on-demand manifest `m` carries (eagle3pipe.hidden.online.Manifest), on the
    first pack the trainer reads (`keys`), before the producer starts and so before any
    training step: the oracle's samples among them are captured through `compute` (the
    producer's own), cast to the stored dtype, and checked; they are not stored (the producer
    computes them again). The metrics, or an ExtractError."""
    from eagle3pipe.hidden.spec import torch_dtype

    samples = [Sample(k, tuple(tokens[k]), ()) for k in keys]
    oracle = Oracle(v, samples, keys, m.aux_layer_ids, OracleSettings(**m.oracle))
    got: dict[int, torch.Tensor] = {}
    if not oracle.skipped:
        chosen = oracle.chosen
        for j, hidden in compute([list(samples[i].input_ids) for i in chosen]):
            got[chosen[j]] = hidden.to(torch_dtype(m.dtype)).contiguous()
    return oracle.finish(got.__getitem__)


def oracle_check(v: Verifier, samples: list[Sample], stored: Callable[[int], torch.Tensor],
                 aux: list[int], e) -> dict:
    """The Oracle on `stored(i)`, sample i's states as published, for the first
    extract.oracle_samples of `samples`: the metrics, or an ExtractError."""
    oracle = Oracle(v, samples, [str(i) for i in range(len(samples))], aux, e)
    return oracle.finish(stored)


def _segment(seg: tuple[str, int, int]) -> str:
    src, first, last = seg
    start = "the token ids' embedding" if src == "token ids" else f"vLLM's {src}"
    return f"{start} through {span(first, last)}"


CAUSES = ("in the first segment named: a layer that vLLM and transformers implement "
          "differently, weights vLLM loaded that differ from the checkpoint's files, a config "
          "field one of them ignores (rope scaling, a sliding window, ...), or capture slots "
          "that are not the layers they name (the aux ids; a wrong slot also fails the next "
          "slot's segment, which starts from it); check the verifier's architecture support in "
          "vLLM and transformers (see docs/verifier.md); raise extract.oracle_tolerance only if "
          "the difference is known (an engine computing in bfloat16, vllm.dtype, differs from "
          "float32 by about 1% per decoder layer: 0.02-0.03 then)")
