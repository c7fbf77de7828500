"""Where speculation pays: modelled decode speedup of the EAGLE-3 draft and of vLLM's ngram
against no speculation, as a function of verifier size, from measured per-forward times of
verifiers and drafts at a few sizes and the acceptance measured in vLLM (metrics/smoke.json).

    python bench/speedup.py                  # the default grid (~3 min on this 2-core machine)
    python bench/speedup.py --quick          # two tiny sizes, seconds; writes nothing

The model (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Sec. 3.3: improvement factor E[tokens per step] / (k c + 1) with c = t_draft / t_verify; with
the verification forward of k + 1 tokens timed on its own, as in Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling"):

    speedup(k) = tau(k) * t_v(1) / (t_fc + k * t_d + t_v(k + 1))

t_v(n): one verifier forward of n new tokens per sequence over a KV cache; t_d: one draft
forward (the EAGLE-3 layer on [embedding, hidden] and the draft lm_head), run k times per step;
t_fc: the draft's fc over the 3 captured hidden states, once per step. tau(k) = E[tokens per
step] = 1 + sum_{i<=k} a_i, with a_i the measured per-position acceptance (the fraction of
steps whose first i drafts were all accepted), of the draft in the vllm layout and of ngram
(whose proposer costs ~nothing: t_d = t_fc = 0). Scheduler, sampling and proposer overheads
outside the forwards are not modelled; the smoke stage measures the real thing at the embedded
size (metrics/smoke_timing.json), shown beside the model's row for it.

Verifiers are random-init Llama models built in-process from configs (no downloads; the
embedded verifier's family: head_dim 64, heads = hidden / 64, KV heads = heads / 2, MLP 2 x
hidden, its 4096-token vocabulary); drafts have the default draft's proportions
(compute.scaling_draft). Per forward: this process's CPU time on one torch thread (a busy
machine's other work does not stretch it), best of N interleaved repeats after a warm-up, at
one sequence and at the smoke stage's batch (smoke.num_prompts sequences), over a KV cache of a
typical smoke context.
Writes bench/speedup.json, bench/speedup.tsv (x = verifier parameters, for dvc plots) and
bench/speedup.png.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, cpu_meter, interleave, log, machine, now_iso, rnd  # noqa: E402

# (hidden, layers) of the verifiers; 128 x 16 is the embedded default's size (the smoke stage's
# measured speedups are shown beside its rows; the family and the draft proportions below are
# exactly the default's there), 256 x 4 a shallow verifier of about the same parameters
GRID = ((256, 4), (128, 16), (256, 16), (512, 8), (512, 24), (1024, 16), (1024, 32))
QUICK_GRID = ((64, 2), (64, 8))
FAMILY = "random-init Llama: head_dim 64, heads hidden/64, KV heads heads/2, MLP 2 x hidden"
# one torch thread, timed in CPU time: a shared machine's other work then stretches no timing
# (with two OpenMP threads on two busy cores a stalled thread stalls its sibling, 10x and more);
# the model needs only ratios of forward times at one thread count
THREADS_TIMED = 1


# ---------------------------------------------------------------------------------------------
# models


def verifier_config(hidden: int, layers: int, vocab: int, max_pos: int = 2048):
    """A Llama config of the embedded verifier's family (hidden 256, 4 layers is the default)."""
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                      max_position_embeddings=max_pos, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      bos_token_id=0, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def draft_layer(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                draft_vocab: int, vocab: int):
    """One EAGLE-3 draft forward as vLLM's Eagle3LlamaForCausalLM computes it: the embedding
    and the previous hidden state, each RMS-normed, concatenated (2 x hidden) into q/k/v,
    attention over the draft's KV cache, o_proj + residual, the SiLU MLP, the final norm and
    the draft lm_head, and the argmax; `fc` (3 x hidden -> hidden) maps the verifier's captured
    states, once per step."""
    import torch
    from torch import nn

    class Draft(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.fc = nn.Linear(3 * hidden, hidden, bias=False)
            self.input_norm, self.hidden_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
            self.qkv = nn.Linear(2 * hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
            self.o = nn.Linear(heads * head_dim, hidden, bias=False)
            self.post_norm, self.norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
            self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
            self.down = nn.Linear(intermediate, hidden, bias=False)
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)

        def forward(self, tok, h, k_cache, v_cache):
            b = tok.shape[0]
            x = torch.cat([self.input_norm(self.embed(tok)), self.hidden_norm(h)], -1)
            q, k, v = self.qkv(x).split([heads * head_dim, kv_heads * head_dim,
                                         kv_heads * head_dim], -1)
            q = q.view(b, 1, heads, head_dim).transpose(1, 2)
            k = torch.cat([k_cache, k.view(b, 1, kv_heads, head_dim).transpose(1, 2)], 2)
            v = torch.cat([v_cache, v.view(b, 1, kv_heads, head_dim).transpose(1, 2)], 2)
            a = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            h = h + self.o(a.transpose(1, 2).reshape(b, 1, heads * head_dim))
            g, u = self.gate_up(self.post_norm(h)).chunk(2, -1)
            h = h + self.down(nn.functional.silu(g) * u)
            return self.lm_head(self.norm(h)).argmax(-1), h

    return Draft().eval()


def params_of(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# timing


def time_size(hidden: int, layers: int, *, vocab: int, draft_params, batches: list[int],
              context: int, ks: list[int], repeats: int, inner: int) -> list[dict]:
    """Per-forward seconds (best of the interleaved repeats) of one verifier size at each batch
    size, a row each: t_v(n) for n = 1 and k + 1 of every k, t_d, t_fc."""
    import torch
    from transformers import LlamaForCausalLM

    import compute

    torch.manual_seed(hidden + layers)
    verifier = LlamaForCausalLM(verifier_config(hidden, layers, vocab)).eval()
    d = compute.scaling_draft(draft_params, hidden, vocab)
    draft = draft_layer(hidden, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
                        d.intermediate_size, d.draft_vocab_size, vocab)
    sizes = {"hidden": hidden, "layers": layers, "verifier_params": params_of(verifier),
             # the embedding is the verifier's (vLLM shares it)
             "draft_params": params_of(draft) - draft.embed.weight.numel()}
    rows = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompt = torch.randint(4, vocab, (batch, context), generator=g)
        with torch.no_grad():
            cache = verifier(prompt, use_cache=True).past_key_values
        k_cache = torch.randn(batch, d.num_key_value_heads, context, d.head_dim, generator=g)
        v_cache = torch.randn_like(k_cache)
        tok = torch.randint(4, vocab, (batch, 1), generator=g)
        hid = torch.randn(batch, 1, hidden, generator=g)
        aux = torch.randn(batch, 1, 3 * hidden, generator=g)
        news = {n: torch.randint(4, vocab, (batch, n), generator=g)
                for n in sorted({1, *(k + 1 for k in ks)})}

        def cpu_seconds(fn):
            """fn's CPU time (this process): on one thread, the time spent waiting for a core
            while other work runs is not counted."""
            def run():
                t0 = time.process_time()
                with torch.no_grad():
                    for _ in range(inner):
                        fn()
                return time.process_time() - t0
            return run

        def verify(n, cache=cache, news=news):
            def once():
                verifier(news[n], past_key_values=cache, use_cache=True)
                cache.crop(-n)  # back to the prompt's cache
            return once

        fns = {f"verify_{n}": cpu_seconds(verify(n)) for n in news}
        fns.update(draft=cpu_seconds(lambda: draft(tok, hid, k_cache, v_cache)),
                   fc=cpu_seconds(lambda: draft.fc(aux)))
        times = interleave(fns, repeats=repeats, warmup=1, max_repeats=repeats)
        per = {name: min(ts) / inner for name, ts in times.items()}
        rows.append({**sizes, "batch": batch,
                     "t_verify": {str(n): rnd(per[f"verify_{n}"]) for n in news},
                     "t_draft": rnd(per["draft"]), "t_fc": rnd(per["fc"])})
        del cache
    return rows


# ---------------------------------------------------------------------------------------------
# the model


def acceptance(smoke: dict) -> tuple[dict[str, list[float]], str]:
    """Per-position acceptance of the draft (vllm layout) and of ngram from metrics/smoke.json:
    at the largest k the smoke stage measured (its k sweep, else the serving k)."""
    sweep = smoke.get("k_sweep") or {}
    if sweep:
        k = max(sweep, key=int)
        return ({"draft": sweep[k]["vllm"]["acceptance_rate_per_position"],
                 "ngram": sweep[k]["ngram"]["acceptance_rate_per_position"]},
                f"metrics/smoke.json k_sweep k={k}")
    return ({"draft": smoke["formats"]["vllm"]["acceptance_rate_per_position"],
             "ngram": smoke["ngram"]["acceptance_rate_per_position"]},
            f"metrics/smoke.json k={smoke['num_speculative_tokens']}")


def tau(rates: list[float], k: int) -> float:
    """E[tokens per step] at k: 1 + the acceptance of positions 1..k."""
    return 1.0 + sum(rates[:k])


def model(row: dict, rates: dict[str, list[float]]) -> dict:
    """Speedup over no speculation per k, draft and ngram, and each one's best k."""
    tv = {int(n): t for n, t in row["t_verify"].items()}
    ks = sorted(n - 1 for n in tv if n > 1 and n - 1 <= min(map(len, rates.values())))
    out: dict = {"draft": {}, "ngram": {}}
    for k in ks:
        step = row["t_fc"] + k * row["t_draft"] + tv[k + 1]
        out["draft"][str(k)] = rnd(tau(rates["draft"], k) * tv[1] / step)
        out["ngram"][str(k)] = rnd(tau(rates["ngram"], k) * tv[1] / tv[k + 1])
    for m in ("draft", "ngram"):
        best = max(out[m], key=lambda k: out[m][k])
        out[f"{m}_best"] = {"k": int(best), "speedup": out[m][best]}
    out["c"] = rnd(row["t_draft"] / tv[1])  # draft / verifier forward time
    return out


def crossover(rows: list[dict]) -> dict:
    """The smallest verifier (by parameters) at which the draft's best modelled speedup beats
    no speculation (> 1), ngram's best, and both; None where it never does in the grid. Rows
    of one batch size."""
    rows = sorted(rows, key=lambda r: r["verifier_params"])

    def first(pred):
        r = next((r for r in rows if pred(r)), None)
        return None if r is None else {"hidden": r["hidden"], "layers": r["layers"],
                                       "verifier_params": r["verifier_params"]}

    def best(r, m):
        return r["model"][f"{m}_best"]["speedup"]

    return {"beats_no_speculation": first(lambda r: best(r, "draft") > 1.0),
            "beats_ngram": first(lambda r: best(r, "draft") > best(r, "ngram")),
            "beats_both": first(lambda r: best(r, "draft") > max(1.0, best(r, "ngram")))}


# ---------------------------------------------------------------------------------------------
# outputs


def tsv(rows: list[dict]) -> str:
    """Wide TSV (x = verifier parameters in millions) for dvc plots: per batch size, the best
    modelled speedup of the draft and ngram, their k, and c = t_draft / t_verify."""
    batches = sorted({r["batch"] for r in rows})
    cols = [f"{q}_b{b}" for b in batches for q in ("draft_speedup", "draft_k", "ngram_speedup",
                                                    "ngram_k", "c")]
    lines = ["\t".join(["verifier_params_m", "hidden", "layers", *cols])]
    for size in sorted({(r["verifier_params"], r["hidden"], r["layers"]) for r in rows}):
        vals = []
        for b in batches:
            r = next((r for r in rows if r["batch"] == b and r["verifier_params"] == size[0]),
                     None)
            m = r["model"] if r else None
            vals += ["" if m is None else str(x) for x in (
                m and m["draft_best"]["speedup"], m and m["draft_best"]["k"],
                m and m["ngram_best"]["speedup"], m and m["ngram_best"]["k"], m and m["c"])]
        lines.append("\t".join([str(rnd(size[0] / 1e6, 3)), str(size[1]), str(size[2]), *vals]))
    return "\n".join(lines) + "\n"


def png(rows: list[dict], path: Path, measured: dict | None = None) -> bool:
    """Best modelled speedup against verifier parameters (log scale), draft and ngram, one
    line per batch size, with the no-speculation line at 1 and the smoke stage's measured
    speedups (measured_speedups: at the serving k, per batch size, at the size of the verifier
    it ran) as squares; drawn with Pillow. False when Pillow is missing."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return False
    batches = sorted({r["batch"] for r in rows})
    sizes = sorted({r["verifier_params"]: r for r in rows}.values(),
                   key=lambda r: r["verifier_params"])
    W, H, left, right, top, bottom = 640, 400, 70, 30, 40, 60
    img = Image.new("RGB", (W, H), "white")
    g = ImageDraw.Draw(img)
    try:
        font, big = ImageFont.load_default(size=13), ImageFont.load_default(size=15)
    except TypeError:
        font = big = ImageFont.load_default()
    xs = [math.log10(r["verifier_params"]) for r in sizes]
    x0, x1 = min(xs) - 0.1, max(xs) + 0.1
    ys = [r["model"][m]["speedup"] for r in rows for m in ("draft_best", "ngram_best")]
    got_by_batch = (measured or {}).get("batches", {})
    ys += [v for got in got_by_batch.values() for v in got.values()]
    at = next((x for r, x in zip(sizes, xs) if measured and
               (r["hidden"], r["layers"]) == (measured["hidden"], measured["layers"])), None)
    ymax = max(1.2, max(ys) * 1.45)  # room for the legend above the lines

    def px(v):
        return left + (v - x0) / (x1 - x0) * (W - left - right)

    def py(v):
        return H - bottom - v / ymax * (H - top - bottom)

    g.text((W / 2, 8), "modelled decode speedup over no speculation (best k)", fill="black",
           font=big, anchor="mt")
    g.line([(left, py(0)), (W - right, py(0))], fill="black")
    g.line([(left, py(0)), (left, py(ymax))], fill="black")
    for i in range(6):
        v = ymax * i / 5
        g.line([(left - 4, py(v)), (left, py(v))], fill="black")
        g.text((left - 6, py(v)), f"{v:.1f}", fill="black", font=font, anchor="rm")
    g.line([(left, py(1.0)), (W - right, py(1.0))], fill=(150, 150, 150))
    g.text((W - right, py(1.0) - 4), "no speculation", fill=(120, 120, 120), font=font,
           anchor="rb")
    for r, x in zip(sizes, xs):
        g.text((px(x), py(0) + 6), f"{r['verifier_params'] / 1e6:.3g}M", fill="black",
               font=font, anchor="mt")
        g.text((px(x), py(0) + 20), f"{r['hidden']}x{r['layers']}", fill=(90, 90, 90),
               font=font, anchor="mt")
    g.text((left + (W - left - right) / 2, H - 8),
           "verifier parameters (hidden x layers)", fill="black", font=font, anchor="mb")
    colors = {"draft_best": [(31, 119, 180), (140, 190, 230)],
              "ngram_best": [(214, 39, 40), (240, 150, 150)]}
    line = 0
    for m, name in (("draft_best", "EAGLE-3 draft"), ("ngram_best", "ngram")):
        for i, b in enumerate(sorted(batches, reverse=True)):  # the largest batch darkest
            c = colors[m][min(i, 1)]
            by = {r["verifier_params"]: r for r in rows if r["batch"] == b}
            pts = [(px(x), py(by[r["verifier_params"]]["model"][m]["speedup"]))
                   for r, x in zip(sizes, xs) if r["verifier_params"] in by]
            if len(pts) > 1:
                g.line(pts, fill=c, width=2)
            for x, y in pts:
                g.ellipse([x - 3, y - 3, x + 3, y + 3], fill=c)
            g.text((left + 10, top + 16 * line), f"{name}, batch {b} (model)", fill=c,
                   font=font, anchor="lt")
            line += 1
            got = got_by_batch.get(str(b), {}).get(m.split("_")[0])
            if got is not None and at is not None:
                x, y = px(at), py(got)
                g.rectangle([x - 4, y - 4, x + 4, y + 4], outline=c, width=2)
    if got_by_batch and at is not None:
        g.text((left + 10, top + 16 * line), "squares: measured in vLLM (smoke stage, serving k)",
               fill=(90, 90, 90), font=font, anchor="lt")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    img.save(tmp, format="PNG")
    tmp.replace(path)
    return True


def table(res: dict) -> str:
    lines = ["verifier (hidden x layers, params)  batch  c=t_d/t_v  draft best (k)  ngram best (k)"]
    for r in sorted(res["rows"], key=lambda r: (r["batch"], r["verifier_params"])):
        m = r["model"]
        lines.append(f"{r['hidden']:5d} x {r['layers']:2d}  {r['verifier_params'] / 1e6:8.1f}M"
                     f"  {r['batch']:10d}  {m['c']:9.3f}  {m['draft_best']['speedup']:8.3f} "
                     f"({m['draft_best']['k']})  {m['ngram_best']['speedup']:8.3f} "
                     f"({m['ngram_best']['k']})")
    for b, c in sorted(res["crossover"].items(), key=lambda kv: int(kv[0])):
        for key, what in (("beats_no_speculation", "no speculation"), ("beats_ngram", "ngram"),
                          ("beats_both", "both")):
            x = c[key]
            lines.append(f"batch {b}: smallest verifier where the draft beats {what}: " + (
                f"{x['hidden']} x {x['layers']} ({x['verifier_params'] / 1e6:.3g}M)"
                if x else "not in this grid"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def run(grid, *, smoke: dict, draft_params, vocab: int, batches: list[int], context: int,
        repeats: int, inner: int, threads: int = THREADS_TIMED) -> dict:
    from common import set_threads

    set_threads(threads)
    rates, source = acceptance(smoke)
    ks = list(range(1, min(map(len, rates.values())) + 1))
    meter, t0 = cpu_meter(), time.perf_counter()
    rows = []
    for hidden, layers in grid:
        log(f"speedup: verifier hidden {hidden}, {layers} layers, batch {batches}")
        for row in time_size(hidden, layers, vocab=vocab, draft_params=draft_params,
                             batches=batches, context=context, ks=ks, repeats=repeats,
                             inner=inner):
            row["model"] = model(row, rates)
            rows.append(row)
    share = meter.other_share()
    return {"rows": rows, "acceptance": rates,
            "crossover": {str(b): crossover([r for r in rows if r["batch"] == b])
                          for b in batches},
            "acceptance_source": source, "batches": list(batches), "context": context,
            "repeats": repeats, "inner": inner, "vocab": vocab, "family": FAMILY,
            "threads": threads, "timer": "process CPU time, best of the interleaved repeats",
            "seconds": rnd(time.perf_counter() - t0),
            "other_processes_cpu_share": None if share is None else round(share, 3)}


def measured_speedups(timing_path: Path, verifier_metrics: Path) -> dict | None:
    """The smoke stage's measured median speedups at the serving k (metrics/smoke_timing.json)
    by batch size (its smoke batch and, when measured, batch 1), the verifier they were
    measured on (metrics/verifier.json: hidden size, layers) and the busy warning (None on a
    quiet run)."""
    try:
        t = json.loads(timing_path.read_text())
        v = json.loads(verifier_metrics.read_text())
        batches = {str(t["batch_size"]): {"draft": t["speedup"]["vllm"],
                                          "ngram": t["speedup"]["ngram"]}}
        if "batch_1" in t:
            batches["1"] = {"draft": t["batch_1"]["speedup"]["vllm"],
                            "ngram": t["batch_1"]["speedup"]["ngram"]}
        return {"batches": batches, "k": t["num_speculative_tokens"],
                "hidden": v["hidden_size"], "layers": v["num_hidden_layers"],
                "busy_warning": t.get("machine", {}).get("busy_warning")}
    except (OSError, KeyError, ValueError):
        return None


def modelled_vs_measured(rows: list[dict], measured: dict | None) -> list[dict]:
    """For each row of the grid at the measured verifier's size and a batch size the smoke
    stage measured: the model's speedup at the serving k beside the measured one, and their
    ratio (measured / modelled) for the draft and for ngram."""
    if not measured:
        return []
    out = []
    k = str(measured["k"])
    for r in rows:
        got = measured["batches"].get(str(r["batch"]))
        if (r["hidden"], r["layers"]) != (measured["hidden"], measured["layers"]) or not got:
            continue
        entry: dict = {"hidden": r["hidden"], "layers": r["layers"], "batch": r["batch"],
                       "k": measured["k"]}
        for m in ("draft", "ngram"):
            mod = r["model"][m].get(k)
            entry[m] = {"modelled": mod, "measured": got[m],
                        "measured_over_modelled": rnd(got[m] / mod) if mod else None}
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two tiny sizes (seconds)")
    ap.add_argument("--smoke", type=Path, default=ROOT / "metrics/smoke.json",
                    help="the acceptance measured in vLLM")
    ap.add_argument("--timing", type=Path, default=ROOT / "metrics/smoke_timing.json",
                    help="the smoke stage's measured speedups, shown beside the model")
    ap.add_argument("--verifier-metrics", type=Path, default=ROOT / "metrics/verifier.json",
                    help="the size of the verifier the smoke stage measured")
    ap.add_argument("--out", type=Path, default=None,
                    help="where speedup.{json,tsv,png} go (default bench/; --quick: nowhere)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    from eagle3pipe.config import params as P

    p = P.load(ROOT / "params.yaml")
    smoke = json.loads(args.smoke.read_text())
    vocab = p.verifier.embedded.tokenizer_vocab_size if p.verifier.embedded else 4096
    grid = QUICK_GRID if args.quick else GRID
    # one sequence (latency) and the smoke stage's batch (its measured speedups)
    batches = sorted({1, smoke["num_prompts"]}) if not args.quick else [2]
    res = run(grid, smoke=smoke, draft_params=p.draft, vocab=vocab, batches=batches,
              context=192 if not args.quick else 32,
              repeats=args.repeats if not args.quick else 2, inner=3 if not args.quick else 1)
    res.update(date=now_iso(), quick=args.quick, **machine(),
               command=" ".join(["python", "bench/speedup.py",
                                 *(argv if argv is not None else sys.argv[1:])]))
    res["measured_in_vllm"] = measured_speedups(args.timing, args.verifier_metrics)
    res["modelled_vs_measured"] = modelled_vs_measured(res["rows"], res["measured_in_vllm"])
    print(table(res))
    for e in res["modelled_vs_measured"]:
        print(f"{e['hidden']} x {e['layers']}, batch {e['batch']}, k {e['k']}: " + ", ".join(
            f"{m} modelled {e[m]['modelled']} measured {e[m]['measured']} "
            f"(ratio {e[m]['measured_over_modelled']})" for m in ("draft", "ngram")))
    out = args.out or (None if args.quick else ROOT / "bench")
    if out is not None:
        write(res, out)
        print(f"\nwrote {out}/speedup.{{json,tsv,png}}")
    return 0


def write(res: dict, out: Path) -> None:
    from eagle3pipe.runtime.jsonio import dumps
    from eagle3pipe.runtime.atomic import write_text_atomic

    write_text_atomic(out / "speedup.json", dumps(res))
    write_text_atomic(out / "speedup.tsv", tsv(res["rows"]))
    measured = res.get("measured_in_vllm") or {}
    shown = None if measured.get("busy_warning") else measured  # a busy run's say little
    if not png(res["rows"], out / "speedup.png", shown or None):
        log("Pillow is not importable: no png (the tsv has the numbers)")
    for suffix in ("json", "tsv", "png"):
        if (out / f"speedup.{suffix}").exists():
            (out / f"speedup.{suffix}").chmod(0o644)


if __name__ == "__main__":
    sys.exit(main())
