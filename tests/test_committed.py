"""The committed outputs of the default run (metrics/*.json, what `make repro` leaves) have the
shape params.yaml asks for, and the figures that describe the same samples agree: a metrics file
left over from another run (e.g. a test's micro run written into the checkout) or a params.yaml
edited without rerunning shows up here."""
from __future__ import annotations

import json

import pytest

from eagle3pipe.config import params as P
from helpers.micro import ROOT


@pytest.fixture(scope="module")
def params():
    return P.load(ROOT / "params.yaml")


def metrics(name: str) -> dict:
    return json.loads((ROOT / "metrics" / f"{name}.json").read_text())


def test_dataset_counts_follow_params(params):
    p, d = params.dataset, metrics("dataset")
    if p.source is None:  # held-out stdlib prompts: exactly num_samples of them are read
        assert d["read"] == p.num_samples, (d["read"], p.num_samples)
    else:
        assert d["read"] <= p.num_samples
    assert d["kept"] == d["read"] - d["skipped"], d
    assert d["train"] + d["eval"] == d["kept"], d
    assert sum(d["skipped_by_reason"].values()) == d["skipped"], d


@pytest.mark.parametrize("stage", ["dataset", "extract"])
def test_store_counts_add_up(stage):
    s = metrics(f"{stage}_store")
    assert s["computed"] + s["reused"] + s["skipped"] == s["total"], s
    assert min(s["computed"], s["reused"], s["skipped"]) >= 0, s


def test_store_counts_are_the_committed_runs_samples():
    """Each store record counts the samples its stage's metrics describe: the dataset store every
    line read (skipped ones as skipped), the extract store every kept sample."""
    d, ds = metrics("dataset"), metrics("dataset_store")
    e, es = metrics("extract"), metrics("extract_store")
    assert ds["total"] == d["read"], (ds, d["read"])
    assert ds["skipped"] == d["skipped"], (ds, d["skipped"])
    assert es["total"] == e["samples"] == d["kept"], (es, e["samples"], d["kept"])
    assert es["skipped"] == 0, es
    assert 0 <= es.get("published_as_links", 0) <= es["total"], es
    for split in ("train", "eval"):
        assert e["splits"][split]["samples"] == d[split], (split, e["splits"][split], d[split])
    assert e["tokens"] == d["tokens"] == sum(v["tokens"] for v in e["splits"].values())


def test_smoke_metrics_follow_params(params):
    s, sm = metrics("smoke"), params.smoke
    k = params.draft.num_speculative_tokens
    assert s["num_speculative_tokens"] == k, (s["num_speculative_tokens"], k)
    assert s["num_prompts"] == sm.num_prompts, (s["num_prompts"], sm.num_prompts)
    assert s["max_tokens"] == sm.max_tokens, (s["max_tokens"], sm.max_tokens)
    assert s["thresholds"] == {"min_acceptance_length": sm.min_acceptance_length,
                               "min_gain_over_ngram": sm.min_gain_over_ngram,
                               "max_train_serve_gap": sm.max_train_serve_gap}, s["thresholds"]
    # training vs serving: the eval split's first smoke.agreement_prompts samples, both sides
    # over min(k, train.ttt_steps) positions, the gap within the threshold
    a = s["train_serve_agreement"]
    evals = metrics("dataset")["eval"]
    assert a["num_prompts"] == min(sm.agreement_prompts, evals), (a["num_prompts"], evals)
    assert a["positions"] == min(k, params.train.ttt_steps), a["positions"]
    assert a["gap"] <= sm.max_train_serve_gap and s["passed"], a
    # the sweep: smoke.k_sweep plus the serving k; none when smoke.k_sweep is []
    sweep = sorted(set(sm.k_sweep) | {k}) if sm.k_sweep else []
    assert sorted(map(int, s.get("k_sweep", {}))) == sweep, (list(s.get("k_sweep", {})), sweep)
    reference = s["tokens_generated_non_speculative"]
    assert 0 < reference <= sm.num_prompts * sm.max_tokens, reference
    for name, f in {**s["formats"], "ngram": s["ngram"]}.items():
        assert len(f["acceptance_rate_per_position"]) == k, (name, f)
        assert f["tokens_generated"] == reference, (name, f["tokens_generated"], reference)
        assert s["mean_acceptance_length"][name] == f["mean_acceptance_length"], name
    for kk, methods in s.get("k_sweep", {}).items():
        for name, f in methods.items():
            assert len(f["acceptance_rate_per_position"]) == int(kk), (kk, name, f)
            assert f["tokens_generated"] == reference, (kk, name, f["tokens_generated"])


def test_smoke_timing_follows_params_and_the_metrics(params):
    """metrics/smoke_timing.json was measured with these params (rounds, prompts, batch 1, the
    k sweep) on the run whose metrics/smoke.json is committed (its sha256)."""
    import hashlib

    t, sm = metrics("smoke_timing"), params.smoke
    assert t["smoke_metrics_sha256"] == hashlib.sha256(
        (ROOT / "metrics/smoke.json").read_bytes()).hexdigest()
    assert t["timing_rounds"] == sm.timing_rounds and t["num_prompts"] == sm.num_prompts
    assert t["num_speculative_tokens"] == params.draft.num_speculative_tokens
    sweep = sorted(set(sm.k_sweep) | {params.draft.num_speculative_tokens}) if sm.k_sweep else []
    at = [t] + ([t["batch_1"]] if sm.batch1_prompts else [])
    assert ("batch_1" in t) == bool(sm.batch1_prompts)
    for figures in at:
        assert sorted(map(int, figures.get("k_sweep", {}))) == sweep
        for name, m in figures["methods"].items():
            assert len(m["seconds"]) == sm.timing_rounds, name
    if sm.batch1_prompts:
        assert t["batch_1"]["num_prompts"] == sm.batch1_prompts
