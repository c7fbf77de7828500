"""The dataset stage's resident memory batch by batch (bench/README.md, "Why a figure can miss its
target": conversations_memory_ratio), on one engine in this process: the micro verifier, replies
of up to 16 tokens (conversations.MEMORY_STAGE) and the tests' 128 MiB KV cache, as the memory
children of bench/conversations.py run them.

After each batch of dataset.batch_size conversations (1024) the freed heap pages are given back
(eagle3pipe.runtime.heap, as the stage itself does) and VmRSS is recorded, with the batch's
VmHWM (the high-water mark is reset via /proc/self/clear_refs after each batch). One round is a
whole run; the first runs on a fresh engine, the later ones on an engine that has seen the work.

  stage   the stage's code path (conversations.run_stage) on a synthetic source of --n
          conversations; --without check (no comparison with vLLM's chat rendering) or
          --without store (no store writes) leaves one part of it out
  bare    LLM.generate only, none of the stage's code: per batch 1024 random prompts of 30-60
          tokens, then 700 of 60-96 (the synthetic source's turn depths), the stage's
          SamplingParams
--mmap-threshold B fixes glibc's mmap threshold at B bytes (mallopt M_MMAP_THRESHOLD), which
also turns off its dynamic adjustment, before the engine starts.

    python bench/conversations_batches.py stage --n 30000 --rounds 2
    python bench/conversations_batches.py bare --n 30000
Prints one JSON line per round (MB).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import conversations as bench  # noqa: E402
from common import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT))
M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _mb(field: str) -> float:
    """A /proc/self/status field in MB."""
    return round(bench.status_kb(field) / 1024, 1)


class Sampler:
    """VmHWM and VmRSS after each batch, the freed pages given back first."""

    def __init__(self):
        from eagle3pipe.runtime import heap

        self.release, self.rows = heap.release_free, []

    def reset(self) -> float:
        self.rows = []
        self.release()
        Path("/proc/self/clear_refs").write_text("5")
        return _mb("VmRSS")

    def batch_done(self) -> None:
        hwm = _mb("VmHWM")
        self.release()
        self.rows.append((hwm, _mb("VmRSS")))
        Path("/proc/self/clear_refs").write_text("5")


def without(part: str | None) -> None:
    """Leaves one part of the stage out (patched for this process)."""
    from eagle3pipe.data import store_db
    from eagle3pipe.stages.dataset import served

    if part == "check":
        served.Checker.check = lambda self, prompts: None
    elif part == "store":
        store_db.Table.put_many = lambda self, rows: None
        store_db.Table.has = lambda self, key: False


def stage_rounds(llm, vdir: Path, args, work: Path, sampler: Sampler):
    from eagle3pipe.stages.dataset import run as dataset

    dataset.heap.release_free = sampler.batch_done  # the stage's own call after each batch
    s, src, warm = bench.settings(bench.MEMORY_KV_BYTES), work / "source.jsonl", work / "warm.jsonl"
    bench.write_source(src, args.n)
    bench.write_source(warm, 8, seed=1)
    bench.run_stage(bench.stage_cfg(warm, 8, **bench.MEMORY_STAGE), s, vdir, work / "stage")
    for _ in range(args.rounds):
        start = sampler.reset()
        t0 = time.perf_counter()
        bench.run_stage(bench.stage_cfg(src, args.n, **bench.MEMORY_STAGE), s, vdir,
                        work / "stage")
        yield start, time.perf_counter() - t0


def bare_rounds(llm, args, sampler: Sampler):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = bench.STAGE | bench.MEMORY_STAGE
    sampling = SamplingParams(temperature=0.0, max_tokens=cfg["max_new_tokens"],
                              seed=cfg["seed"])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    for _ in range(args.rounds):
        start = sampler.reset()
        t0 = time.perf_counter()
        for _ in range(-(-args.n // cfg["batch_size"])):
            for count, (lo, hi) in ((cfg["batch_size"], (30, 60)), (700, (60, 96))):
                llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab)
                                                             for _ in range(rng.randint(lo, hi))])
                              for _ in range(count)], sampling, use_tqdm=False)
            sampler.batch_done()
        yield start, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("side", choices=["stage", "bare"])
    ap.add_argument("--n", type=int, default=30_000, help="conversations (bare: n / 1024 batches)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--without", choices=["check", "store"], default=None)
    ap.add_argument("--mmap-threshold", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.mmap_threshold is not None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        assert libc.mallopt(M_MMAP_THRESHOLD, args.mmap_threshold) == 1, "mallopt refused"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="conversations-batches-"))
    without(args.without)
    vdir = bench.micro_verifier(work / "micro-verifier")
    sampler = Sampler()
    with bench.shared_engine(bench.settings(bench.MEMORY_KV_BYTES), vdir) as llm:
        rounds = (stage_rounds(llm, vdir, args, work, sampler) if args.side == "stage"
                  else bare_rounds(llm, args, sampler))
        for i, (start, seconds) in enumerate(rounds):
            hwm, rss = zip(*sampler.rows)
            print(json.dumps({"side": args.side, "without": args.without,
                              "mmap_threshold": args.mmap_threshold, "n": args.n, "round": i,
                              "seconds": round(seconds, 1), "start_mb": start,
                              "peak_above_start_mb": round(max(hwm) - start, 1),
                              "after_release_mb": list(rss), "batch_hwm_mb": list(hwm)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
