"""bench/conversations.py stays runnable (issue 34, "Scale"): the dataset stage on a synthetic
multi-turn source against a bare vLLM generate of the same prompts, and its memory at two
sizes, run once at a tiny size. Not timed: the figures' structure, not their values."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import conversations  # noqa: E402


def test_the_source_is_seeded_multi_turn_and_unique(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    info = conversations.write_source(a, 30, seed=3)
    conversations.write_source(b, 30, seed=3)
    assert a.read_bytes() == b.read_bytes()
    rows = [json.loads(x) for x in a.read_text().splitlines()]
    users = [[m["content"] for m in r["messages"] if m["role"] == "user"] for r in rows]
    assert len(rows) == info["conversations"] == 30
    assert all(2 <= len(u) <= 3 for u in users) and info["user_turns"] == sum(map(len, users))
    assert len({u[0] for u in users}) == 30  # no two conversations share a first prompt


def test_the_speed_runs_use_the_default_params_replies_and_batches():
    from helpers.pipeline import get_param

    for key in ("max_new_tokens", "batch_size"):
        assert conversations.STAGE[key] == get_param(ROOT, f"dataset.{key}"), key
    assert conversations.STAGE["max_seq_len"] == conversations.STAGE["max_prompt_tokens"] + \
        conversations.STAGE["max_new_tokens"] + 1


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.integration
def test_stage_vs_bare_generate_and_memory_at_a_tiny_size(micro_verifier, tmp_path):
    """20 conversations, one round; memory at 10 and 20 in this process (no child engines)."""
    res = conversations.measure(20, [10, 20], tmp_path, repeats=1, max_repeats=1,
                                verifier=micro_verifier, in_process=True)
    speed = res["speed"]
    assert speed["conversations"] == 20 and speed["rounds"] == 1
    assert speed["samples"] == speed["user_turns"] == sum(speed["turns_by_depth"].values())
    assert speed["turns_by_depth"]["1"] == speed["turns_by_depth"]["2"] == 20
    # greedy, the same prompts: the bare side generates exactly the stage's tokens
    assert speed["bare_generated_tokens"] == [speed["generated_tokens"]]
    assert sorted(speed["tokens_per_s"]) == ["bare", "bare_batches", "stage"]
    for v in [*speed["tokens_per_s"].values(), speed["stage_vs_bare_generate"],
              speed["stage_vs_bare_same_batches"], res["stage_vs_bare_generate"]]:
        assert positive(v), speed
    mem = res["memory"]
    assert mem["sizes"] == [10, 20] and len(mem["rows"]) == 2
    for row in mem["rows"]:
        assert positive(row["rss_before_mb"]) and positive(row["stage_tracemalloc_peak_mb"])
        assert row["stage_rss_peak_mb"] >= 0 and row["bare_rss_peak_mb"] >= 0
    assert positive(mem["stage_tracemalloc_peak_ratio"])
    assert res["stage_memory_ratio"] is None or positive(res["stage_memory_ratio"])
