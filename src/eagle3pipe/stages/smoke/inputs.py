"""The smoke stage's inputs: the exported drafts, the serving k and its sweep, the evaluation
prompts and the engine settings, read and checked before any engine starts
(eagle3pipe.stages.smoke.run runs them).

k is the exported speculators config's serving default (proposal method `speculative_tokens`),
so the stage reads no draft params. `smoke.k_sweep` also measures the draft (vllm layout: the
speculators export holds the same weights) and ngram at other k; the sweep recommends a k, it
never rewrites one (vLLM takes another k at serving time from the speculative_config's
`num_speculative_tokens`, without a re-export).

Prompts (eagle3pipe.data.prompts): the held-out stdlib snippets, or a JSONL of chat prompts under
prompts/ with an optional domain; each domain is generated as one batch, and acceptance and
speed are reported per domain as well as overall.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3pipe.data import prompts
from eagle3pipe.data.prompts import STDLIB_SOURCE, Prompt
from eagle3pipe.engines import forward_check
from eagle3pipe.engines import load_check as vllm_load
from eagle3pipe.errors import Error, ParamsAt, Problem
from eagle3pipe.runtime.jsonio import read_json_object
from eagle3pipe.verifier.handle import Verifier

log = logging.getLogger("eagle3pipe.stages.smoke")

FORMATS = ("vllm", "speculators")  # artifacts/export/<format>/
NGRAM = "ngram"
SWEPT = ("vllm", NGRAM)  # what the k sweep runs: the draft (vllm layout) and the baseline

class SmokeError(Error, RuntimeError):
    """A draft that does not load, is not lossless, or does not speculate well enough.
    `metrics` holds what was measured (None when the run stopped before the engines)."""

    def __init__(self, message: str = "", metrics: dict | None = None, *, fix: str = "",
                 problems: list[Problem] | tuple[Problem, ...] = ()):
        super().__init__(message, fix, problems=problems)
        self.metrics = metrics


# ---------------------------------------------------------------------------------------------
# inputs


def export_dirs(export_dir: str | Path) -> dict[str, Path]:
    out = {}
    for fmt in FORMATS:
        d = Path(export_dir) / fmt
        missing = [n for n in ("config.json", "model.safetensors") if not (d / n).is_file()]
        if missing:
            raise SmokeError(f"{d}: {', '.join(missing)} missing; the export stage writes "
                             f"{export_dir}/{{vllm,speculators}}/{{config.json,model.safetensors}}"
                             " (run `dvc repro export`)")
        out[fmt] = d
    return out


def speculative_tokens(export_dir: str | Path) -> int:
    """k: the serving default the export rendered into the speculators config (the
    default proposal method's `speculative_tokens`)."""
    path = Path(export_dir) / "speculators" / "config.json"
    cfg = read_json_object(path, SmokeError, "run `dvc repro export`",
                                   "exported speculators config")
    try:
        sc = cfg["speculators_config"]
        methods = sc["proposal_methods"]
        default = sc.get("default_proposal_method")
        method = next((m for m in methods if m.get("proposal_type") == default), methods[0])
        k = method["speculative_tokens"]
    except (KeyError, IndexError, TypeError):
        raise SmokeError(f"{path}: no speculators_config.proposal_methods[*].speculative_tokens;"
                         " it is rendered from draft.num_speculative_tokens by the configs "
                         "stage (run `dvc repro configs export`)") from None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SmokeError(f"{path}: speculative_tokens must be a positive integer, got {k!r}")
    return k


def sweep_ks(s, k: int, at: ParamsAt = ParamsAt()) -> list[int]:
    """The k values of the sweep (smoke.k_sweep, with the serving k when it is not empty),
    ascending; [] when there is no sweep."""
    ks = list(s.k_sweep)
    bad = [x for x in ks if isinstance(x, bool) or not isinstance(x, int) or x < 1]
    if bad:
        raise SmokeError(problems=[at.problem(
            "smoke.k_sweep", f"{bad[0]!r} is not a positive integer",
            "list k values >= 1, e.g. [1, 2, 3, 4, 5], or [] for no sweep")])
    if len(set(ks)) != len(ks):
        raise SmokeError(problems=[at.problem("smoke.k_sweep", f"{ks} lists a k twice",
                                              f"list each k once: {sorted(set(ks))}")])
    return sorted(set(ks) | {k}) if ks else []


@dataclass
class Inputs:
    """What every engine of a smoke run shares."""
    exports: dict[str, Path]  # format -> artifacts/export/<format>
    k: int  # num_speculative_tokens: the export's serving default
    model_dir: Path  # the verifier's weights
    tokenizer: Any
    prompts: list[Prompt]
    settings: dict  # the run's vLLM engine settings (engine.settings_of)
    verifier: Verifier
    sweep: list[int] = field(default_factory=list)  # k values of the sweep ([]: none)
    source: str = STDLIB_SOURCE  # smoke.prompts, or the stdlib's held-out part

    @property
    def domains(self) -> dict[str, list[int]]:
        """Prompt indices by domain, domains in order of first appearance."""
        out: dict[str, list[int]] = {}
        for i, p in enumerate(self.prompts):
            out.setdefault(p.domain, []).append(i)
        return out


def read_inputs(s, settings: dict, template_kwargs: dict, export_dir: str | Path,
                verifier_dir: str | Path, at: ParamsAt = ParamsAt()) -> Inputs:
    """The exports, k, the sweep, the verifier and the tokenized prompts; vllm.max_model_len
    must fit the longest prompt, its generation and one speculative step past it."""
    exports = export_dirs(export_dir)
    k = speculative_tokens(export_dir)
    sweep = sweep_ks(s, k, at)
    # fails fast on a vanished or changed external checkpoint
    v = Verifier(verifier_dir, trust_remote_code=settings["trust_remote_code"])
    tok = v.tokenizer()
    ps, source = prompts.load(s, tok, template_kwargs, at)
    longest = max(ps, key=lambda p: len(p.ids))
    kmax = max([k, *sweep])
    log.info("verifier %s, k=%d%s, %d prompts from %s in %d domain(s) (longest %d tokens), "
             "max_tokens %d", v.model_dir, k, f", k sweep {sweep}" if sweep else "",
             len(ps), source, len({p.domain for p in ps}), len(longest.ids),
             s.max_tokens)
    need = len(longest.ids) + s.max_tokens + kmax + 1
    if need > settings["max_model_len"]:
        raise SmokeError(f"vllm.max_model_len {settings['max_model_len']} is shorter than the "
                         f"longest smoke prompt ({len(longest.ids)} tokens, {longest.source}) "
                         f"+ smoke.max_tokens ({s.max_tokens}) + k + 1 = {need}"
                         + (f" (k = {kmax}, the largest of the k sweep)" if kmax > k else ""),
                         fix=f"raise vllm.max_model_len to at least {need} or lower "
                         "smoke.max_tokens" + (" or shorten the prompt" if s.prompts else ""))
    return Inputs(exports, k, v.model_dir, tok, ps, settings, v, sweep, source)


# ---------------------------------------------------------------------------------------------
# load checks


def check_loads(s, inp: Inputs) -> None:
    """The engine-less load check of every format (before any engine starts); raises
    SmokeError listing every problem."""
    problems = []
    for fmt, d in inp.exports.items():
        rep = vllm_load.check_draft(inp.settings, inp.model_dir, d,
                                    num_speculative_tokens=inp.k)
        log.info("%s: engine-less load check (%s) %s in %.1f s%s", fmt,
                 rep.architecture or "?", "ok" if rep.ok else "FAILED", rep.seconds,
                 "; shared verifier embedding" if rep.shared_embedding else "")
        problems += rep.problems
    if problems:
        raise SmokeError("engine-less vLLM load check failed (each would start an engine "
                         "silently broken, or fail inside it):\n"
                         + "\n".join(f"  - {p}" for p in problems))


# what the forward check runs on: seeded aux states and tokens of this length (the check is of
# the two implementations, not of the data: any inputs that reach every switch will do)
FORWARD_CHECK_TOKENS = 16


def check_forwards(s, inp: Inputs) -> dict[str, dict]:
    """Training equals serving for every format: vLLM's draft class loaded from the export and
    speculators' Eagle3DraftModel built from the speculators config give the same logits at
    every speculative step (eagle3pipe.engines.forward_check), before any engine starts; a
    switch one side ignores or misreads (norm_before_fc, fc_norm, norm_output, the layer type)
    raises SmokeError naming the step and the figure. Returns per format what metrics record."""
    hidden, ids = forward_check.random_inputs(inp.model_dir, length=FORWARD_CHECK_TOKENS,
                                              seed=s.seed)
    out, failed = {}, []
    for fmt, d in inp.exports.items():
        rep = forward_check.compare(inp.settings, inp.model_dir, d, hidden_states=hidden,
                                    input_ids=ids, steps=inp.k)
        log.info("%s: training-vs-serving forward check %s in %.1f s", fmt,
                 "ok" if rep.ok else "FAILED", rep.seconds)
        out[fmt] = {"ok": rep.ok, "tolerance": rep.tolerance,
                    "max_rel_per_step": [float(f"{d.max_rel:.3g}") for d in rep.steps]}
        if not rep.ok:
            failed.append(rep.summary())
    if failed:
        raise SmokeError("vLLM and speculators compute different drafts from the same export "
                         "(a switch one of them ignores or reads otherwise):\n" + "\n".join(failed),
                         fix="compare the export's config.json with configs/ and params.yaml "
                         "(`eagle3pipe check --checkpoint`); if they agree, the installed vLLM "
                         "or speculators implements a switch differently: pin the versions in "
                         "requirements.lock or set the switch to false")
    return out
