"""The one place vLLM engines are configured, started and torn down.

Every stage that runs the verifier in vLLM (dataset regeneration, smoke; the engine-less load
check in vllm_load builds its config from the same `engine_kwargs`) goes through `engine(...)`:
the environment set before vLLM is imported, the engine arguments, torch's thread count
restored afterwards, the import heap kept out of vLLM's garbage-collector walks, and the
distributed state torn down between engines.
"""
from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Any, Iterator


def environment(kv_cache_gib: float | None) -> None:
    """Must run before vLLM is imported: one in-process engine (a load failure surfaces as the
    real exception, not a dead worker), a bounded KV cache, no hub access, quiet tokenizers.
    kv_cache_gib None leaves the size to vLLM (on GPU its gpu_memory_utilization; the CPU
    backend gets 1 GiB unless VLLM_CPU_KVCACHE_SPACE is set)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if kv_cache_gib is None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    elif float(kv_cache_gib).is_integer():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))  # CPU backend, in GiB
    else:  # the env var takes whole GiB; kv_cache_memory_bytes (engine arg) takes the rest
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def engine_kwargs(model_dir: str | Path, *, speculative_config: dict | None,
                  kv_cache_gib: float | None, seed: int, max_model_len: int | None,
                  dtype: str = "auto", tokenizer: str | Path | None = None,
                  enforce_eager: bool | None = True, stats: bool = True) -> dict[str, Any]:
    """vLLM's engine arguments, for `LLM(...)` (engine) and `EngineArgs` (the engine-less
    check, whose defaults are the smoke engines' settings). kv_cache_memory_bytes bounds the KV
    cache on CPU and GPU alike; enforce_eager None: eager on CPU only (CUDA graphs elsewhere);
    stats: vLLM's counters (`llm.get_metrics()`) on."""
    if enforce_eager is None:
        from vllm.platforms import current_platform

        enforce_eager = current_platform.is_cpu()
    kw: dict[str, Any] = dict(model=str(model_dir), speculative_config=speculative_config,
                              seed=seed, dtype=dtype, enforce_eager=enforce_eager,
                              disable_log_stats=not stats)
    if tokenizer is not None:
        kw["tokenizer"] = str(tokenizer)
    if kv_cache_gib is not None:
        kw["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if max_model_len is not None:
        kw["max_model_len"] = int(max_model_len)
    return kw


@contextlib.contextmanager
def engine(model_dir: str | Path, *, tokenizer: str | Path | None = None, dtype: str, seed: int,
           max_model_len: int, kv_cache_gib: float | None, threads: int | None,
           speculative_config: dict | None = None, enforce_eager: bool | None = True,
           stats: bool = False) -> Iterator[Any]:
    """One in-process vLLM engine: yields the `LLM`; on exit shuts it down and frees it.

    Sets the environment (environment(kv_cache_gib)) before importing vLLM, and torch's thread
    count to `threads` (None: as it is). vLLM's workers change that count and its CPU worker
    replaces torch.set_num_threads with a no-op for the rest of the process, so both are
    restored on exit. Runs inside frozen_heap(). The LLM is unusable after the block: its engine
    is dropped there, so that a reference the caller still holds keeps no weights or KV cache
    alive into the next engine's memory check."""
    import torch

    environment(kv_cache_gib)
    if threads is not None:
        torch.set_num_threads(threads)
    set_threads, count = torch.set_num_threads, torch.get_num_threads()
    try:
        from vllm import LLM

        kw = engine_kwargs(model_dir, speculative_config=speculative_config,
                           kv_cache_gib=kv_cache_gib, seed=seed, max_model_len=max_model_len,
                           dtype=dtype, tokenizer=tokenizer, enforce_eager=enforce_eager,
                           stats=stats)
        with frozen_heap():
            llm = None
            try:
                llm = LLM(**kw)
                yield llm
            finally:
                if llm is not None:
                    _shutdown(llm)
                llm = None
                cleanup()
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(count)


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the objects are dropped anyway
        pass
    llm.llm_engine = None


_frozen = 0  # frozen_heap() depth


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside, every object alive on entry (mostly what importing torch, transformers and vLLM
    created) is out of the cyclic garbage collector's walks: vLLM calls gc.collect() several
    times per engine (model loading, memory profiling, start-up, teardown), and each call would
    walk that whole heap again. Frozen objects are still freed by reference counting. vLLM's
    engine shutdown unfreezes the heap, so cleanup() freezes it again inside; on exit of the
    outermost frozen_heap() it is unfrozen (else extension modules report the frozen objects as
    leaked at interpreter exit). Nested uses share the outermost freeze."""
    global _frozen
    outermost = not _frozen
    if outermost:
        gc.collect()
        gc.freeze()
    _frozen += 1
    try:
        yield
    finally:
        _frozen -= 1
        if outermost:
            gc.unfreeze()


def cleanup() -> None:
    """Tears down vLLM's distributed state and frees memory between engines (what vLLM's own
    tests call between LLM instances; it ends in gc.collect()); re-freezes the heap inside
    frozen_heap()."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    if _frozen:
        gc.freeze()
