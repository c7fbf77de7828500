"""DVC stage `vocab`: d2t/t2d for draft.draft_vocab_size from loss-masked training tokens.

    python stages/vocab.py --params params.yaml --dataset artifacts/dataset/train.jsonl \
        --verifier-config artifacts/verifier/config.json --out artifacts/vocab
"""
from __future__ import annotations

import argparse
import logging
import sys

from eagle3pipe import params
from eagle3pipe.verifier_info import VerifierConfigError, VerifierInfo
from eagle3pipe.vocab import VocabError, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc-yaml", default="dvc.yaml",
                    help="the stage graph that declares which params keys this stage may read")
    ap.add_argument("--dataset", default="artifacts/dataset/train.jsonl")
    ap.add_argument("--verifier-config", default="artifacts/verifier/config.json")
    ap.add_argument("--out", default="artifacts/vocab")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        p = params.for_stage("vocab", args.params, args.dvc_yaml)
        info = VerifierInfo.from_config(args.verifier_config)
        line = params.line_of(p._obj, "draft.draft_vocab_size")
        where = params.source_of(p._obj) + (f":{line}" if line else "")
        build(args.dataset, p.draft.draft_vocab_size, info.vocab_size, args.out,
              progress=not args.no_progress, where=where)
    except (params.ParamsError, VerifierConfigError, VocabError) as e:
        print(f"vocab: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
