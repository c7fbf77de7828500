"""DVC stage `export`: the trained draft in both formats vLLM loads, each contract-checked.

    python stages/export.py --checkpoint artifacts/train \
        --speculators-config configs/speculators/config.json \
        --vllm-config configs/vllm/config.json --verifier artifacts/verifier \
        --out artifacts/export

writes <out>/speculators/ and <out>/vllm/ ({config.json (the configs/ file, byte for byte),
model.safetensors}). This stage reads no params: the configs carry the architecture.
"""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dvc-yaml", default="dvc.yaml", help="unused: export reads no params")
    ap.add_argument("--checkpoint", default="artifacts/train")
    ap.add_argument("--speculators-config", default="configs/speculators/config.json")
    ap.add_argument("--vllm-config", default="configs/vllm/config.json")
    ap.add_argument("--verifier", default="artifacts/verifier",
                    help="the verifier stage's output (only its config.json is read)")
    ap.add_argument("--out", default="artifacts/export")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from eagle3pipe import export
    from eagle3pipe.runtime import record_run

    record_run("export")
    from eagle3pipe.verifier_info import VerifierConfigError

    try:
        summary = export.export(args.checkpoint, args.speculators_config, args.vllm_config,
                                args.verifier, args.out)
    except (export.ExportError, VerifierConfigError) as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 1
    for fmt, s in summary.items():
        print(f"export: {args.out}/{fmt}: {s['tensors']} tensors, {s['dtype']}, {s['bytes']} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
