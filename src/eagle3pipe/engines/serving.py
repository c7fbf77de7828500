"""The serving recipe: how to serve the verifier with each exported draft, rendered from params
(draft.num_speculative_tokens, verifier.path, the `vllm:` section) into configs/serve/ by the
configs stage and `eagle3pipe render` (beside eagle3pipe.draft.formats' files), so that serving uses the same k,
the same exports and the same engine arguments as the smoke stage measured.

- `serve/vllm.json`, `serve/speculators.json`: vLLM's OpenAI-compatible server on the verifier
  with one export. `engine_args` are eagle3pipe.engines.engine.engine_kwargs of the run's
  settings (the smoke stage's engines, with vLLM's counters on) with the smoke stage's
  speculative_config {"method": "eagle3", "model": <export>, "num_speculative_tokens": k},
  `argv` the same as vLLM's command-line flags (`python -m vllm.entrypoints.openai.api_server ARGV`),
  `environment` the CPU backend's variables from the settings (engine.ENV). A non-empty
  dataset.chat_template_kwargs is the server's `default_chat_template_kwargs` (vLLM's
  FrontendArgs, vllm/entrypoints/launchers/cli_args.py): every chat request is rendered with
  the template arguments the dataset stage trained on; `{}` adds nothing (vLLM's default).
- `serve/sglang.json`: SGLang's EAGLE-3 flags for the flat export (`python -m
  sglang.launch_server ARGV`): a chain of k draft tokens as vLLM runs it (num_steps = k,
  eagle_topk = 1, num_draft_tokens = k + 1), and the engine settings SGLang has a flag for.

`eagle3pipe serve` (eagle3pipe.tools.serve) starts the vLLM server from these files; `eagle3pipe
check` compares them with what params.yaml renders, as every derived config.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3pipe.draft import formats
from eagle3pipe.engines import engine
from eagle3pipe.runtime.jsonio import dumps
from eagle3pipe.verifier.handle import EMBEDDED_VERIFIER_DIR

EXPORT_DIR = "artifacts/export"  # the export stage's output (dvc.yaml)
FORMATS = ("vllm", "speculators")  # artifacts/export/<format>/, one recipe each
SGLANG_FORMAT = "vllm"  # SGLang loads the flat layout (LlamaForCausalLMEagle3)
FILES = tuple(f"serve/{f}.json" for f in (*FORMATS, "sglang"))
VLLM_SERVER = ("python", "-m", "vllm.entrypoints.openai.api_server")
SGLANG_SERVER = ("python", "-m", "sglang.launch_server")
# engine settings (params' vllm: names) -> SGLang's flag (sglang/srt/server_args.py); the
# others have no SGLang counterpart of the same meaning
SGLANG_FLAGS = {"tensor_parallel_size": "--tp-size", "pipeline_parallel_size": "--pp-size",
                "data_parallel_size": "--dp-size", "max_model_len": "--context-length",
                "dtype": "--dtype",  # check: ignore (a flag's name, not a dtype)
                "gpu_memory_utilization": "--mem-fraction-static", "seed": "--random-seed"}


def export_path(fmt: str) -> str:
    return f"{EXPORT_DIR}/{fmt}"


def verifier_model(verifier_path: str | None) -> str:
    """The weights the server loads: verifier.path, or the embedded verifier the verifier
    stage builds (eagle3pipe.verifier.handle.model_dir gives the same directory)."""
    return verifier_path if verifier_path is not None else EMBEDDED_VERIFIER_DIR


def speculative_config(fmt: str, k: int) -> dict[str, Any]:
    """vLLM's --speculative-config for one export: the smoke stage's."""
    return {"method": "eagle3", "model": export_path(fmt), "num_speculative_tokens": k}


def cli_args(engine_args: dict[str, Any]) -> list[str]:
    """vLLM's command-line flags for engine arguments: --kebab-case VALUE, true as --flag,
    objects as JSON; false and None left out: vLLM's default for each of these engine
    arguments (some flags, --disable-log-stats, have no --no- form). tests/test_serve.py parses
    the flags with vLLM's own parser and gets the engine arguments back."""
    out: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, sort_keys=True, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out


def vllm_recipe(fmt: str, settings: dict[str, Any], verifier_path: str | None,
                k: int, template_kwargs: dict[str, Any]) -> dict[str, Any]:
    spec = speculative_config(fmt, k)
    args = dict(sorted(engine.engine_kwargs(settings, verifier_model(verifier_path),
                                            speculative_config=spec, stats=True).items()))
    front = {"default_chat_template_kwargs": dict(template_kwargs)} if template_kwargs else {}
    out = {"format": fmt, "draft": export_path(fmt), "num_speculative_tokens": k,
           "engine_args": args,
           "environment": {var: str(settings[key]) for key, var in engine.ENV.items()},
           "command": list(VLLM_SERVER), "argv": cli_args(args) + cli_args(front)}
    return out | ({"frontend_args": front} if front else {})


def sglang_recipe(settings: dict[str, Any], verifier_path: str | None, k: int) -> dict[str, Any]:
    flags = {"--model-path": verifier_model(verifier_path),
             "--speculative-algorithm": "EAGLE3",
             "--speculative-draft-model-path": export_path(SGLANG_FORMAT),
             "--speculative-num-steps": k, "--speculative-eagle-topk": 1,
             "--speculative-num-draft-tokens": k + 1}
    flags |= {flag: settings[key] for key, flag in SGLANG_FLAGS.items()}
    argv = [str(x) for kv in flags.items() for x in kv]
    argv += ["--trust-remote-code"] if settings["trust_remote_code"] else []
    argv += ["--disable-cuda-graph"] if settings["enforce_eager"] else []
    return {"format": SGLANG_FORMAT, "draft": export_path(SGLANG_FORMAT),
            "num_speculative_tokens": k, "command": list(SGLANG_SERVER), "argv": argv}


def render(vllm_section: Any, verifier_path: str | None, k: int,
           template_kwargs: dict[str, Any]) -> dict[str, dict]:
    """{configs/-relative path: recipe} from the `vllm:` section (engine.settings_of),
    verifier.path, draft.num_speculative_tokens and dataset.chat_template_kwargs."""
    settings = engine.settings_of(vllm_section)
    out = {f"serve/{fmt}.json": vllm_recipe(fmt, settings, verifier_path, k, template_kwargs)
           for fmt in FORMATS}
    out["serve/sglang.json"] = sglang_recipe(settings, verifier_path, k)
    assert tuple(out) == FILES
    return out


def render_files(p: Any) -> dict[str, str]:
    """render()'s recipes for params `p` (its vllm, verifier.path, draft.num_speculative_tokens,
    dataset.chat_template_kwargs) as file texts (the one JSON style of every generated file)."""
    recipes = render(p.vllm, p.verifier.path, p.draft.num_speculative_tokens,
                     p.dataset.chat_template_kwargs)
    return {rel: dumps(obj) for rel, obj in recipes.items()}


def render_into(out_dir: str | Path, p: Any) -> dict[Path, str]:
    """render_files(p) written under out_dir as formats.write does (atomic, unchanged bytes
    untouched): {path: "written" or "unchanged"}."""
    files = render_files(p)
    changed = set(formats.write(files, out_dir))
    return {Path(out_dir) / rel: "written" if Path(out_dir) / rel in changed else "unchanged"
            for rel in files}
