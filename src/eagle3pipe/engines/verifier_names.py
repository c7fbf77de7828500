"""The verifier's tensor names and shapes checked against vLLM's model class, before any weight
is read: what the checkpoint has that the class cannot place, and what the class needs that the
checkpoint lacks.

vLLM's class for the verifier is built on the meta device with the engine-less setup of
eagle3pipe.engines.load_check (the VllmConfig an engine would build, a one-process group) and
fed every checkpoint tensor as an empty meta tensor: vLLM's own load_weights names the first
tensor it cannot place, and returns the names of the parameters it loaded, from which the
parameters no checkpoint tensor reached follow. The verifier preflight
(eagle3pipe.engines.preflight) runs it.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.engines.load_check import build_vllm_config, single_process_group

# What torch raises when code needs the values of a meta tensor (a weight loader that reads the
# checkpoint tensor: a scale's .item(), a copy to the CPU, a data-dependent operator): the check
# cannot go on, and the checkpoint is not at fault. Matched as substrings of str(exception);
# any other exception while tensors are fed is a finding naming the tensor.
META_ERRORS = (
    # torch/_meta_registrations.py meta_local_scalar_dense: .item(), bool(), int(), float()
    "Tensor.item() cannot be called on meta tensors",
    # aten/src/ATen/native/Copy.cpp copy_impl: .cpu(), .to("cpu"), .tolist(), cpu.copy_(meta)
    "Cannot copy out of meta tensor; no data!",
    # aten/src/ATen/core/MetaFallbackKernel.cpp metaFallback: an operator without a Meta kernel
    # (torch.equal, torch.unique, a vLLM custom op)
    "attempted to run this operator with Meta tensors",
    # torch/_meta_registrations.py nonzero: torch.nonzero, indexing by a boolean mask
    "The register_meta function for torch.nonzero() raises unimplemented",
    # torch/_meta_registrations.py meta_repeat_interleave_Tensor (no output_size)
    "cannot repeat_interleave a meta tensor without output_size",
    # torch/csrc/utils/tensor_numpy.cpp tensor_to_numpy: .numpy()
    "can't convert meta device type tensor to numpy",
)
# vllm/model_executor/model_loader/default_loader.py _CONFIG_BUILT_PARAMS, if this vLLM lacks it
CONFIG_BUILT_PARAMS = ("input_scale_ub",)
SHOWN = 10  # missing parameters named in a report (the count is always given)
# vllm/model_executor/models/utils.py AutoWeightsLoader._load_module's warning for a submodule
# whose load_weights returns no set: vLLM's set of loaded parameters is then incomplete
INCOMPLETE = "Unable to collect loaded parameters"


@dataclass
class NamesReport:
    """What vLLM's verifier class made of the checkpoint's tensor names and shapes."""
    architecture: str = ""
    tensors: int = 0  # checkpoint tensors offered to vLLM's loader
    problem: tuple[str, str, str] | None = None  # (file, tensor, what vLLM said)
    missing: tuple[str, ...] = ()  # vLLM parameter names no checkpoint tensor loaded, sorted
    missing_where: str = ""  # the file a missing-tensor finding names (the index, or the shard)
    absent_shards: tuple[str, ...] = ()  # shards the index lists that are not in the directory
    unchecked: str = ""  # why the missing parameters could not be told (vLLM returned no set)
    skipped: str = ""  # why the check could not run (not a verdict on the checkpoint)


def check_verifier_names(settings: dict, model_dir: str | Path) -> NamesReport:
    """vLLM's model class for the verifier, instantiated on the meta device (no memory, no
    weight read), fed every checkpoint tensor as an empty meta tensor of its header's shape
    (runtime/tensorfile): vLLM's own load_weights maps each name to a parameter and narrows or
    checks its shape, so an unknown name or a wrong shape raises here, and the tensor being
    loaded is named, as it would fail in the first engine a data stage starts. The names it
    returns as loaded, against the class's parameters less those a checkpoint cannot carry
    (exempt_parameters), give the parameters the checkpoint lacks, which vLLM would leave
    uninitialised (a fused parameter, qkv_proj or an MoE layer's experts.w13_weight, counts as
    loaded once any of its parts is: a checkpoint lacking only k_proj, or one expert, passes,
    as it passes vLLM's own check). What vLLM raises before the first tensor, or one of torch's
    META_ERRORS (a quantized layout's loader that reads values, say), skips the check: the
    engine stages still load the weights themselves."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    rep = NamesReport()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        rep.skipped = "no *.safetensors files"
        return rep
    try:
        vc = build_vllm_config(settings, model_dir, None)
        with single_process_group(vc):
            with set_default_torch_dtype(vc.model_config.dtype), torch.device("meta"):
                model = initialize_model(vllm_config=vc, model_config=vc.model_config)
            rep.architecture = type(model).__name__
            loaded = _feed(model, files, rep)
            if rep.problem is None:
                _missing(model, loaded, rep, Path(model_dir), files)
    except Exception as e:  # noqa: BLE001 - not a verdict: the engines load the weights anyway
        rep.skipped = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return rep


def _feed(model, files: list[Path], rep: NamesReport) -> set[str] | None:
    """model.load_weights over every tensor of `files` (empty meta tensors): the names vLLM
    returns as loaded (None: it returned none, or a submodule's loader returned none, which
    vLLM's AutoWeightsLoader warns about as INCOMPLETE). A failure after the first tensor is
    rep.problem naming that tensor (the directory and no tensor once all were fed); before the
    first tensor, or one of META_ERRORS, propagates (a skip)."""
    import torch

    from eagle3pipe.runtime.tensorfile import read_header

    current: list[tuple[str, str]] = []

    def weights():
        for f in files:
            for name, (dtype, shape) in read_header(f).tensors.items():
                current[:] = [(str(f), name)]
                rep.tensors += 1
                yield name, torch.empty(shape, device="meta", dtype=_torch_dtype(dtype))
        current[:] = [(str(files[0].parent), "")]  # all fed: what vLLM says now is no tensor's

    watch = _Warnings()
    log = logging.getLogger("vllm.model_executor.models.utils")
    level = log.level
    log.setLevel(min(log.getEffectiveLevel(), logging.WARNING))  # seen even if vLLM's is quieter
    log.addHandler(watch)
    try:
        loaded = model.load_weights(weights())
    except Exception as e:  # noqa: BLE001 - named below, or the check is skipped
        if not current or is_meta_error(e):
            raise
        said = str(e).split(" The available parameters")[0].strip()
        rep.problem = (*current[0], f"{type(e).__name__}: {said}" if said else
                       type(e).__name__)
        return None
    finally:
        log.removeHandler(watch)
        log.setLevel(level)
    if loaded is None or watch.incomplete:
        rep.unchecked = (f"vLLM's {rep.architecture}.load_weights returned no set of loaded "
                         "parameters" if loaded is None else
                         f"a module of vLLM's {rep.architecture} returned no set of loaded "
                         "parameters")
        return None
    return set(loaded)


class _Warnings(logging.Handler):
    """Notes vLLM's INCOMPLETE warning while the loader runs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.incomplete = False

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(INCOMPLETE):
            self.incomplete = True


def is_meta_error(e: BaseException) -> bool:
    """Whether `e` is torch refusing to read a meta tensor's values (META_ERRORS)."""
    text = str(e)
    return any(p in text for p in META_ERRORS)


def _missing(model, loaded: set[str] | None, rep: NamesReport, model_dir: Path,
             files: list[Path]) -> None:
    """rep.missing: the model's parameters (named_parameters: a tied lm_head is the embedding's
    parameter and appears once; rotary inv_freq and other buffers are not parameters) less the
    exempt ones and those vLLM loaded; and where a finding about them points."""
    if loaded is None:
        return
    expected = {n for n, _ in model.named_parameters()} - exempt_parameters(model)
    rep.missing = tuple(sorted(expected - loaded))
    if not rep.missing:
        return
    index = model_dir / "model.safetensors.index.json"
    rep.missing_where = str(index if index.is_file() else files[0] if len(files) == 1
                            else model_dir)
    rep.absent_shards = _absent_shards(index)


def exempt_parameters(model) -> set[str]:
    """The parameters a checkpoint cannot carry, as vLLM's own "weights not initialized" check
    names them for a quantized model (vllm/model_executor/model_loader/default_loader.py,
    DefaultModelLoader.track_weights_loading): every parameter under a module whose
    quant_method quantizes online (`uses_meta_device`: made while loading) or is a KV-cache
    method (BaseKVCacheMethod: defaults stand in), empty placeholders (numel 0), and those the
    quantization config builds (_CONFIG_BUILT_PARAMS: input_scale_ub).

    For an unquantized model vLLM's check exempts every parameter under any module with a
    quant_method that has process_weights_after_loading, which every linear, embedding and
    fused-MoE layer has (UnquantizedLinearMethod, UnquantizedEmbeddingMethod): it notices only
    a missing norm or bias, and an absent o_proj loads as uninitialised memory. This check holds
    every model to the quantized rule, so that a missing linear weight is named too."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.model_loader import default_loader

    built = getattr(default_loader, "_CONFIG_BUILT_PARAMS", CONFIG_BUILT_PARAMS)
    exempt = set()
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None or not (getattr(qm, "uses_meta_device", False)
                              or getattr(qm, "process_weights_after_loading", None)):
            continue
        whole = getattr(qm, "uses_meta_device", False) or isinstance(qm, BaseKVCacheMethod)
        for pname, p in module.named_parameters():
            if whole or p.numel() == 0 or pname.rsplit(".", 1)[-1] in built:
                exempt.add(f"{name}.{pname}" if name else pname)
    return exempt


def _absent_shards(index: Path) -> tuple[str, ...]:
    """The files model.safetensors.index.json's weight_map names that are not beside it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = {str(v) for v in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ()
    return tuple(sorted(n for n in names if not (index.parent / n).is_file()))


def _torch_dtype(name: str):
    """torch's dtype of a safetensors dtype name (safetensors/torch.py _TYPES)."""
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
            "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
            "I8": torch.int8, "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32,
            "U64": torch.uint64, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
            "F8_E5M2": torch.float8_e5m2}[name]
