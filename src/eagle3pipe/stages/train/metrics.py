"""The train stage's metrics: dvclive on rank 0, writing metrics/train/ (metrics.json and the
per-step plots dvc.yaml declares)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path


class Metrics:
    """dvclive on rank 0 (`metrics_dir` None elsewhere: every call is then a no-op); values
    rounded to 6 significant digits. Creating it clears the old plots, unless it resumes a run:
    `summary` is then what summary() returned at the checkpoint, and the plots are the
    checkpoint's (checkpoint.restore_metrics), appended to from here."""

    def __init__(self, metrics_dir: str | Path | None, summary: dict | None = None):
        if metrics_dir is not None and summary is not None:
            (Path(metrics_dir) / "metrics.json").write_text(json.dumps(summary))
        self.live = None if metrics_dir is None else _live(metrics_dir, summary is not None)

    def summary(self) -> dict | None:
        """The latest value of every metric so far, in the order dvclive writes them."""
        return None if self.live is None else json.loads(json.dumps(self.live.summary))

    def _log(self, step: int, values: dict[str, float]) -> None:
        if self.live is not None:
            self.live.step = step
            for k, v in values.items():
                self.live.log_metric(k, float(f"{v:.6g}"))

    def train(self, step: int, loss: float, lr: float) -> None:
        self._log(step, {"train/loss": loss, "train/lr": lr})

    def eval(self, step: int, ev: dict[str, float]) -> None:
        self._log(step, {f"eval/{k}": v for k, v in ev.items()})

    def init_from(self, info: dict | None) -> None:
        """What the draft started from (train.init_from: path, layout, sha256, whether its vocab
        map was this run's), or null for a seeded random init, in metrics.json."""
        if self.live is not None:
            self.live.summary["init_from"] = info

    def end(self) -> None:
        if self.live is not None:
            self.live.end()


def _live(metrics_dir: str | Path, resume: bool):
    """dvclive writer: metrics.json (latest values, no timestamps) and per-step TSV plots under
    <metrics_dir>/plots/metrics/ (it clears old plots first). No dvc.yaml of its own, no
    experiment saving, and no DVC repo access at all: outside a DVC repo, dvclive 3.49's
    get_dvc_repo() would `dvc init` the enclosing git repo. dvc.yaml declares these files."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from dvclive import Live

    class FilesOnlyLive(Live):
        def _init_dvc(self) -> None:  # no Repo(), no Repo.init(), no experiment
            self._dvc_file = "dvc.yaml"

    return FilesOnlyLive(dir=str(metrics_dir), save_dvc_exp=False, dvcyaml=None, resume=resume)
