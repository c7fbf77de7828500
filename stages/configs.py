"""DVC stage `configs`: render every derived config from params.yaml + the verifier config."""
import argparse
import sys

from eagle3pipe import params as P
from eagle3pipe import render


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--dvc-yaml", default="dvc.yaml")
    ap.add_argument("--verifier", required=True, help="the verifier's config.json")
    ap.add_argument("--out", default="configs")
    a = ap.parse_args()
    try:
        p = P.for_stage("configs", a.params, a.dvc_yaml)
        files = render.render_files(p.draft, p.verifier.path, a.verifier,
                                    params_file=a.params, lines=P.lines_of(p))
    except (P.ParamsError, ValueError, FileNotFoundError) as e:
        print(f"configs: {e}", file=sys.stderr)
        return 1
    changed = render.write(files, a.out)
    for rel in files:
        print(f"configs: {a.out}/{rel} {'written' if any(str(c).endswith(rel) for c in changed) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
