"""The verifier stage: build the embedded verifier, or fingerprint an existing checkpoint.

Output directory (artifacts/verifier/), always: config.json, the tokenizer files, manifest.json.
  embedded (verifier.path: null): the whole Hugging Face checkpoint that embedded.build writes
      (model.safetensors included) and a manifest {"mode": "embedded", "path": null, "files":
      {name: {"size", "sha256"}}}.
  path mode (verifier.path: DIR): COPIES of DIR's config.json and tokenizer files (small) and a
      manifest {"mode": "headers"|"full", "path": DIR resolved to absolute, "files": ...} as
      fingerprint.py describes. The weights stay where they are; downstream stages load them
      from `model_dir(artifacts/verifier)`, and depend (through DVC) on the manifest, so a
      changed header, size, config or tokenizer changes the stage's output and reruns them.

Before anything is written, the verifier is checked against the draft params (arch.derive), so
a params.yaml that cannot work with this verifier fails here, naming the key and the fix, and
the preflight (preflight.py) checks what the installed transformers and vLLM can do with the
checkpoint: an error stops the stage, naming the verifier file and the fix; a limit of this
machine's vLLM is logged and recorded in the metrics (`preflight_limits`).
"""
from __future__ import annotations

import fnmatch
import logging
import shutil
import time
from pathlib import Path

from eagle3pipe.config.cross_check import tp_problem
from eagle3pipe.config.view import StageView
from eagle3pipe.errors import Problem
from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.runtime.jsonio import dumps
from eagle3pipe.runtime.kernels import kernels
from eagle3pipe.stages.runner import Paths
from eagle3pipe.verifier import fingerprint as fp
from eagle3pipe.verifier.handle import MANIFEST, VerifierError, VerifierInfo

log = logging.getLogger("eagle3pipe.stages.verifier")

# Small top-level files of a checkpoint that downstream stages read without the weights: the
# config, the tokenizer in every format transformers knows, the chat template, generation
# defaults, and remote code (trust_remote_code tokenizers such as Kimi's tokenization_kimi.py).
COPY_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json", "tokenizer.model", "tiktoken.model",
                 "*.tiktoken", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                 "sentencepiece*.model", "preprocessor_config.json", "processor_config.json",
                 "*.py")
COPY_LIMIT = 64 * 1024 * 1024


# ---------------------------------------------------------------------------------------------
# The stage


def build(vp, out_dir: str | Path, *, draft=None, params_file: str = "params.yaml",
          lines: dict | None = None, base_dir: str | Path = ".", progress: bool = True,
          tp: int = 1, engine: dict | None = None) -> dict:
    """Runs the verifier stage into out_dir (atomically) and returns its metrics.

    vp: the params' `verifier` section (a params.StageView or VerifierParams).
    draft: the params' `draft` section, used ONLY to validate the verifier against it (arch.derive
        raises ArchError naming the key); None skips that check. It never changes an output.
    base_dir: what a relative verifier.path is relative to (the project root, where DVC runs).
    engine: {"trust_remote_code", "dtype"} of the params' `vllm:` section, for the preflight
        (None skips it).
    """
    pre = None if engine is None else (lambda d: preflight(d, engine, params_file, lines))
    if vp.path is None:
        return _run_embedded(vp.embedded, out_dir, draft=draft, params_file=params_file,
                             lines=lines, progress=progress, tp=tp, pre=pre)
    return _run_path(Path(base_dir), vp.path, vp.hash_mode, out_dir, draft=draft,
                     params_file=params_file, lines=lines, progress=progress, tp=tp, pre=pre)


def preflight(d: Path, engine: dict, params_file: str, lines: dict | None) -> list[str]:
    """preflight.check on the checkpoint in d: raises VerifierError on any error; returns the
    limits (as text) after logging them."""
    from eagle3pipe.engines import preflight as pf
    errors, limits = pf.check(d, trust_remote_code=engine["trust_remote_code"],
                              dtype=engine["dtype"], params_file=params_file, lines=lines)
    pf.report(errors, limits)
    if errors:
        raise VerifierError("the verifier preflight failed before any compute:", problems=errors)
    return [str(f) for f in limits]


def check_draft(draft, info: VerifierInfo, *, params_file: str = "params.yaml",
                lines: dict | None = None, tp: int = 1):
    """arch.derive's cross-checks of the draft params against a verifier (raises ArchError),
    and the verifier's heads against vllm.tensor_parallel_size `tp` (vLLM shards them over the
    ranks; it would refuse only after loading the weights)."""
    from eagle3pipe.draft import arch

    bad = tp_problem(tp, info.num_attention_heads, info.num_key_value_heads, "verifier",
                     f"vLLM shards its heads over the ranks ({info.source})")
    if bad:
        key = "vllm.tensor_parallel_size"
        raise arch.ArchError([Problem(params_file, (lines or {}).get(key), key, *bad)])
    return arch.derive(draft, info, params_file=params_file, lines=lines)


def _run_embedded(e, out_dir, *, draft, params_file, lines, progress, tp, pre) -> dict:
    if draft is not None:  # fail before building anything
        planned = VerifierInfo(
            source=f"{params_file} verifier.embedded (the embedded verifier to be built)",
            hidden_size=e.hidden_size, num_hidden_layers=e.num_hidden_layers,
            vocab_size=e.tokenizer_vocab_size, num_attention_heads=e.num_attention_heads,
            bos_token_id=None, eos_token_id=None, model_type="llama",
            architectures=("LlamaForCausalLM",))
        check_draft(draft, planned, params_file=params_file, lines=lines, tp=tp)
    from eagle3pipe.verifier import embedded  # imports torch: after the check

    t0 = time.perf_counter()
    with atomic_dir(out_dir) as tmp:
        metrics = embedded.build(e, tmp, progress=progress)
        info = VerifierInfo.from_config(tmp / "config.json")
        if draft is not None:
            check_draft(draft, info, params_file=params_file, lines=lines, tp=tp)
        limits = pre(tmp) if pre else []
        body = fp.fingerprint(tmp, "full", progress=False)
        manifest = {"mode": "embedded", "path": None, **{k: body[k] for k in ("files",
                                                                             "n_files",
                                                                             "total_bytes")}}
        (tmp / MANIFEST).write_text(dumps(manifest))
    # timings go to the log: committed metrics must be byte-identical on rerun
    log.info("embedded build took %.1f s", time.perf_counter() - t0)
    return {"mode": "embedded", **metrics, "n_files": manifest["n_files"],
            "total_bytes": manifest["total_bytes"], "hidden_size": info.hidden_size,
            "num_hidden_layers": info.num_hidden_layers, "preflight_limits": limits}


def _run_path(base_dir: Path, path: str, mode: str, out_dir, *, draft, params_file, lines,
              progress, tp, pre) -> dict:
    src = (base_dir / Path(path).expanduser()).resolve()
    if not src.is_dir():
        raise VerifierError(f"{params_file}: verifier.path: {path!r} ({src}) is not a directory",
                            fix="point it at a Hugging Face checkpoint directory (the one "
                            "holding config.json), or set it to null for the embedded verifier")
    info = VerifierInfo.from_config(src / "config.json")  # decoder-only, hidden/layers/vocab
    if draft is not None:
        check_draft(draft, info, params_file=params_file, lines=lines, tp=tp)
    limits = pre(src) if pre else []
    body, seconds = fp.timed_fingerprint(src, mode, progress=progress)
    log.info("%s-mode fingerprint of %s took %.3f s", mode, src, seconds)
    weights = [n for n in body["files"] if fp.kind_of(n) != "other"]
    if not weights:
        log.warning("%s has no weight files: configs can be rendered and checked, but the "
                    "stages that run the verifier (dataset, extract, smoke) will fail", src)
    copied = [n for n in body["files"] if "/" not in n and _copied(n, body["files"][n]["size"])]
    manifest = {"mode": mode, "path": str(src), "copied": copied, **body}
    with atomic_dir(out_dir) as tmp:
        for n in copied:
            shutil.copyfile(src / n, tmp / n)
            expect = body["files"][n].get("sha256")
            if expect and fp.sha256_file(tmp / n) != expect:
                raise VerifierError(f"{src / n} changed while the verifier stage was reading it;"
                                    " rerun the stage")
        (tmp / MANIFEST).write_text(dumps(manifest))
    return {"mode": mode, "path": str(src), "n_files": body["n_files"],
            "total_bytes": body["total_bytes"], "n_weight_files": len(weights),
            "hidden_size": info.hidden_size,
            "num_hidden_layers": info.num_hidden_layers, "vocab_size": info.vocab_size,
            "preflight_limits": limits}


def _copied(name: str, size: int) -> bool:
    return size <= COPY_LIMIT and fp.kind_of(name) == "other" and any(
        fnmatch.fnmatchcase(name, pat) for pat in COPY_PATTERNS)


def run(params: StageView, paths: Paths) -> dict:
    """The stage (eagle3pipe.stages.runner.main): params.verifier -> paths.out; returns the metrics.
    The `draft` section and vllm.tensor_parallel_size, .trust_remote_code and .dtype are read
    for VALIDATION ONLY (for_validation): an impossible pairing fails here, before anything is
    written; the stages that declare them repeat the checks."""
    engine = params.for_validation("vllm")
    m = build(params.verifier, paths.out, draft=params.for_validation("draft"),
              params_file=params.params_file, lines=params.key_lines, base_dir=Path.cwd(),
              progress=paths.progress, tp=engine.tensor_parallel_size,
              engine={"trust_remote_code": engine.trust_remote_code, "dtype": engine.dtype})
    log.info("wrote %s (%s)", paths.out,
             ", ".join(f"{k}={m[k]}" for k in ("mode", "n_files", "total_bytes")))
    return {**m, "kernels": kernels(vllm=False)}
