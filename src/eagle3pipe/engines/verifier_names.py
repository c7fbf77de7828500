"""The verifier's tensor names and shapes checked against vLLM's model class, before any weight
is read.

vLLM's class for the verifier is built on the meta device with the engine-less setup of
eagle3pipe.engines.load_check (the VllmConfig an engine would build, a one-process group) and
fed every checkpoint tensor as an empty meta tensor: vLLM's own load_weights names the first
tensor it cannot place. The verifier preflight (eagle3pipe.engines.preflight) runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.engines.load_check import build_vllm_config, single_process_group


@dataclass
class NamesReport:
    """What vLLM's verifier class made of the checkpoint's tensor names and shapes."""
    architecture: str = ""
    tensors: int = 0  # checkpoint tensors offered to vLLM's loader
    problem: tuple[str, str, str] | None = None  # (file, tensor, what vLLM said)
    skipped: str = ""  # why the check could not run (not a verdict on the checkpoint)


def check_verifier_names(settings: dict, model_dir: str | Path) -> NamesReport:
    """vLLM's model class for the verifier, instantiated on the meta device (no memory, no
    weight read), fed every checkpoint tensor as an empty meta tensor of its header's shape
    (runtime/tensorfile): vLLM's own load_weights maps each name to a parameter and narrows or
    checks its shape, so an unknown name or a wrong shape raises here, and the tensor being
    loaded is named, as it would fail in the first engine a data stage starts. What vLLM
    raises before the first tensor, or about the meta device itself (a quantized layout's
    loader that reads values, say), skips the check: the engine stages still load the weights
    themselves."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from eagle3pipe.runtime.tensorfile import read_header

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
            current: list[tuple[str, str]] = []

            def weights():
                for f in files:
                    for name, (dtype, shape) in read_header(f).tensors.items():
                        current[:] = [(str(f), name)]
                        rep.tensors += 1
                        yield name, torch.empty(shape, device="meta",
                                                dtype=_torch_dtype(dtype))
            try:
                model.load_weights(weights())
            except Exception as e:  # noqa: BLE001 - named below, or the check is skipped
                if not current or "meta" in str(e).lower():  # a loader that reads values
                    raise
                said = str(e).split(" The available parameters")[0].strip()
                rep.problem = (*current[0], f"{type(e).__name__}: {said}" if said else
                               type(e).__name__)
    except Exception as e:  # noqa: BLE001 - not a verdict: the engines load the weights anyway
        rep.skipped = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return rep


def _torch_dtype(name: str):
    """torch's dtype of a safetensors dtype name (safetensors/torch.py _TYPES)."""
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
            "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
            "I8": torch.int8, "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32,
            "U64": torch.uint64, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
            "F8_E5M2": torch.float8_e5m2}[name]
