"""Command line: `eagle3pipe render`, `check`, `plan` (no DVC involved), `deps` and `gc`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3pipe.tools import check as C
from eagle3pipe.tools import scan as S
from eagle3pipe.draft import formats as R
from eagle3pipe.config import params as P
from eagle3pipe.draft.arch import derive
from eagle3pipe.draft.checkpoint import check_checkpoint
from eagle3pipe.errors import Error
from eagle3pipe.runtime.jsonio import read_json_object
from eagle3pipe.verifier.handle import VerifierInfo


def _load(args) -> tuple[P.Params, Path]:
    params = P.load(args.params)
    vcfg = Path(args.verifier_config) if args.verifier_config else \
        R.default_verifier_config(params.verifier.path, args.configs)
    return params, vcfg


def cmd_render(args) -> int:
    params, vcfg = _load(args)
    states = R.render_into(args.out, params.draft, params.verifier.path, vcfg,
                           params_file=args.params, lines=P.lines_of(params))
    for path, state in states.items():
        print(f"{path}: {state}")
    return 0


def _reference(args, files: dict[str, str], verifier_num_layers: int) -> list[str]:
    """Prints the field-by-field comparison with a published flat config; its problems."""
    ref = read_json_object(args.reference, R.ConfigError,
                           "pass a published flat EAGLE-3 config.json", "reference config")
    rows, found = C.compare_reference(json.loads(files["vllm/config.json"]), ref,
                                      verifier_num_layers=verifier_num_layers)
    print(f"reference {args.reference}:")
    for r in rows:
        mark = "  " if r["same"] else ("!!" if r["vllm_reads"] else " ~")
        who = "vLLM reads" if r["vllm_reads"] else "ignored   "
        theirs = f"reference omits it: vLLM uses {r['reference']!r} ({r['source']})" \
            if r["omitted"] else f"reference={r['reference']!r}"
        print(f"  {mark} {who} {r['field']:<48} ours={r['ours']!r:<22} {theirs}")
    return [f"{args.reference}: {p}" for p in found]


def cmd_check(args) -> int:
    problems: list[str] = []
    params, vcfg = _load(args)
    info = VerifierInfo.from_config(vcfg)
    arch = derive(params.draft, info, params_file=args.params, lines=P.lines_of(params))
    files = R.render_files(params.draft, params.verifier.path, vcfg, params_file=args.params,
                           lines=P.lines_of(params))
    print(f"params: {args.params} valid; verifier config {vcfg}")
    if not args.no_configs:
        found = C.check_rendered(files, args.configs)
        print(f"derived configs in {args.configs}/: {'OK' if not found else 'STALE'}")
        problems += found
    for ckpt in args.checkpoint or []:
        found = check_checkpoint(ckpt, arch, against=args.params)
        print(f"checkpoint {ckpt}: {'OK' if not found else f'{len(found)} problem(s)'}")
        problems += found
    if args.reference:
        problems += _reference(args, files, arch.verifier_num_layers)
    if not args.no_scan:
        found = S.scan_constants(args.root, params, files, params_file=args.params)
        print("hand-written architecture and serving values: "
              f"{'none contradict params.yaml' if not found else len(found)}")
        problems += found
    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print("check: OK")
    return 0


def cmd_plan(args) -> int:
    from eagle3pipe.tools import plan

    params, vcfg = _load(args)
    p = plan.build(params, vcfg, gpu=args.gpu, device_gib=args.device_gib,
                   artifacts=args.artifacts)
    print(json.dumps(p.to_dict(), indent=2) if args.json else plan.render(p))
    return 1 if p.problems else 0


def cmd_deps(args) -> int:
    from eagle3pipe.tools import deps

    diffs = deps.sync(args.dvc_yaml, write=args.write)
    for line in diffs:
        print(f"{args.dvc_yaml}: {line}")
    if diffs and not args.write:
        print("fix: run `eagle3pipe deps --write`", file=sys.stderr)
        return 1
    return 0


def _size(text: str) -> int:
    """--max-bytes: store.parse_size, as argparse wants its errors."""
    from eagle3pipe.data import store

    try:
        return store.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_gc(args) -> int:
    from eagle3pipe.data import store

    r = store.gc(Path(args.repo), args.max_bytes, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"store {r['store']}: {r['entries']} entries, {r['bytes']:,} bytes; {verb} "
          f"{r['removed']} unreferenced ({r['freed_bytes']:,} bytes); {r['bytes_after']:,} "
          f"bytes left; {r['referenced']} keys referenced by dvc.lock, experiments or the "
          "workspace")
    if r["over_bound"]:
        print(f"eagle3pipe gc: the referenced entries alone exceed --max-bytes "
              f"{args.max_bytes:,}\n    fix: raise the bound, or drop old experiments "
              "(`dvc exp remove`) and commits' outputs you no longer need", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3pipe", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--params", default="params.yaml")
    common.add_argument("--verifier-config", help="verifier config.json (default: verifier.path,"
                        " artifacts/verifier, then configs/verifier_config.json)")
    common.add_argument("--configs", default="configs", help="the derived configs dir")
    r = sub.add_parser("render", parents=[common], help="render derived configs")
    r.add_argument("--out", required=True)
    c = sub.add_parser("check", parents=[common], help="find drift between params and files")
    c.add_argument("--checkpoint", action="append", help="safetensors draft dir (repeatable)")
    c.add_argument("--reference", help="a published flat EAGLE-3 config.json to compare with")
    c.add_argument("--root", default=".", help="repository to scan for hand-written constants")
    c.add_argument("--no-scan", action="store_true")
    c.add_argument("--no-configs", action="store_true", help="skip the derived-configs check")
    d = sub.add_parser("deps", help="dvc.yaml's code deps vs each stage's import closure")
    d.add_argument("--dvc-yaml", default="dvc.yaml")
    d.add_argument("--write", action="store_true", help="rewrite the stale entries in place")
    pl = sub.add_parser("plan", parents=[common], help="what each stage will run, hold and "
                        "write, and what cannot work (exit 1 on problems)")
    pl.add_argument("--json", action="store_true", help="the machine-readable form")
    pl.add_argument("--device-gib", type=float, default=80.0, help="one GPU's memory (GiB)")
    pl.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                    help="plan for the GPU path (default: whether torch sees a GPU)")
    pl.add_argument("--artifacts", default="artifacts", help="where the stages write")
    g = sub.add_parser("gc", help="remove per-sample store entries no committed dvc.lock, "
                       "experiment or workspace output refers to, oldest first")
    g.add_argument("--max-bytes", type=_size, default=None,
                   help="stop once the store is this small (e.g. 50G); default: remove every "
                   "unreferenced entry")
    g.add_argument("--dry-run", action="store_true")
    g.add_argument("--repo", default=".", help="the project (its git refs and DVC cache)")
    args = ap.parse_args(argv)
    if args.cmd == "deps":
        return cmd_deps(args)
    try:
        return {"render": cmd_render, "check": cmd_check, "plan": cmd_plan,
                "gc": cmd_gc}[args.cmd](args)
    except Error as e:
        print(f"eagle3pipe {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
