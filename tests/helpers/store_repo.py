"""The repo of tests/test_store.py: the micro pipeline with 2 samples per engine call in both
data stages, so that a kill lands between samples. conftest.py runs it up to extract in the
background."""
from __future__ import annotations

from pathlib import Path

from .pipeline import make_repo, set_param, sh


def prepare(dst: Path) -> Path:
    """The repo, committed, not yet run."""
    repo = make_repo(dst)
    set_param(repo, "extract.batch_size", 2)
    set_param(repo, "dataset.batch_size", 2)
    sh(repo, "git", "commit", "-qam", "2 samples per engine call")
    return repo
