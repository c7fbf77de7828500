"""eagle3pipe benchmarks (`make bench`): every figure is a ratio of two things measured side by
side, interleaved and repeated in this one run (best of N after a warm-up), at a fixed thread
count, so that a noisy machine moves both sides alike. Writes bench/results.json (canonical JSON),
bench/scaling.tsv and bench/scaling.png, and prints a table. See bench/README.md.

    python bench/run.py                  # full run (~14 min on a quiet 2-core machine, the cold
                                         # default repro half of it; conversations ~35 min more)
    python bench/run.py --quick          # micro sizes only (a few minutes), results marked quick
    python bench/run.py --only extract,train   # sections: extract, train, dvc, e2e, scaling,
                                               # conversations
    python bench/run.py --skip-e2e       # reuse the previous run's cold repro figures
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (ROOT, THREADS, cpu_meter, load_json, log, machine, now_iso,  # noqa: E402
                    random_verifier, rnd, set_threads, synthetic_samples)
from tests.helpers.pipeline import MICRO_PARAMS, STAGES  # noqa: E402 (the repo root: common)

SECTIONS = ("extract", "train", "dvc", "e2e", "scaling", "conversations")
DEFAULT_PARAMS = ROOT / "params.yaml"

# what each mode measures; the targets are the issue's
MODES = {
    "quick": dict(extract_repeats=5, n_samples=128, len_range=(64, 256), train_batch_tokens=1024,
                  train_packs=2, train_repeats=3, dvc_repeats=3,
                  scaling=dict(hiddens=(64, 128), seq_lens=(128, 512), vocab=512, tokens=2048,
                               batch_tokens=512, n_packs=2, repeats=2),
                  conversations=dict(n=200, memory_sizes=[50, 200], repeats=2, max_repeats=3,
                                     batches=True)),
    "full": dict(extract_repeats=3, n_samples=256, len_range=(128, 384), train_batch_tokens=None,
                 train_packs=4, train_repeats=3, dvc_repeats=5,
                 scaling=dict(hiddens=(64, 128, 256), seq_lens=(128, 512), vocab=4096,
                              tokens=16384, batch_tokens=2048, n_packs=3, repeats=2),
                 # one round: a stage run on 10^4 conversations is ~5 min on the default
                 # architecture (a 2-core AMD EPYC)
                 conversations=dict(n=10_000, memory_sizes=[1_000, 3_000, 10_000], repeats=1,
                                    max_repeats=1, batches=False)),
}
TARGETS = {
    "extract_vs_forward": (">=", 0.9),
    "train_vs_speculators_step": (">=", 1.0),
    "noop_repro_vs_status": ("<=", 1.2),
    "conversations_stage_vs_bare_generate": (">=", 0.9),
    "conversations_memory_ratio": ("<=", 1.1),  # the issue: ~1, not growing with N
}
HEADLINES = ("extract_vs_forward", "bytes_per_token_vs_min", "train_vs_speculators_step",
             "noop_repro_vs_status", "cold_repro_seconds", "smoke_mean_acceptance_length",
             "conversations_stage_vs_bare_generate", "conversations_memory_ratio")


# ---------------------------------------------------------------------------------------------
# Inputs


def headline_verifier(quick: bool, work: Path):
    """(model dir, samples, description). Full: the repo's default verifier and its train split
    when `dvc repro` has produced them (else a random-init verifier of the default's sizes and
    synthetic samples). Quick: the micro embedded verifier, built here, synthetic samples."""
    from eagle3pipe.verifier import embedded
    from eagle3pipe.config import params
    from eagle3pipe.data.samples import read as read_split
    from eagle3pipe.verifier.handle import VerifierInfo

    mode = MODES["quick" if quick else "full"]
    if not quick:
        vdir = None
        try:
            from eagle3pipe.verifier.handle import model_dir
            vdir = Path(model_dir(ROOT / "artifacts/verifier"))
        except Exception as e:  # noqa: BLE001 - absent or stale artifacts: fall back below
            log(f"artifacts/verifier unusable ({e})")
        if vdir is not None and any(vdir.glob("*.safetensors")):
            info = VerifierInfo.from_config(vdir)
            name = vdir.relative_to(ROOT) if vdir.is_relative_to(ROOT) else vdir
            ds = ROOT / "artifacts/dataset/train.jsonl"
            if ds.is_file():
                return vdir, read_split(ds, info.vocab_size, None), \
                    f"{name} + artifacts/dataset/train.jsonl"
            return vdir, synthetic_samples(mode["n_samples"], *mode["len_range"],
                                           info.vocab_size), f"{name} + synthetic samples"
        log("no default verifier in artifacts/ (run `make repro`): using a random-init "
            "verifier of the default sizes and synthetic samples")
        e = params.load(DEFAULT_PARAMS).verifier.embedded
        vdir = random_verifier(work / "verifier", hidden=e.hidden_size,
                               vocab=e.tokenizer_vocab_size, layers=e.num_hidden_layers)
        return vdir, synthetic_samples(mode["n_samples"], *mode["len_range"],
                                       e.tokenizer_vocab_size), "random-init default sizes"
    vdir = work / "verifier"
    if not (vdir / "model.safetensors").is_file():
        log("building the micro embedded verifier (eagle3pipe.verifier.embedded.build, ~10 s)")
        embedded.build(params.load(MICRO_PARAMS).verifier.embedded, vdir, progress=False)
    info = VerifierInfo.from_config(vdir)
    return vdir, synthetic_samples(mode["n_samples"], *mode["len_range"], info.vocab_size), \
        "micro embedded verifier (H=64, 4 layers) + synthetic samples"


# ---------------------------------------------------------------------------------------------
# Sections


def run_extract_train(which: set[str], quick: bool, work: Path, out: dict) -> None:
    import compute
    from eagle3pipe.config import params
    from eagle3pipe.hidden.oracle import tf_load
    from eagle3pipe.verifier.handle import Verifier

    mode = MODES["quick" if quick else "full"]
    p = params.load(MICRO_PARAMS if quick else DEFAULT_PARAMS)
    vdir, samples, desc = headline_verifier(quick, work)
    model = tf_load(Verifier(vdir))
    aux = list(p.draft.aux_layer_ids)
    if "extract" in which:
        log(f"extract: {desc}, {len(samples)} samples, "
            f"{sum(len(s.input_ids) for s in samples)} tokens")
        r = compute.bench_extract(model, samples, aux, work / "extract",
                                  batch_size=p.extract.batch_size, dtype=p.extract.dtype,
                                  repeats=mode["extract_repeats"])
        r["verifier"] = desc
        committed = load_json(ROOT / "metrics/extract.json")
        if committed:
            r["committed_default_run"] = {
                k: committed.get(k) for k in ("bytes_per_token", "min_bytes_per_token")}
            r["committed_default_run"]["bytes_per_token_vs_min"] = rnd(
                committed["bytes_per_token"] / committed["min_bytes_per_token"], 5)
        shutil.rmtree(work / "extract", ignore_errors=True)
        out["extract"] = r
    if "train" in which:
        bt = mode["train_batch_tokens"] or p.train.batch_tokens
        log(f"train: {desc}, packs of {bt} tokens, draft head_dim {p.draft.head_dim}")
        dp = compute.write_datapath(model, samples, aux, work / "datapath",
                                    dtype=p.extract.dtype)
        r = compute.bench_train(vdir, dp, samples, p.draft, batch_tokens=bt,
                                ttt_steps=p.train.ttt_steps, n_packs=mode["train_packs"],
                                repeats=mode["train_repeats"], lr=p.train.learning_rate)
        r["verifier"] = desc
        shutil.rmtree(dp, ignore_errors=True)
        out["train"] = r


def run_dvc(quick: bool, work: Path, out: dict, cache: dict) -> None:
    import pipeline_bench as PB

    mode = MODES["quick" if quick else "full"]
    repo, cold = PB.cold_run(MICRO_PARAMS, work, "micro")
    cache["micro_cold"] = cold
    log(f"dvc: no-op repro vs status, {mode['dvc_repeats']} runs each, interleaved")
    noop = PB.noop_vs_status(repo, mode["dvc_repeats"])
    log(f"  no-op repro {noop['noop_repro']['best_s']} s, status {noop['status']['best_s']} s")
    old = int(PB.pipeline.get_param(repo, "draft.head_dim"))
    rb = PB.rebuild(repo, "draft.head_dim", PB.other_even(old))
    floor = PB.import_floor(repo)
    log(f"  import floor (fresh interpreter): {floor}")
    out["dvc"] = {"params": "tests/micro/params.yaml", "cold_micro": cold, **noop,
                  "head_dim_rebuild": rb, "import_floor_s": floor}


def run_e2e(quick: bool, work: Path, out: dict, cache: dict, rebuild: bool) -> None:
    import pipeline_bench as PB

    if quick:
        cold = cache.get("micro_cold")
        if cold is None:
            _, cold = PB.cold_run(MICRO_PARAMS, work, "micro")
        out["e2e"] = {"cold": cold, "note": "quick: the micro pipeline (tests/micro/params.yaml)"}
        return
    repo, cold = PB.cold_run(DEFAULT_PARAMS, work, "default")
    res = {"cold": cold}
    log("e2e: no-op repro vs status on the default run, 3 runs each")
    res.update(PB.noop_vs_status(repo, 3))
    if rebuild:
        old = int(PB.pipeline.get_param(repo, "draft.head_dim"))
        res["head_dim_rebuild"] = PB.rebuild(repo, "draft.head_dim", PB.other_even(old))
    out["e2e"] = res


def run_conversations(quick: bool, work: Path, out: dict) -> None:
    """The dataset stage on a synthetic multi-turn source vs a bare vLLM generate of the same
    prompts, and its memory at two source sizes (bench/conversations.py)."""
    import conversations

    c = MODES["quick" if quick else "full"]["conversations"]
    out["conversations"] = conversations.measure(
        c["n"], c["memory_sizes"], work / "conversations", repeats=c["repeats"],
        max_repeats=c["max_repeats"], batches=c["batches"])


def run_scaling(quick: bool, work: Path, out: dict) -> None:
    import compute
    from eagle3pipe.config import params

    s = MODES["quick" if quick else "full"]["scaling"]
    draft = params.load(MICRO_PARAMS if quick else DEFAULT_PARAMS).draft
    rows = compute.bench_scaling(work / "scaling", draft, hiddens=s["hiddens"],
                                 seq_lens=s["seq_lens"], vocab=s["vocab"], tokens=s["tokens"],
                                 batch_tokens=s["batch_tokens"], n_packs=s["n_packs"],
                                 repeats=s["repeats"])
    out["scaling"] = {"rows": rows, "config": {k: list(v) if isinstance(v, tuple) else v
                                               for k, v in s.items()},
                      "verifier": "random-init Llama, 4 layers (common.random_verifier)",
                      "draft": "4 heads, 2 KV heads, head_dim H/2, MLP 2.6875 H "
                               "(compute.scaling_draft)"}


# ---------------------------------------------------------------------------------------------
# Results


def busy_note() -> str | None:
    """Other work on the machine skews every ratio (2 threads per side on few cores): say so."""
    load1 = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load1 > 0.5 * cores:
        return (f"1-min load average {load1:.2f} on {cores} cores before the run: other "
                "processes compete for the CPU, ratios are unreliable (rerun on a quiet machine)")
    return None


def headline(res: dict, prev_note: dict) -> dict:
    """The issue's top-level fields from the sections present, each with its source."""
    fields, source = {}, {}

    def put(key, value, src):
        if value is not None:
            fields[key] = value
            source[key] = src

    sec_src = lambda name: prev_note.get(name, "this run")  # noqa: E731
    if "extract" in res:
        put("extract_vs_forward", res["extract"]["split_vs_forward"], sec_src("extract"))
        put("bytes_per_token_vs_min", res["extract"]["bytes_per_token_vs_min"],
            sec_src("extract"))
    if "train" in res:
        put("train_vs_speculators_step", res["train"].get("loop_vs_speculators_step"),
            sec_src("train"))
    if "dvc" in res:
        put("noop_repro_vs_status", res["dvc"]["noop_repro_vs_status"], sec_src("dvc"))
    if "conversations" in res:
        put("conversations_stage_vs_bare_generate",
            res["conversations"]["stage_vs_bare_generate"], sec_src("conversations"))
        put("conversations_memory_ratio", res["conversations"].get("stage_memory_ratio"),
            sec_src("conversations"))
    cold = (res.get("e2e") or {}).get("cold")
    if cold:
        put("cold_repro_seconds", cold["make_repro_s"], sec_src("e2e"))
        put("smoke_mean_acceptance_length",
            (cold["smoke"]["mean_acceptance_length"] or {}).get("vllm"), sec_src("e2e"))
    if "smoke_mean_acceptance_length" not in fields and not res.get("quick"):
        committed = load_json(ROOT / "metrics/smoke.json")
        if committed:
            put("smoke_mean_acceptance_length", committed["mean_acceptance_length"]["vllm"],
                "metrics/smoke.json (the committed default run)")
    return {**fields, "headline_sources": source}


def check_targets(res: dict) -> dict:
    out = {}
    for key, (op, target) in TARGETS.items():
        v = res.get(key)
        met = None if v is None else (v >= target if op == ">=" else v <= target)
        out[key] = {"target": f"{op} {target}", "met": met}
    return out


def table(res: dict) -> str:
    rows = [("figure", "value", "target", "met", "source")]
    for key in HEADLINES:
        v = res.get(key)
        t = res["targets"].get(key, {})
        met = {True: "yes", False: "NO", None: "-"}[t.get("met")]
        hint = {"bytes_per_token_vs_min": ">= 1, lower is better",
                "cold_repro_seconds": "(make repro)",
                "smoke_mean_acceptance_length": "(vLLM, k=3)"}.get(key, t.get("target", ""))
        rows.append((key, "n/a" if v is None else f"{v:g}", hint, met,
                     res["headline_sources"].get(key, "")))
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))

    def stage_table(title: str, r: dict) -> None:
        lines.append("")
        lines.append(f"{title}: {r['wall_s']:g} s in dvc repro "
                     f"({r['dvc_overhead_s']:g} s DVC start-up/checks/locks)")
        order = list(STAGES) + sorted(set(r["stages"]) - set(STAGES))  # JSON sorts keys
        for s in order:
            v = r["stages"].get(s)
            if v:
                lines.append(f"  {s:9s} {v['status']:10s} {v['seconds']:9.2f} s")

    e2e = res.get("e2e") or {}
    if e2e.get("cold"):
        stage_table(f"cold repro ({e2e['cold']['params']})", e2e["cold"])
        lines.append(f"  + eagle3pipe check {e2e['cold']['check_s']:g} s = make repro "
                     f"{e2e['cold']['make_repro_s']:g} s")
    if e2e.get("noop_repro_vs_status") is not None:
        lines.append(f"  no-op repro / status on this repo: {e2e['noop_repro_vs_status']:g} "
                     f"({e2e['noop_repro']['best_s']:g} s / {e2e['status']['best_s']:g} s)")
    dvc = res.get("dvc") or {}
    if dvc.get("head_dim_rebuild"):
        rb = dvc["head_dim_rebuild"]
        stage_table(f"draft.head_dim {rb['old']} -> {rb['new']} rebuild (micro; ran {rb['ran']}, "
                    f"expected {rb['expected']})", rb)
    if e2e.get("head_dim_rebuild"):
        rb = e2e["head_dim_rebuild"]
        stage_table(f"draft.head_dim {rb['old']} -> {rb['new']} rebuild (default)", rb)
    if dvc.get("import_floor_s"):
        lines.append("")
        lines.append("import floor of a stage process (s): " + ", ".join(
            f"{k} {v:g}" for k, v in dvc["import_floor_s"].items()))
    for name, key in (("extract", "tokens_per_s"), ("train", "tokens_per_s")):
        sec = res.get(name)
        if sec:
            lines.append("")
            lines.append(f"{name} tokens/s (best of {sec['rounds']}, {sec['tokens']} tokens, "
                         f"{sec.get('verifier', '')}):")
            lines.append("  " + ", ".join(f"{k} {v:g}" for k, v in sec[key].items()))
    lines += conversations_lines(res)
    sc = res.get("scaling")
    if sc:
        lines.append("")
        lines.append("scaling   hidden  seq_len  extract tok/s  vs fwd  train tok/s  vs spec")
        for r in sc["rows"]:
            lines.append(f"          {r['hidden_size']:6d}  {r['seq_len']:7d}  "
                         f"{r['extract_tokens_per_s']:13.0f}  {r['extract_vs_forward']:6.3f}  "
                         f"{r['train_tokens_per_s']:11.0f}  {r['train_vs_speculators_step']:7.3f}")
    return "\n".join(lines)


def conversations_lines(res: dict) -> list[str]:
    conv = (res.get("conversations") or {}).get("speed")
    if not conv:
        return []
    return ["", f"conversations: {conv['conversations']} ({conv['samples']} turns, "
            f"{conv['generated_tokens']} generated tokens), tokens/s best of {conv['rounds']}: "
            + ", ".join(f"{k} {v:g}" for k, v in conv["tokens_per_s"].items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="micro sizes only (a few minutes); results are marked quick")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections of {','.join(SECTIONS)}; sections not run "
                         "are carried over from the previous results file of the same mode")
    ap.add_argument("--skip-e2e", action="store_true", help="same as leaving e2e out of --only")
    ap.add_argument("--e2e-rebuild", action="store_true",
                    help="also time a draft.head_dim rebuild of the default pipeline (adds the "
                         "default train/export/smoke stages, ~5-8 min); the micro one always runs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results.json")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the temporary repos and files go (default: a fresh temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)

    which = {s.strip() for s in args.only.split(",") if s.strip()}
    bad = which - set(SECTIONS)
    if bad:
        ap.error(f"--only: unknown section(s) {sorted(bad)}; choose from {','.join(SECTIONS)}")
    if args.skip_e2e:
        which.discard("e2e")
    set_threads(THREADS)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="eagle3pipe-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meter = cpu_meter()
    res: dict = {"quick": args.quick, "date": now_iso(), **machine(), "threads": THREADS,
                 "command": " ".join(["python", "bench/run.py",
                                     *(argv if argv is not None else sys.argv[1:])])}
    log(f"sections {sorted(which)}, {'quick' if args.quick else 'full'} mode, work dir {work}")
    busy = busy_note()
    if busy:
        log(f"WARNING at start: {busy}")
    cache: dict = {}
    try:
        if which & {"extract", "train"}:
            run_extract_train(which, args.quick, work, res)
        if "dvc" in which:
            run_dvc(args.quick, work, res, cache)
        if "e2e" in which:
            run_e2e(args.quick, work, res, cache, args.e2e_rebuild)
        if "scaling" in which:
            run_scaling(args.quick, work, res)
        if "conversations" in which:
            run_conversations(args.quick, work, res)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    # sections not run now: carried over from the previous results of the same mode
    prev = load_json(args.out) or {}
    prev_note = {}
    res["section_dates"] = {s: res["date"] for s in SECTIONS if s in res}
    if prev.get("quick") == args.quick:
        for s in SECTIONS:
            if s not in res and s in prev:
                res[s] = prev[s]
                when = (prev.get("section_dates") or {}).get(s, prev.get("date"))
                res["section_dates"][s] = when
                prev_note[s] = f"carried over from {args.out.name} of {when}"
                log(f"{s}: not run now; {prev_note[s]}")
    res.update(headline(res, prev_note))
    res["targets"] = check_targets(res)
    res["seconds"] = rnd(time.perf_counter() - started)
    share = meter.other_share()
    res["other_processes_cpu_share"] = None if share is None else round(share, 3)
    busy_end = (f"other processes used {share:.0%} of the machine's CPU time during the run: "
                "ratios are unreliable (rerun on a quiet machine)"
                if share is not None and share > 0.15 else None)
    res["busy_warning"] = "; ".join(x for x in (busy and f"at start: {busy}", busy_end)
                                    if x) or None
    if "conversations" in which:  # the top-level machine facts describe only the latest run
        res["conversations"]["machine"] = {k: res[k] for k in (
            "cpu_model", "cpu_count", "loadavg_at_start", "other_processes_cpu_share")}
    missing = [k for k in HEADLINES if res.get(k) is None]
    if missing:
        log(f"not measured (run those sections): {missing}")

    from eagle3pipe.runtime.jsonio import dumps
    from eagle3pipe.runtime.atomic import write_text_atomic

    write_text_atomic(args.out, dumps(res))
    if "scaling" in res and "scaling" in which:
        import compute
        rows = res["scaling"]["rows"]
        write_text_atomic(args.out.parent / "scaling.tsv", compute.scaling_tsv(rows))
        if not compute.scaling_png(rows, args.out.parent / "scaling.png"):
            log("Pillow is not importable: no scaling.png (scaling.tsv has the numbers)")
    for f in ("results.json", "scaling.tsv", "scaling.png"):
        f = args.out if f == "results.json" else args.out.parent / f
        if f.exists():
            f.chmod(0o644)  # mkstemp writes 0600
    print(table(res))
    if res["busy_warning"]:
        print(f"\nWARNING {res['busy_warning']}")
    print(f"\nwrote {args.out}" + (" (quick: micro sizes)" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
