"""DVC stage `extract`: verifier hidden states (3 aux layers + pre-norm final) in speculators'
on-disk layout. See src/eagle3pipe/extract.py."""
from __future__ import annotations

import argparse
import logging
import sys

from eagle3pipe import params
from eagle3pipe.extract import ExtractError, run
from eagle3pipe.verifier_info import VerifierConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc-yaml", default="dvc.yaml", help="stage graph declaring the params keys")
    ap.add_argument("--verifier", required=True, help="artifacts/verifier")
    ap.add_argument("--dataset", required=True, help="artifacts/dataset (train.jsonl, eval.jsonl)")
    ap.add_argument("--capture", required=True, help="configs/capture.json")
    ap.add_argument("--out", required=True, help="artifacts/hidden")
    ap.add_argument("--metrics", required=True, help="metrics/extract.json")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s extract: %(message)s")
    log = logging.getLogger("extract")
    try:
        p = params.for_stage("extract", args.params, args.dvc_yaml)
        e = p.extract
        metrics = run(args.verifier, args.dataset, args.capture, args.out, args.metrics,
                      dtype=e.dtype, batch_size=e.batch_size, threads=e.threads,
                      progress=not args.no_progress)
    except (params.ParamsError, ExtractError, VerifierConfigError) as err:
        log.error("%s", err)
        return 2
    log.info("%d samples, %d tokens, %.0f tokens/s, %.0f bytes/token (min %d) -> %s",
             metrics["samples"], metrics["tokens"], metrics["tokens_per_second"],
             metrics["bytes_per_token"], metrics["min_bytes_per_token"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
