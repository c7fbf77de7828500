"""DVC stage `smoke`: real vLLM loads the verifier with each exported EAGLE-3 draft format,
checks the load engine-less, generates greedily (lossless vs non-speculative), and records the
mean acceptance length per format beside vLLM's ngram baseline."""
import argparse
import logging
import sys

from eagle3pipe import params as P


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc-yaml", default="dvc.yaml")
    ap.add_argument("--export", required=True, help="export dir with vllm/ and speculators/")
    ap.add_argument("--verifier", required=True, help="the verifier stage's output dir")
    ap.add_argument("--metrics", required=True, help="metrics JSON to write")
    ap.add_argument("--plots", required=True, help="per-position acceptance plot data (JSON)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        p = P.for_stage("smoke", a.params, a.dvc_yaml)
    except (P.ParamsError, KeyError) as e:
        print(f"smoke: {e}", file=sys.stderr)
        return 1
    from eagle3pipe import smoke

    try:
        m = smoke.run(p.smoke, export_dir=a.export, verifier_dir=a.verifier,
                      metrics_path=a.metrics, plots_path=a.plots)
    except smoke.SmokeError as e:
        print(f"smoke: {e}", file=sys.stderr)
        return 1
    for name, length in sorted(m["mean_acceptance_length"].items()):
        print(f"smoke: {name}: mean acceptance length {length} at k={m['num_speculative_tokens']}")
    print(f"smoke: wrote {a.metrics} and {a.plots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
