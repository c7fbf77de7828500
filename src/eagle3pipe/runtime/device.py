"""Which device this process computes on: the one place that asks torch or vLLM."""
from __future__ import annotations


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False where torch is not installed)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on its CPU backend here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
