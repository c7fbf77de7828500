"""The draft variants of the ablation (bench/switches.py's VARIANTS, EAGLE-3 itself left out)
as Background jobs: each a `dvc repro smoke` in a copy of the session's cold micro run with the
variant's switches set, started with the session once the cold run ends (conftest.py's `early`)
and read by test_switch_pipelines.py."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

from .micro import ROOT
from .pipeline import Variant, set_param

sys.path.insert(0, str(ROOT / "bench"))
from switches import VARIANTS  # noqa: E402  (one list of the variants, the ablation's)

SWITCHED = [name for name, sets in VARIANTS.items() if sets]  # the cold run is EAGLE-3 itself


def value(text: str):
    """A VARIANTS value (the text `dvc exp run -S` takes) as params.yaml holds it."""
    return {"true": True, "false": False}.get(text, text)


def _switch(name: str, repo: Path) -> None:
    for key, text in VARIANTS[name].items():
        set_param(repo, key, value(text))


def jobs(base: Path) -> dict[str, Variant]:
    """Background job name (`switch:<variant>`) -> its Variant, each copy under base."""
    return {f"switch:{name}": Variant("cold", base / name / "repo",
                                      functools.partial(_switch, name), ("smoke",))
            for name in SWITCHED}
