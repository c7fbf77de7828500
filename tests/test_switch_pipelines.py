"""Each draft variant of the ablation (bench/switches.py: EAGLE-3.1's norm_before_fc or fc_norm
with norm_output, each with the Llama or the Qwen3 layer, and the Qwen3 layer alone) through the
micro pipeline with real DVC: the switches set in a copy of the session's cold micro run (plain
EAGLE-3 with the Llama layer, conftest.py's `micro`), `dvc repro smoke` reruns exactly configs,
train, export and smoke; the smoke stage's forward check passes in both layouts, vLLM serves both
exports losslessly, and the acceptance is recorded. The variants run in the background with the
session (helpers.switched), one at a time beside the one-core tests, two while a test waits."""
from __future__ import annotations

import json

import pytest

from helpers.switched import SWITCHED, VARIANTS, value

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def variants(early):
    """name -> the finished `dvc repro smoke` (helpers.pipeline.Run) of each switched copy,
    run in the background with the session (helpers.switched)."""
    return {name: early.wait(f"switch:{name}") for name in SWITCHED}


@pytest.mark.parametrize("name", SWITCHED)
def test_variant_through_dvc_repro_smoke(variants, name):
    run = variants[name]
    assert run.rc == 0, f"{name}: dvc repro smoke failed ({run.rc}):\n{run.log[-8000:]}"
    assert run.ran == {"configs", "train", "export", "smoke"}, run.ran
    sets = {k.split(".")[-1]: value(v) for k, v in VARIANTS[name].items()}
    flat = json.loads((run.repo / "artifacts/export/vllm/config.json").read_text())
    spec = json.loads((run.repo / "artifacts/export/speculators/config.json").read_text())
    for key, want in sets.items():
        if key == "draft_arch":
            assert flat["model_type"] == spec["transformer_layer_config"]["model_type"] == want
        else:
            assert flat[key] is spec[key] is want, key
    smoke = json.loads((run.repo / "metrics/smoke.json").read_text())
    for fmt in ("vllm", "speculators"):
        assert smoke["forward_check"][fmt]["ok"], smoke["forward_check"]
        got = smoke["formats"][fmt]
        assert got["lossless"], (name, fmt)
        assert got["mean_acceptance_length"] > 1.0 and got["num_drafts"] > 0, got
    assert smoke["passed"], smoke
