"""DVC stage `dataset`: prompts + verifier-regenerated replies, tokenized, with loss masks.

    python stages/dataset.py --params params.yaml --verifier artifacts/verifier \
        --out artifacts/dataset --metrics metrics/dataset.json
"""
from __future__ import annotations

import argparse
import logging
import sys

from eagle3pipe import params
from eagle3pipe.dataset import DatasetError, build
from eagle3pipe.runtime import write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc-yaml", default="dvc.yaml",
                    help="the stage graph that declares which params keys this stage may read")
    ap.add_argument("--verifier", default="artifacts/verifier", help="verifier stage output dir")
    ap.add_argument("--out", default="artifacts/dataset")
    ap.add_argument("--metrics", default="metrics/dataset.json")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        p = params.for_stage("dataset", args.params, args.dvc_yaml)
        metrics = build(p.dataset, args.verifier, args.out, progress=not args.no_progress)
    except (params.ParamsError, DatasetError) as e:
        print(f"dataset: error: {e}", file=sys.stderr)
        return 1
    write_json(args.metrics, metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
