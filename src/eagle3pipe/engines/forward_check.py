"""Training equals serving, tensor for tensor: an exported EAGLE-3 draft's logits in vLLM and in
speculators on the same inputs, at every speculative step, with no engine (issue 36).

The draft's switches (norm_before_fc, fc_norm, norm_output, the llama or qwen3 decoder layer)
are implemented twice, each side reading them from its own config: for training in speculators
(models/eagle3/core.py `Eagle3DraftModel.forward`, model_definitions.py
`Eagle3FirstLayerMixin.forward`), for serving in vLLM (model_executor/models/llama_eagle3.py,
qwen3_eagle3.py: `combine_hidden_states`, `LlamaModel` / `Qwen3Eagle3Model.forward`,
`compute_logits`). `compare` runs both and reports per step how far their logits are apart.

vLLM's side: its draft class instantiated and loaded from the export as engines/load_check.py
does (`load_draft`: the VllmConfig an engine builds, here float32 and eager), the verifier's
embedding where the draft has none (llm_base_proposer.py `_maybe_share_embeddings`), driven as
`propose()` (v1/spec_decode/llm_base_proposer.py) drives it for one greedy request: step 1 over
the prefix at positions 0..T-1 after `combine_hidden_states`, step j > 1 one token (the previous
step's argmax target id: `compute_logits` maps d2t) at position T-2+j with the previous step's
`aux_output` as hidden input. Only the attention kernel is replaced: vLLM's `Attention` needs an
engine's forward context and KV cache, so `_CausalSDPA` stands in for the `attn` module of each
`self_attn`: causal scaled-dot-product attention (GQA) over the keys and values seen so far, on
the q, k, v from vLLM's own qkv_proj, q/k norms and rotary. Everything else (projections, norms,
switches, fc, residuals, lm_head, d2t) is vLLM's own code.

speculators' side: `Eagle3DraftModel` built as eagle3pipe.stages.train.model.build_model builds it
(config, `load_vocab_mappings`, `load_verifier_weights`) from the speculators config training
used, the export's tensors loaded over it (flat names renamed `midlayer.` -> `layers.0.`, draft/arch.py
`rename`). Its own `forward` runs (every switch, the `config.norm_output` branch included, is
speculators' code), with training's CPU attention (sdpa), training's positions (1 + index, what
shift_batch gives: vLLM's plus 1 everywhere, and RoPE scores depend on differences only) and
its TTT schedule: at step j (ttt_steps=j) position T-1 attends the prefix and its own keys of
the earlier steps, the KV cache serving holds. TTT teacher-forces input id T-2+j to position
T-1 at step j, so the prefix is extended by the tokens drafted so far (later positions, unseen
by T-1 under the causal mask); the logits are read from `lm_head` by a forward hook. speculators
builds its rotary for 2x hidden (core.py), but transformers takes the rotary dim from head_dim,
explicit in every rendered config (formats.py), so both sides rotate head_dim.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3pipe.draft import arch as archmod
from eagle3pipe.engines import load_check
from eagle3pipe.errors import Error
from eagle3pipe.verifier import families
from eagle3pipe.verifier.handle import VerifierInfo

# Largest logit difference accepted, relative to the largest |logit| of speculators' side. Both
# sides compute in float32 and differ only in the order of their sums: measured on the micro
# drafts of tests/test_forward_check.py (12 switch/layer combinations x 2 layouts, every step
# and prefix position) at most 4e-7 with their weights (|logit| <= 2), 3e-6 with 6x larger ones
# (|logit| ~ 9); a config switch read by one side only moves them by 0.16-0.38. 1e-4 is 30x
# above the first and 1000x below the second.
TOLERANCE = 1e-4
SPECULATORS_ATTN = "sdpa"  # runtime/distributed.py backend_for("cpu"): training's CPU attention
# what speculators' model takes from the verifier, not from a draft checkpoint
FROM_VERIFIER = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
REFERENCE_FIX = ("pass reference= the config.json (speculators format) the draft was trained "
                 "with, or re-export the draft (`dvc repro export`)")


class ForwardCheckError(Error, ValueError):
    """The comparison could not run: inputs or files that do not fit; names file and fix."""


@dataclass
class StepDiff:
    """One speculative step's logits, vLLM's against speculators', over the target vocab."""
    step: int  # 1..k
    positions: int  # positions compared (step 1: all of the prefix, or only the last)
    max_abs: float  # max |vLLM - speculators| (entries -inf on both sides count 0)
    max_rel: float  # max_abs / max |speculators' logit|
    agree: int  # positions whose argmax agrees
    vllm_token: int  # argmax at the last position (target id)
    speculators_token: int

    def ok(self, tolerance: float) -> bool:
        return math.isfinite(self.max_rel) and self.max_rel <= tolerance \
            and self.agree == self.positions

    def line(self, tolerance: float) -> str:
        where = f" (all {self.positions} positions)" if self.positions > 1 else ""
        return (f"step {self.step}{where}: max |diff| {self.max_abs:.3g}, relative "
                f"{self.max_rel:.3g} "
                f"(tolerance {tolerance:g}); argmax agrees at {self.agree}/{self.positions}, "
                f"last: vLLM {self.vllm_token}, speculators {self.speculators_token}: "
                f"{'ok' if self.ok(tolerance) else 'DIFFERS'}")


@dataclass
class Report:
    draft_dir: str
    reference: str  # the speculators config speculators' side was built from
    architecture: str = ""  # vLLM's draft class
    tolerance: float = TOLERANCE
    steps: list[StepDiff] = field(default_factory=list)  # the last position, steps 1..k
    prefix: StepDiff | None = None  # step 1 at every position of the prefix
    load_problems: list[str] = field(default_factory=list)  # load_check's findings
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.steps) and self.first_failure is None

    @property
    def first_failure(self) -> StepDiff | None:
        both = ([self.prefix] if self.prefix else []) + self.steps
        return next((d for d in both if not d.ok(self.tolerance)), None)

    def summary(self) -> str:
        head = (f"{self.draft_dir}: vLLM's {self.architecture} vs speculators' Eagle3DraftModel "
                f"({self.reference}): " + ("same logits" if self.ok else
                                           f"differ from step {self.first_failure.step}"))
        rows = [d.line(self.tolerance) for d in ([self.prefix] if self.prefix else [])
                + self.steps]
        return "\n".join([head, *("  " + r for r in rows + self.load_problems)])


def compare(settings: dict, verifier_dir: str | Path, draft_dir: str | Path, *,
            hidden_states: torch.Tensor, input_ids: torch.Tensor, steps: int = 3,
            reference: str | Path | dict | None = None,
            tolerance: float = TOLERANCE) -> Report:
    """vLLM's and speculators' logits for the last position of the prefix at steps 1..`steps`
    (and step 1 at every position). `settings`: the run's engine settings (engine.settings_of;
    dtype and enforce_eager are overridden to float32 and true); `hidden_states` [T, 3H] the
    captured aux states, `input_ids` [T] the draft's input tokens (the shifted prompt);
    `reference`: the speculators-format config training used (a config.json or its dict;
    default `reference_config`'s choice)."""
    t0 = time.perf_counter()
    ref, ref_name = reference_config(draft_dir, reference)
    hidden, ids = _inputs(hidden_states, input_ids, ref)
    report = Report(str(draft_dir), ref_name, tolerance=tolerance)
    spec = speculators_model(ref, verifier_dir, draft_dir)
    vllm_logits, tokens = vllm_draft(settings, verifier_dir, draft_dir, hidden, ids, steps,
                                     report)
    spec_logits = speculators_draft(spec, hidden, ids, tokens)
    report.prefix = _diff(1, vllm_logits[0], spec_logits[0])
    report.steps = [_diff(j + 1, v[-1:], s[-1:])
                    for j, (v, s) in enumerate(zip(vllm_logits, spec_logits))]
    report.seconds = time.perf_counter() - t0
    return report


def random_inputs(verifier_dir: str | Path, *, length: int, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded [length, 3H] aux states (unit normal, like a verifier's pre-norm states after its
    first layers) and [length] token ids below the verifier's vocab size."""
    info = VerifierInfo.from_config(verifier_dir)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(length, archmod.NUM_AUX * info.hidden_size, generator=g)
    return hidden, torch.randint(info.vocab_size, (length,), generator=g)


def reference_config(draft_dir: str | Path, reference: str | Path | dict | None
                     ) -> tuple[dict, str]:
    """(the speculators config dict, where it came from). None: the draft's own config.json if
    it is speculators' format (then a switch edited there reaches both sides alike), else the
    export's sibling speculators/config.json (export/vllm -> export/speculators)."""
    if reference is None:
        cands = [Path(draft_dir) / "config.json",
                 Path(draft_dir).parent / "speculators" / "config.json"]
        reference = next((c for c in cands if c.is_file()
                          and "speculators_model_type" in _read_json(c)), cands[-1])
    if isinstance(reference, dict):
        cfg, source = reference, "the given reference config"
    else:
        path = Path(reference) / "config.json" if Path(reference).is_dir() else Path(reference)
        cfg, source = _read_json(path), str(path)
    if "speculators_model_type" not in cfg or "speculators_config" not in cfg:
        raise ForwardCheckError(f"{source}: not a speculators-format config (no "
                                "speculators_model_type / speculators_config)", fix=REFERENCE_FIX)
    return cfg, source


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ForwardCheckError(f"{path}: cannot read the draft's training config: {e}",
                                fix=REFERENCE_FIX) from e


def _inputs(hidden_states, input_ids, ref: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs as float32 [T, 3H] and int64 [T], checked against the reference config."""
    tl = ref.get("transformer_layer_config") or {}
    width = archmod.NUM_AUX * int(ref.get("target_hidden_size") or tl.get("hidden_size", 0))
    hidden = torch.as_tensor(hidden_states).detach().to("cpu", torch.float32)
    ids = torch.as_tensor(input_ids).detach().to("cpu", torch.int64).reshape(-1)
    if hidden.dim() != 2 or hidden.shape != (ids.shape[0], width) or ids.numel() == 0:
        raise ForwardCheckError(
            f"hidden_states {list(hidden.shape)} and input_ids {list(ids.shape)} do not fit: "
            f"expected [T, {width}] (3 aux states of hidden {width // 3}) and [T], T > 0",
            fix="pass one sample's captured aux states and its draft input ids")
    vocab = int(tl.get("vocab_size", 0))
    if vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ForwardCheckError(f"input_ids outside the verifier's vocab 0..{vocab - 1}",
                                fix="pass token ids of the verifier's tokenizer")
    return hidden, ids


# ---------------------------------------------------------------------------------------------
# speculators: the training side


def speculators_model(ref: dict, verifier_dir: str | Path, draft_dir: str | Path):
    """Eagle3DraftModel as stages.train.model.build_model makes it (speculators' Eagle3DraftModel.__init__,
    load_vocab_mappings, load_verifier_weights), from `ref` with the verifier at
    `verifier_dir`, then the export's tensors (load_state_dict): float32, eval mode. Raises
    when a tensor the config implies is missing from the export, or one is left over."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    families.register_with_transformers()  # speculators reads the verifier through AutoConfig
    cfg = copy.deepcopy(ref)
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(verifier_dir)
    tensors = export_tensors(draft_dir)
    try:
        config = Eagle3SpeculatorConfig.from_dict(cfg)
        config.transformer_layer_config._attn_implementation = SPECULATORS_ATTN
        with torch.random.fork_rng():  # __init__'s random weights are all replaced below
            model = Eagle3DraftModel(config)
        model.load_vocab_mappings(tensors["t2d"], tensors["d2t"])
        model.load_verifier_weights()
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except (KeyError, ValueError, RuntimeError) as e:  # no d2t/t2d; speculators' refusal
        raise ForwardCheckError(f"{draft_dir}: speculators cannot build the reference draft "
                                f"with the export's tensors: {type(e).__name__}: "
                                f"{str(e).strip()[:500]}", fix=REFERENCE_FIX) from e
    missing = sorted(set(missing) - set(FROM_VERIFIER))
    if missing or unexpected:
        raise ForwardCheckError(
            f"{draft_dir}: the export does not hold the tensors of the draft the reference "
            f"config describes: missing {missing}, left over {sorted(unexpected)}",
            fix=REFERENCE_FIX)
    return model.float().eval()


def export_tensors(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export's *.safetensors under speculators' names."""
    from safetensors.torch import load_file

    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if not files:
        raise ForwardCheckError(f"{draft_dir}: no *.safetensors file", fix=REFERENCE_FIX)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            out[archmod.rename(name, "vllm", "speculators")] = t
    return out


@torch.no_grad()
def speculators_draft(model, hidden: torch.Tensor, ids: torch.Tensor,
                      tokens: list[int]) -> list[torch.Tensor]:
    """speculators' own forward (core.py Eagle3DraftModel.forward), once per step j with
    ttt_steps=j over the prefix extended by tokens[:j-1] (teacher forcing feeds input id
    T-2+j to position T-1 at step j; the extension's aux states are zeros, unseen by T-1).
    Returns per step the target-vocab logits: step 1 at every prefix position, step j > 1 at
    the last."""
    T = ids.shape[0]
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    logits = []
    try:
        for j in range(1, len(tokens) + 1):
            seen.clear()
            ext = torch.cat([ids, torch.tensor(tokens[:j - 1], dtype=torch.int64)])[None]
            pad = hidden.new_zeros(j - 1, hidden.shape[1])
            model(hidden_states=torch.cat([hidden, pad])[None], input_ids=ext,
                  document_ids=torch.zeros_like(ext), ttt_steps=j)
            logits.append(seen[j - 1][0, :T] if j == 1 else seen[j - 1][0, T - 1:T])
    finally:
        hook.remove()
    return [_target_vocab(lg, model.d2t, model.t2d.shape[0]) for lg in logits]


def _target_vocab(logits: torch.Tensor, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft-vocab logits at their target ids (draft + d2t[draft], speculators' convention:
    models/xpress/core.py), -inf elsewhere: vLLM's compute_logits layout."""
    out = logits.new_full((logits.shape[0], vocab), float("-inf"))
    out[:, torch.arange(d2t.shape[0]) + d2t] = logits
    return out


# ---------------------------------------------------------------------------------------------
# vLLM: the serving side


def vllm_draft(settings: dict, verifier_dir: str | Path, draft_dir: str | Path,
               hidden: torch.Tensor, ids: torch.Tensor, steps: int,
               report: Report) -> tuple[list[torch.Tensor], list[int]]:
    """vLLM's draft class loaded by load_check.load_draft (float32, eager), the verifier's
    embedding shared where the draft has none, vLLM's process_weights_after_loading, attention
    replaced by _CausalSDPA, driven by `_propose`: (target-vocab logits, argmax) per step."""
    run = {**settings, "dtype": "float32", "enforce_eager": True}
    rep, load = load_check.load_draft(run, verifier_dir, draft_dir, num_speculative_tokens=steps)
    report.architecture, report.load_problems = rep.architecture, list(rep.problems)
    if load is None:
        raise ForwardCheckError("\n".join(rep.problems),
                                fix="fix what vLLM raised (see `eagle3pipe check`)")
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with load_check.single_process_group(load.vllm_config), torch.no_grad():
        if rep.shared_embedding:
            _share_embedding(load.model, verifier_dir)
        # vLLM's loader's last step (base_loader.py load_model): the CPU build's GEMM setup
        process_weights_after_loading(load.model, load.vllm_config.speculative_config
                                      .draft_model_config, torch.device("cpu"))
        for layer in load.model.model.layers:
            layer.self_attn.attn = _CausalSDPA(layer.self_attn.attn)
        return _propose(load.model, hidden, ids, steps)


def _propose(model, hidden: torch.Tensor, ids: torch.Tensor,
             steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """llm_base_proposer.py `propose()` for one request, greedy: combine_hidden_states, the
    prefix at positions 0..T-1, then per step one token (the argmax of compute_logits, a target
    id) at the next position with the step's aux_output (the model's second output)."""
    h = model.combine_hidden_states(hidden)
    pos = torch.arange(ids.shape[0], dtype=torch.int64)
    logits, tokens = [], []
    for _ in range(steps):
        last, aux = model(input_ids=ids, positions=pos, hidden_states=h)
        logits.append(model.compute_logits(last).float())
        tokens.append(int(logits[-1][-1].argmax()))
        ids = torch.tensor(tokens[-1:], dtype=torch.int64)
        pos, h = pos[-1:] + 1, aux[-1:]
    return logits, tokens


def _share_embedding(model, verifier_dir: str | Path) -> None:
    """The verifier's embedding rows into the draft's (llm_base_proposer.py
    `_maybe_share_embeddings` shares the target's module; the padding rows are never read)."""
    from safetensors import safe_open

    found = []
    for f in sorted(Path(verifier_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            found += [(f, n) for n in st.keys() if n.endswith("embed_tokens.weight")]
    if len(found) != 1:
        raise ForwardCheckError(
            f"{verifier_dir}: {len(found)} tensors named *embed_tokens.weight, expected one",
            fix="pass the verifier checkpoint the draft was trained for")
    with safe_open(str(found[0][0]), "pt") as st:
        w = st.get_tensor(found[0][1])
    emb = model.model.embed_tokens.weight
    emb.data[:w.shape[0]].copy_(w.to(emb.dtype))


class _CausalSDPA(torch.nn.Module):
    """Stands in for vLLM's `Attention` (model_executor/layers/attention/attention.py), the
    kernel call `self.attn(q, k, v)` of LlamaAttention/Qwen3Attention.forward: keeps every
    call's keys and values, as the KV cache does, and attends each query to the earlier keys and
    the causal part of its own call; each kv head serves num_heads / num_kv_heads query heads
    (GQA, vLLM's order), with vLLM's scale."""

    def __init__(self, attn):
        super().__init__()
        if getattr(attn, "sliding_window", None) is not None:
            raise ForwardCheckError("the draft's attention has a sliding window; this check "
                                    "implements full causal attention only",
                                    fix="compare drafts without sliding-window layers")
        self.heads, self.kv_heads, self.dim = attn.num_heads, attn.num_kv_heads, attn.head_size
        self.scale = float(attn.impl.scale)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def forward(self, q, k, v, output_shape=None, output_dtype=None):
        n = q.shape[0]
        k, v = (x.reshape(n, self.kv_heads, self.dim) for x in (k, v))
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        total = self.k.shape[0]
        mask = (torch.arange(n)[:, None] + total - n) >= torch.arange(total)[None, :]
        rep = self.heads // self.kv_heads
        kk, vv = (x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in (self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(n, self.heads, self.dim).transpose(0, 1), kk, vv, attn_mask=mask,
            scale=self.scale)
        return out.transpose(0, 1).reshape(n, self.heads * self.dim)


def _diff(step: int, v: torch.Tensor, s: torch.Tensor) -> StepDiff:
    """vLLM's [n, vocab] logits `v` against speculators' `s`."""
    both = torch.isneginf(v) & torch.isneginf(s)
    d = (v - s).abs().masked_fill(both, 0.0)
    max_abs = float(d.max()) if not torch.isnan(d).any() else math.nan
    finite = s[torch.isfinite(s)]
    scale = float(finite.abs().max()) if finite.numel() else math.nan
    vt, st = v.argmax(-1), s.argmax(-1)
    # identical logits agree whatever their size (a draft whose logits are all 0 included)
    rel = 0.0 if max_abs == 0 else max_abs / scale if scale else math.inf
    return StepDiff(step, v.shape[0], max_abs, rel,
                    int((vt == st).sum()), int(vt[-1]), int(st[-1]))
