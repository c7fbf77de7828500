"""vLLM's speculative-decoding counters (its Prometheus metrics, read in-process from the
engine) turned into acceptance figures, and the lossless comparison with non-speculative
output."""
from __future__ import annotations

from typing import Any, Callable

ROUND = 4  # decimals of every rate (metrics/smoke.json is compared byte for byte)
COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_position": "vllm:spec_decode_num_accepted_tokens_per_pos",
}

def read_counters(llm) -> dict[str, Any]:
    """vLLM V1's spec-decode counters (summed over label sets, e.g. engine index)."""
    from vllm.v1.metrics.reader import Counter, Vector

    wanted = {v: k for k, v in COUNTERS.items()}
    out: dict[str, Any] = {"accepted_per_position": []}
    for m in llm.get_metrics():
        key = wanted.get(m.name)
        if key is None:
            continue
        if isinstance(m, Vector):
            cur = out.get(key) or []
            vals = list(m.values)
            cur = cur + [0] * (len(vals) - len(cur))
            out[key] = [a + b for a, b in zip(cur, vals + [0] * (len(cur) - len(vals)))]
        elif isinstance(m, Counter):
            out[key] = out.get(key, 0) + int(m.value)
    return out


def counter_delta(before: dict, after: dict) -> dict:
    out = {}
    for k in COUNTERS:
        a, b = after.get(k, 0 if k != "accepted_per_position" else []), before.get(k)
        if isinstance(a, list):
            b = b or []
            out[k] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        else:
            out[k] = a - (b or 0)
    return out


def counter_sum(counters: list[dict]) -> dict:
    """Counter deltas added up (the domains of one pass)."""
    out: dict[str, Any] = {k: 0 for k in COUNTERS}
    out["accepted_per_position"] = []
    for c in counters:
        for k in COUNTERS:
            v = c.get(k)
            if isinstance(v, list):
                cur = out[k] + [0] * (len(v) - len(out[k]))
                out[k] = [a + (v[i] if i < len(v) else 0) for i, a in enumerate(cur)]
            elif v is not None:
                out[k] += v
    return out


def acceptance(counters: dict, k: int, tokens_generated: int) -> dict:
    """Mean acceptance length (1 + accepted / drafts) and per-position acceptance rates."""
    drafts = int(counters.get("drafts", 0))
    accepted = int(counters.get("accepted_tokens", 0))
    per_pos = list(counters.get("accepted_per_position") or [])
    per_pos = (per_pos + [0] * k)[:k]
    return {
        "mean_acceptance_length": round(1.0 + accepted / drafts, ROUND) if drafts else 1.0,
        "acceptance_rate_per_position": [round(a / drafts, ROUND) if drafts else 0.0
                                         for a in per_pos],
        "num_drafts": drafts,
        "num_draft_tokens": int(counters.get("draft_tokens", 0)),
        "num_accepted_tokens": accepted,
        "tokens_generated": int(tokens_generated),
    }


def mismatches(reference: list[list[int]], got: list[list[int]], detok: Callable | None = None,
               limit: int = 3, sources: list[str] | None = None) -> list[str]:
    """Prompts whose speculative output differs from the non-speculative one."""
    out = []
    for i, (a, b) in enumerate(zip(reference, got)):
        if a == b:
            continue
        j = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        where = f" ({sources[i]})" if sources else ""
        msg = (f"prompt {i}{where}: first difference at output token {j}: non-speculative "
               f"{a[j:j + 4]} vs speculative {b[j:j + 4]} (lengths {len(a)} / {len(b)})")
        if detok is not None:
            msg += f"; non-speculative text {detok(a[max(0, j - 8):j + 8])!r}, speculative " \
                   f"{detok(b[max(0, j - 8):j + 8])!r}"
        out.append(msg)
    if len(reference) != len(got):
        out.append(f"{len(reference)} non-speculative outputs vs {len(got)} speculative")
    more = len(out) - limit
    return out[:limit] + ([f"... and {more} more prompts"] if more > 0 else [])


