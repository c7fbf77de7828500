"""DVC stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) on the verifier's hidden
states, with our own seeded loop; dvclive writes metrics/train/.

    python stages/train.py --params params.yaml --draft-config configs/draft_config.json \
        --verifier artifacts/verifier --hidden artifacts/hidden --vocab artifacts/vocab \
        --out artifacts/train

Several GPUs (train.device: cuda): run the same command under torchrun, e.g.
    torchrun --nproc-per-node 8 stages/train.py <the arguments above>
"""
from __future__ import annotations

import argparse
import logging
import sys

from eagle3pipe import params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc-yaml", default="dvc.yaml",
                    help="the stage graph that declares which params keys this stage may read")
    ap.add_argument("--draft-config", default="configs/draft_config.json")
    ap.add_argument("--verifier", default="artifacts/verifier")
    ap.add_argument("--hidden", default="artifacts/hidden")
    ap.add_argument("--vocab", default="artifacts/vocab")
    ap.add_argument("--out", default="artifacts/train")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from eagle3pipe import train
    from eagle3pipe.verifier_info import VerifierConfigError

    try:
        from eagle3pipe.verifier import VerifierError
    except ImportError:  # pragma: no cover
        VerifierError = VerifierConfigError  # noqa: N806
    try:
        p = params.for_stage("train", args.params, args.dvc_yaml)
        final = train.train(p.train, args.draft_config, args.verifier, args.hidden, args.vocab,
                            args.out, metrics_dir="metrics/train",
                            progress=not args.no_progress)
    except (params.ParamsError, train.TrainInputError, VerifierConfigError,
            VerifierError) as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 1
    ev = final.get("eval", {})
    print(f"train: {args.out} written; step {final.get('step')}, eval loss "
          f"{ev.get('loss', float('nan')):.4f}, acceptance length (training estimate) "
          f"{ev.get('accept_len', float('nan')):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
