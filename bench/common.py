"""Shared benchmark plumbing: interleaved repeated timing, ratios, machine facts, verifiers and
token samples for the in-process benchmarks."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
# eagle3pipe (also installed editable); the repository root, for the package tests.helpers (the
# test suite's DVC harness, tests/helpers/pipeline.py, which pipeline_bench times)
for _p in (ROOT / "src", ROOT):
    if str(_p) not in sys.path:
        sys.path.append(str(_p))


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def interleave(fns: dict[str, Callable[[], float | None]], repeats: int, warmup: int = 1,
               max_repeats: int | None = None, tol: float = 0.02) -> dict[str, list[float]]:
    """Runs every candidate `warmup` times, then rounds in which each runs once, alternating
    the order between rounds (ABC, CBA, ...) so drift on a noisy machine hits all candidates
    alike. At least `repeats` rounds; then, up to `max_repeats` (default 3 x repeats), more
    rounds while the last two still improved some candidate's best by more than `tol`: a burst
    of other work inflates single runs many times over, and the best of N is only a good
    estimate once a quiet run has been seen. A candidate returns the seconds it wants counted
    (work it must redo between runs, e.g. deleting its last output, stays out of the timing)
    or None: its wall time."""
    names = list(fns)
    max_repeats = max(repeats, 3 * repeats if max_repeats is None else max_repeats)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    improved: list[bool] = []
    for r in range(max_repeats):
        before = {n: min(times[n]) if times[n] else None for n in names}
        for n in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            got = fns[n]()
            times[n].append(time.perf_counter() - t0 if got is None else float(got))
        improved.append(any(b is None or min(times[n]) < (1 - tol) * b
                            for n, b in before.items()))
        if r + 1 >= repeats and not any(improved[-2:]):
            break
    return times


def best(ts: list[float]) -> float:
    return min(ts)


def speed_ratio(a: list[float], b: list[float]) -> float:
    """Throughput of A relative to B for the same work (best of each): > 1 means A is faster."""
    return best(b) / best(a)


def speed_ratio_median(a: list[float], b: list[float]) -> float:
    return statistics.median(b) / statistics.median(a)


def rnd(x: float, n: int = 4) -> float:
    return float(f"{x:.{n}g}")


def timing_summary(ts: list[float]) -> dict:
    return {"best_s": rnd(min(ts)), "median_s": rnd(statistics.median(ts)),
            "runs_s": [rnd(t) for t in ts]}


def machine() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "loadavg_at_start": load}


def cpu_meter():
    """eagle3pipe.stages.smoke.speed.CpuMeter counting this process and its waited-for children, running."""
    from eagle3pipe.stages.smoke.speed import CpuMeter

    return CpuMeter(children=True).resume()


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def set_threads(threads: int = THREADS) -> None:
    import torch

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Verifiers and samples


def random_verifier(out: Path, *, hidden: int, vocab: int, layers: int = 4,
                    max_pos: int = 2048, seed: int = 0) -> Path:
    """A randomly initialised Llama verifier checkpoint (config.json + model.safetensors) of the
    embedded verifier's shape family: heads = 4 (2 below hidden 128), kv = heads / 2,
    head_dim = hidden / heads, MLP = 2 x hidden. Throughput does not depend on the weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 4 if hidden >= 128 else 2
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                      max_position_embeddings=max_pos, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      bos_token_id=0, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def synthetic_samples(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    """n dataset samples (eagle3pipe.data.samples.Sample) with seeded random token ids (ids 0..3 are
    the embedded tokenizer's specials: left out), lengths uniform in [min_len, max_len] and the
    first 40% of each sample unsupervised (the prompt), the rest supervised."""
    import torch

    from eagle3pipe.data.samples import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(4, vocab, (L,), generator=g).tolist()
        k = int(0.4 * L)
        out.append(Sample(f"syn-{i}", tuple(ids), tuple([0] * k + [1] * (L - k))))
    return out


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
