"""Shared fixtures: a micro embedded verifier (real tokenizer, real tiny Llama) built once."""
from __future__ import annotations

import os
import shutil
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MICRO_EMBEDDED = dict(tokenizer_vocab_size=512, hidden_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0,
                      rms_norm_eps=1e-5, train_steps=30, batch_size=4, seq_len=64,
                      learning_rate=5e-3, seed=0, threads=2)


@pytest.fixture(autouse=True)
def private_store(tmp_path_factory, monkeypatch):
    """Each test's in-process stages keep their per-sample store (eagle3pipe.data.store) in a
    directory of its own, never the project's; pipeline.env() drops the variable, so that each
    temporary DVC repo uses its own `.eagle3pipe/data/store`."""
    from eagle3pipe.data import store

    monkeypatch.setenv(store.STORE_ENV, str(tmp_path_factory.mktemp("store")))


@pytest.fixture(scope="session")
def micro_verifier(tmp_path_factory) -> Path:
    """A real HF checkpoint dir (config.json, model.safetensors, tokenizer with chat template)."""
    from eagle3pipe.verifier import embedded

    out = tmp_path_factory.mktemp("micro") / "verifier"
    embedded.build(types.SimpleNamespace(**MICRO_EMBEDDED), out, progress=False)
    return out


@pytest.fixture
def micro_verifier_copy(micro_verifier, tmp_path) -> Path:
    """A private copy a test may modify."""
    dst = tmp_path / "verifier"
    shutil.copytree(micro_verifier, dst)
    return dst


def engine_settings(**override) -> dict:
    """The micro pipeline's vLLM engine settings (tests/micro/params.yaml `vllm:`)."""
    from eagle3pipe.engines import engine
    from eagle3pipe.config import params as P

    return {**engine.settings_of(P.load(ROOT / "tests/micro/params.yaml").vllm), **override}
