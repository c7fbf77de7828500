"""DVC stage `verifier`: build the embedded verifier (verifier.path: null) or fingerprint an
existing Hugging Face checkpoint (verifier.path: DIR) into --out, metrics into --metrics.

Params read as inputs (for_stage): verifier.path, verifier.hash_mode, verifier.embedded.
The `draft` section is also loaded, for VALIDATION ONLY: the verifier is cross-checked against it
(arch.derive) so an impossible pairing fails here, before anything is written. It never changes
an output, so it is not declared as an input of this stage (the configs stage, which does
declare it, repeats the check).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from eagle3pipe import params as P
from eagle3pipe import verifier
from eagle3pipe.arch import ArchError
from eagle3pipe.fingerprint import FingerprintError
from eagle3pipe.runtime import write_json
from eagle3pipe.verifier_info import VerifierConfigError

log = logging.getLogger("stages.verifier")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="artifacts/verifier")
    ap.add_argument("--metrics", default="metrics/verifier.json")
    ap.add_argument("--dvc-yaml", default="dvc.yaml",
                    help="the stage graph that declares which params keys this stage reads")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        p = P.for_stage("verifier", args.params, args.dvc_yaml)
        full = P.load(args.params)  # validation only: see the module docstring
        metrics = verifier.run(p.verifier, args.out, draft=full.draft,
                               params_file=P.source_of(full), lines=getattr(full, "_lines", {}),
                               base_dir=Path.cwd(), progress=not args.no_progress)
    except (P.ParamsError, ArchError, VerifierConfigError, verifier.VerifierError,
            FingerprintError) as e:
        print(f"verifier: {e}", file=sys.stderr)
        return 2
    write_json(args.metrics, metrics)
    log.info("wrote %s and %s (%s)", args.out, args.metrics,
             ", ".join(f"{k}={metrics[k]}" for k in ("mode", "n_files", "total_bytes")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
