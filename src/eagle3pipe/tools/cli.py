"""Command line: `eagle3pipe render`, `check`, `plan` (no DVC involved), `deps`, `gc`, `serve`
and `launch`.
Exit codes: eagle3pipe.errors (0 ok, 1 a check found differences, 2 an input to fix)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3pipe.config import params
from eagle3pipe.config.schema import Params
from eagle3pipe.draft import parsing
from eagle3pipe.engines import serving
from eagle3pipe.draft.arch import derive
from eagle3pipe.draft.checkpoint import check_checkpoint
from eagle3pipe.errors import EXIT_FOUND, EXIT_INPUT, EXIT_OK, Error
from eagle3pipe.runtime import units
from eagle3pipe.runtime.jsonio import read_json_object
from eagle3pipe.stages.configs import run as configs
from eagle3pipe.tools import check, scan
from eagle3pipe.verifier.handle import VerifierInfo, find_config


def _load(args) -> tuple[Params, Path]:
    p = params.load(args.params)
    vcfg = Path(args.verifier_config) if args.verifier_config else \
        find_config(p.verifier.path, args.configs)
    return p, vcfg


def cmd_render(args) -> int:
    p, vcfg = _load(args)
    states = configs.render_into(args.out, p.draft, p.verifier.path, vcfg,
                                 params_file=args.params, lines=params.lines_of(p))
    states |= serving.render_into(args.out, p)
    for path, state in states.items():
        print(f"{path}: {state}")
    return EXIT_OK


def _reference(args, files: dict[str, str], verifier_num_layers: int) -> list[str]:
    """Prints the field-by-field comparison with a published config, against our rendered
    config of the same layout (flat or speculators'); its problems."""
    ref = read_json_object(args.reference, parsing.ConfigError,
                           "pass a published EAGLE-3 draft config.json", "reference config")
    ours = "speculators/config.json" if check.SPECULATORS_KEY in ref else "vllm/config.json"
    rows, found = check.compare_reference(json.loads(files[ours]), ref,
                                          verifier_num_layers=verifier_num_layers)
    print(f"reference {args.reference} against the rendered {ours}, each as vLLM loads it:")
    for r in rows:
        mark = "  " if r["same"] else ("!!" if r["vllm_reads"] else " ~")
        who = "vLLM reads" if r["vllm_reads"] else "ignored   "
        theirs = f"reference omits it: vLLM uses {r['reference']!r} ({r['source']})" \
            if r["omitted"] else f"reference={r['reference']!r}"
        print(f"  {mark} {who} {r['field']:<48} ours={r['ours']!r:<22} {theirs}")
    return [f"{args.reference}: {p}" for p in found]


def cmd_check(args) -> int:
    problems: list[str] = []
    p, vcfg = _load(args)
    info = VerifierInfo.from_config(vcfg)
    lines = params.lines_of(p)
    arch = derive(p.draft, info, params_file=args.params, lines=lines)
    files = configs.render_files(p.draft, p.verifier.path, vcfg, params_file=args.params,
                                 lines=lines)
    files |= serving.render_files(p)
    print(f"params: {args.params} valid; verifier config {vcfg}")
    if not args.no_configs:
        found = check.check_rendered(files, args.configs)
        print(f"derived configs in {args.configs}/: {'OK' if not found else 'STALE'}")
        problems += found
    for ckpt in args.checkpoint or []:
        found = check_checkpoint(ckpt, arch, against=args.params)
        print(f"checkpoint {ckpt}: {'OK' if not found else f'{len(found)} problem(s)'}")
        problems += found
    if args.reference:
        problems += _reference(args, files, arch.verifier_num_layers)
    if not args.no_scan:
        found = scan.scan_constants(args.root, p, files, params_file=args.params)
        print("hand-written architecture and serving values: "
              f"{'none contradict params.yaml' if not found else len(found)}")
        problems += found
    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stderr)
        for x in problems:
            print(f"  - {x}", file=sys.stderr)
        return EXIT_FOUND
    print("check: OK")
    return EXIT_OK


def cmd_plan(args) -> int:
    from eagle3pipe.tools import plan

    try:  # here, not as argparse's type: importing the planner imports every stage
        tokens = None if args.tokens is None else plan.parse_tokens(args.tokens)
    except ValueError as e:
        print(f"eagle3pipe plan: error: argument --tokens: {e}", file=sys.stderr)
        return EXIT_INPUT
    p, vcfg = _load(args)
    built = plan.build(p, vcfg, gpu=args.gpu, device_gib=args.device_gib,
                       artifacts=args.artifacts, tokens=tokens, disk=args.disk)
    print(json.dumps(built.to_dict(), indent=2) if args.json else plan.render(built))
    return EXIT_FOUND if built.problems else EXIT_OK


def cmd_deps(args) -> int:
    from eagle3pipe.tools import deps

    diffs = deps.sync(args.dvc_yaml, write=args.write)
    for line in diffs:
        print(f"{args.dvc_yaml}: {line}")
    if diffs and not args.write:
        print("fix: run `eagle3pipe deps --write`", file=sys.stderr)
        return EXIT_FOUND
    return EXIT_OK


def _size(text: str) -> int:
    """--max-bytes: units.parse_size, as argparse wants its errors."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_gc(args) -> int:
    from eagle3pipe.data import gc

    r = gc.gc(Path(args.repo), args.max_bytes, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"store {r['store']}: {r['entries']} entries, {r['bytes']:,} bytes; {verb} "
          f"{r['removed']} unreferenced ({r['freed_bytes']:,} bytes); {r['bytes_after']:,} "
          f"bytes left; {r['referenced']} keys referenced by dvc.lock, experiments or the "
          "workspace")
    if r["leftovers_removed"]:
        print(f"store {r['store']}: {verb} {r['leftovers_removed']} temporaries dead writers on "
              f"this host left ({r['leftovers_bytes']:,} bytes)")
    _gc_checkpoints(Path(args.repo), verb, dry_run=args.dry_run)
    if r["over_bound"]:
        raise Error(f"the referenced entries alone exceed --max-bytes {args.max_bytes:,}",
                    fix="raise the bound, or drop old experiments (`dvc exp remove`) and "
                    "commits' outputs you no longer need")
    return EXIT_OK


def _gc_checkpoints(repo: Path, verb: str, *, dry_run: bool) -> None:
    """The train stage's checkpoints of every key but the workspace's current one."""
    from eagle3pipe.stages.train import checkpoint as ck
    keep = ck.key_of(params.load(repo / "params.yaml").train, repo / "dvc.yaml")
    gone = ck.remove_stale(keep, repo / ck.ROOT, dry_run=dry_run)
    print(f"checkpoints {repo / ck.ROOT}: {verb} {len(gone)} of other inputs or params; kept "
          f"{keep} (the current params and inputs) if present")


def cmd_serve(args) -> int:
    from eagle3pipe.tools import serve

    return serve.serve(fmt=args.format, host=args.host, port=args.port, params_file=args.params,
                       configs_dir=args.configs, verifier_dir=args.verifier,
                       draft=not args.no_draft, hidden_states=args.hidden_states,
                       timeout=args.timeout, echo=not args.quiet)


def cmd_launch(args) -> int:
    from eagle3pipe.runtime import launch as run_launch
    from eagle3pipe.tools import launch

    t = params.load(args.params).train
    script = launch.stage_script(args.dvc_yaml)
    if args.slurm:
        launch.node_commands(t, script)  # refuses nnodes 1
        text = run_launch.slurm_script(t, script, workdir=str(Path.cwd()))
        Path(args.slurm).write_text(text)
        print(f"wrote {args.slurm}: `sbatch {args.slurm}` starts nodes 1..{t.nnodes - 1}; "
              f"node 0 is `dvc repro train` here, at {t.rdzv_endpoint}")
        return EXIT_OK
    for rank, line in launch.node_commands(t, script, args.node_rank).items():
        print(f"# node {rank} of {t.nnodes}, in this repository's directory on that node:\n{line}"
              if args.node_rank is None else line)
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    """eagle3pipe's parser: every subcommand, in the order `--help` lists them."""
    ap = argparse.ArgumentParser(prog="eagle3pipe", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--params", default="params.yaml")
    common.add_argument("--verifier-config", help="verifier config.json (default: verifier.path,"
                        " artifacts/verifier, then configs/verifier_config.json)")
    common.add_argument("--configs", default="configs", help="the derived configs dir")
    _add_consistency_commands(sub, common)
    _add_resource_commands(sub, common)
    _add_run_commands(sub)
    return ap


def _add_consistency_commands(sub, common: argparse.ArgumentParser) -> None:
    """render, check and deps: the derived configs, the drift between params and files, and
    dvc.yaml's code deps, each against what it must agree with."""
    r = sub.add_parser("render", parents=[common], help="render derived configs")
    r.add_argument("--out", required=True)
    c = sub.add_parser("check", parents=[common], help="find drift between params and files")
    c.add_argument("--checkpoint", action="append", help="safetensors draft dir (repeatable)")
    c.add_argument("--reference", help="a published EAGLE-3 draft config.json (flat or speculators' layout) "
                   "to compare with")
    c.add_argument("--root", default=".", help="repository to scan for hand-written constants")
    c.add_argument("--no-scan", action="store_true")
    c.add_argument("--no-configs", action="store_true", help="skip the derived-configs check")
    d = sub.add_parser("deps", help="dvc.yaml's code deps vs each stage's import closure")
    d.add_argument("--dvc-yaml", default="dvc.yaml")
    d.add_argument("--write", action="store_true", help="rewrite the stale entries in place")


def _add_resource_commands(sub, common: argparse.ArgumentParser) -> None:
    """plan and gc: what the stages will run, hold and write, and removing the store entries
    nothing refers to any more."""
    pl = sub.add_parser("plan", parents=[common], help="what each stage will run, hold and "
                        "write, and what cannot work (exit 1 on problems)")
    pl.add_argument("--json", action="store_true", help="the machine-readable form")
    pl.add_argument("--device-gib", type=float, default=80.0, help="one GPU's memory (GiB)")
    pl.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                    help="plan for the GPU path (default: whether torch sees a GPU)")
    pl.add_argument("--artifacts", default="artifacts", help="where the stages write")
    pl.add_argument("--tokens", default=None, help="plan for this many tokens (e.g. 1e9) "
                    "instead of dataset.num_samples x (max_prompt_tokens + max_new_tokens)")
    pl.add_argument("--disk", type=_size, default=None, help="the free disk to judge each "
                    "extract.mode against (e.g. 20T); default: the free space where it writes")
    g = sub.add_parser("gc", help="remove per-sample store entries no committed dvc.lock, "
                       "experiment or workspace output refers to, oldest first")
    g.add_argument("--max-bytes", type=_size, default=None,
                   help="stop once the store is this small (e.g. 50G); default: remove every "
                   "unreferenced entry")
    g.add_argument("--dry-run", action="store_true")
    g.add_argument("--repo", default=".", help="the project (its git refs and DVC cache)")


def _add_run_commands(sub) -> None:
    """serve and launch: running the verifier with a draft, and the train stage on other nodes,
    outside DVC."""
    sv = sub.add_parser("serve", help="vLLM's OpenAI-compatible server on the verifier with "
                        "one exported draft, from configs/serve/ (docs/serve.md)")
    sv.add_argument("--format", choices=("vllm", "speculators"), default="vllm",
                    help="which export (artifacts/export/<format>)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--params", default="params.yaml")
    sv.add_argument("--configs", default="configs", help="the derived configs dir")
    sv.add_argument("--verifier", default="artifacts/verifier", help="the verifier stage's output")
    sv.add_argument("--no-draft", action="store_true", help="the verifier alone, the same engine "
                    "arguments (the baseline to compare with)")
    sv.add_argument("--hidden-states", action="store_true", help="the verifier capturing hidden "
                    "states into $EAGLE3PIPE_STORE for the train stage (extract.endpoint)")
    sv.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    sv.add_argument("--quiet", action="store_true", help="do not echo the server's output")
    la = sub.add_parser("launch", help="the train stage's torchrun command for the other "
                        "nodes (train.nnodes > 1), or a Slurm batch script that runs it")
    la.add_argument("--params", default="params.yaml")
    la.add_argument("--dvc-yaml", default="dvc.yaml")
    la.add_argument("--node-rank", type=int, default=None,
                    help="print only this node's command (1 .. train.nnodes - 1)")
    la.add_argument("--slurm", metavar="FILE", help="write a Slurm batch script for nodes "
                    "1 .. train.nnodes - 1 instead")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"render": cmd_render, "check": cmd_check, "plan": cmd_plan, "deps": cmd_deps,
                "gc": cmd_gc, "serve": cmd_serve, "launch": cmd_launch}[args.cmd](args)
    except Error as e:
        print(f"eagle3pipe {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
