"""Shared fixtures: a micro embedded verifier (real tokenizer, real tiny Llama) built once. (The
shared helpers that are not fixtures: the package tests/helpers/.)"""
from __future__ import annotations

import os
import shutil
import types
from pathlib import Path

import pytest

from helpers.micro import MICRO_EMBEDDED

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


