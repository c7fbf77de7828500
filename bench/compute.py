"""In-process benchmarks: extraction and draft training, each timed side by side with the bare
library call doing the same work on the same inputs."""
from __future__ import annotations

import collections
import dataclasses
import functools
import shutil
import time
import types
from pathlib import Path

import torch

from eagle3pipe.hidden.spec import torch_dtype as stored_dtype
from common import (ROOT, interleave, log, random_verifier, rnd, speed_ratio, speed_ratio_median,
                    synthetic_samples, timing_summary)


# ---------------------------------------------------------------------------------------------
# Extraction


def _batches(samples, batch_size: int, pad_id: int):
    """The padded batches the transformers extractor runs (eagle3pipe.hidden.oracle.padded_batches)."""
    from eagle3pipe.hidden.oracle import padded_batches

    return [(ids, mask) for _, _, ids, mask in padded_batches(samples, batch_size, pad_id)]


def tf_states(model, samples, aux_ids, batch_size: int, pad_id: int = 0):
    """(index, hidden states) of every sample from the transformers extractor (the stage's
    oracle; the stage itself captures with vLLM), for extract.write_split."""
    from eagle3pipe.hidden.oracle import padded_batches, tf_capture

    for batch, lens, ids, mask in padded_batches(samples, batch_size, pad_id):
        states = tf_capture(model, ids, mask, aux_ids)
        for r, (i, n) in enumerate(zip(batch, lens)):
            yield i, states[r, :n]


def write_split(model, samples, aux_ids, out: Path, dtype, batch_size: int, pad_id: int = 0):
    """The stage's writer (extract.write_split) fed by the transformers extractor."""
    from safetensors.torch import save_file

    from eagle3pipe.stages.extract import run as X
    from eagle3pipe.data import store

    st, entries = store.Store("hidden", out.parent / f".{out.name}-store"), {}
    for i, h in tf_states(model, samples, aux_ids, batch_size, pad_id):
        ids = torch.tensor(samples[i].input_ids, dtype=torch.long)
        entries[i] = st.put(store.key(bench=str(out), i=i), lambda p: save_file(
            {"token_ids": ids, "hidden_states": h.to(dtype).contiguous()}, str(p)))
    X.write_split(out, samples, [entries[i] for i in range(len(samples))])


def bench_extract(model, samples, aux_ids: list[int], work: Path, *, batch_size: int = 8,
                  dtype: str = "bfloat16", repeats: int = 3, with_stage: bool = True,
                  with_lm_head: bool = True) -> dict:
    """tokens/s of the extract stage's code path vs a bare transformers forward of the same
    verifier over the same padded batches:
      forward  bare decoder forward, `model.model(input_ids, attention_mask)`, no hooks: the
               floor (the least any extractor must compute; the lm_head is not needed)
      forward_lm_head  the plain `model(...)` CausalLM forward (decoder + lm_head), for context
      capture  eagle3pipe.hidden.oracle.tf_capture on the same batches (hooks + stacking the slots)
      split    eagle3pipe.stages.extract.run.write_split fed by that capture: batching, casting, one
               safetensors file per sample and the datasets table (what the stage writes)
      stage    split + validate_split (the stage reads every file back before publishing)"""
    from eagle3pipe.stages.extract import run as X
    from eagle3pipe.hidden import checks as extract_checks
    torch_dtype = stored_dtype(dtype)
    from eagle3pipe.hidden.oracle import tf_capture, tf_decoder

    base, _, _ = tf_decoder(model)
    cfg = model.config
    pad_id = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else 0
    batches = _batches(samples, batch_size, pad_id)
    tokens = sum(len(s.input_ids) for s in samples)
    H = cfg.hidden_size
    num_slots = len(aux_ids) + 1
    work.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def forward():
        for ids, mask in batches:
            base(input_ids=ids, attention_mask=mask, use_cache=False)

    @torch.no_grad()
    def forward_lm_head():
        for ids, mask in batches:
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    def capture():
        for ids, mask in batches:
            tf_capture(model, ids, mask, aux_ids)

    def split(validate: bool = False):
        out = work / ("stage" if validate else "split")
        shutil.rmtree(out, ignore_errors=True)  # not timed
        t0 = time.perf_counter()
        write_split(model, samples, aux_ids, out, torch_dtype, batch_size, pad_id=pad_id)
        if validate:
            extract_checks.validate_split(out, samples, num_slots, H, torch_dtype)
        return time.perf_counter() - t0

    fns = {"forward": forward, "capture": capture, "split": split}
    if with_lm_head:
        fns["forward_lm_head"] = forward_lm_head
    if with_stage:
        fns["stage"] = lambda: split(validate=True)
    times = interleave(fns, repeats)
    split_dir = work / "split"
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    min_bpt = num_slots * H * elem
    res = {
        "tokens": tokens, "samples": len(samples), "batch_size": batch_size, "dtype": dtype,
        "hidden_size": H, "num_slots": num_slots, "rounds": len(times["forward"]),
        "tokens_per_s": {k: round(tokens / min(v), 1) for k, v in times.items()},
        "timings": {k: timing_summary(v) for k, v in times.items()},
        "capture_vs_forward": rnd(speed_ratio(times["capture"], times["forward"])),
        "split_vs_forward": rnd(speed_ratio(times["split"], times["forward"])),
        "split_vs_forward_median": rnd(speed_ratio_median(times["split"], times["forward"])),
        "bytes_per_token": rnd(X.tree_bytes(split_dir) / tokens, 6),
        "hidden_bytes_per_token": rnd(X.tree_bytes(split_dir / "hidden_states") / tokens, 6),
        "min_bytes_per_token": min_bpt,
    }
    res["bytes_per_token_vs_min"] = rnd(res["bytes_per_token"] / min_bpt, 5)
    if with_stage:
        res["stage_vs_forward"] = rnd(speed_ratio(times["stage"], times["forward"]))
    if with_lm_head:
        res["forward_lm_head_vs_forward"] = rnd(speed_ratio(times["forward_lm_head"],
                                                            times["forward"]))
    return res


def write_datapath(model, samples, aux_ids, out: Path, dtype: str = "bfloat16") -> Path:
    """A real speculators datapath (what the extract stage writes) for the training bench."""
    shutil.rmtree(out, ignore_errors=True)
    write_split(model, samples, aux_ids, out, stored_dtype(dtype), 8)
    return out


# ---------------------------------------------------------------------------------------------
# Training


def train_states(verifier_dir: Path, datapath: Path, samples, draft_params, names, *,
                 batch_tokens: int, ttt_steps: int, lr: float):
    """(arch, the datapath's Batches, {name: TrainState}) for the training bench: the draft
    derived from draft_params, the vocab mapping from the samples' loss-masked tokens, and one
    train.build_state per name (the same seeded init each, in train mode as fit() runs step()),
    over one epoch of the stage's seeded packing with a 2-step warm-up; micro-batches of the
    default params' train.cpu_chunk_tokens, as the default run's train stage."""
    from eagle3pipe.config import params
    from eagle3pipe.draft import arch as archmod
    from eagle3pipe.runtime import distributed
    from eagle3pipe.stages.train import run as T
    from eagle3pipe.stages.vocab import run as V
    from eagle3pipe.verifier.handle import VerifierInfo

    info = VerifierInfo.from_config(verifier_dir)
    arch = dataclasses.replace(archmod.derive(draft_params, info), dtype="float32")
    counts = collections.Counter(t for s in samples for t, m in zip(s.input_ids, s.loss_mask)
                                 if m)
    d2t, t2d = V.build_mapping(dict(counts), arch.draft_vocab_size, arch.vocab_size)
    chunk = params.load(ROOT / "params.yaml").train.cpu_chunk_tokens
    backend = distributed.backend_for("cpu", chunk, "eager")
    data = T.open_split(datapath, batch_tokens, arch, backend)
    p = types.SimpleNamespace(seed=0, nproc_per_node=1, epochs=1, batch_tokens=batch_tokens,
                              learning_rate=lr, weight_decay=0.0, warmup_steps=2,
                              ttt_steps=ttt_steps, ttt_step_loss_decay=1.0, grad_clip=1.0,
                              loss="kl_div", init_from=None)
    states = {}
    for name in names:
        states[name] = T.build_state(p, arch, verifier_dir, d2t, t2d, data, data,
                                     d=distributed.Dist(), backend=backend)
        states[name].model.train()
    return arch, data, states


def train_variants(states: dict, data, packs: list[list[int]]) -> dict:
    """{name: a function running every pack once} for the states' names (see bench_train)."""
    from eagle3pipe.stages.train import model as train_model
    from eagle3pipe.stages.train import run as T
    def bare_forward_backward(st, chunk, weight):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, _ = st.model(**chunk, ttt_steps=st.p.ttt_steps,
                                  ttt_step_loss_decay=st.p.ttt_step_loss_decay,
                                  loss_config=st.loss_config)
        (loss * weight).backward()

    def loop(st):
        torch.use_deterministic_algorithms(True)
        try:
            for idx in packs:
                T.step(st, idx)
        finally:
            torch.use_deterministic_algorithms(False)

    def speculators_step(st):
        for idx in packs:
            batch = data.collate([data.ds[i] for i in idx])
            st.opt.zero_grad()
            bare_forward_backward(st, batch, 1.0)
            st.opt.step()

    def bare_same_chunks(st):
        for idx in packs:
            chunks = data.micro(idx)
            st.opt.zero_grad()
            for chunk, w in zip(chunks, train_model.token_weights(chunks)):
                bare_forward_backward(st, chunk, w)
            st.opt.step()

    run = {"loop": loop, "speculators_step": speculators_step,
           "bare_same_chunks": bare_same_chunks}
    return {name: functools.partial(run[name], st) for name, st in states.items()}


def bench_train(verifier_dir: Path, datapath: Path, samples, draft_params, *, batch_tokens: int,
                ttt_steps: int = 3, n_packs: int = 4, repeats: int = 3, lr: float = 1e-3,
                variants: tuple[str, ...] = ("loop", "speculators_step", "bare_same_chunks")
                ) -> dict:
    """tokens/s of the train stage's step vs a bare speculators step on the same packed batches
    (the same samples, read through the same ArrowDataset + CollateFn):
      loop              eagle3pipe.stages.train.run.step itself, on a TrainState from train.build_state:
                        Batches.micro (collate into <= train.cpu_chunk_tokens micro-batches on CPU),
                        run_batch (bf16 autocast forward, token-weighted backward, accuracy
                        counts), clip_grad_norm_, AdamW step, LR schedule, with
                        torch.use_deterministic_algorithms(True) as train.setup sets on CPU
      speculators_step  what speculators' Trainer does per step, minus its clipping/scheduler:
                        collate the pack (padded to batch_tokens), one Eagle3DraftModel forward
                        under bf16 autocast, backward, AdamW step; no determinism flag
      bare_same_chunks  the bare forward/backward/step on exactly the loop's micro-batches: the
                        loop's own overhead (metrics, clipping, schedule, determinism)
    Every variant's model and AdamW come from train.build_state with the same seed."""
    arch, data, states = train_states(verifier_dir, datapath, samples, draft_params, variants,
                                      batch_tokens=batch_tokens, ttt_steps=ttt_steps, lr=lr)
    packs = next(iter(states.values())).per_epoch[0][:n_packs]
    tokens = sum(min(batch_tokens, sum(data.lengths[i] for i in idx)) for idx in packs)
    times = interleave(train_variants(states, data, packs), repeats)
    res = {"tokens": tokens, "packs": len(packs), "batch_tokens": batch_tokens,
           "ttt_steps": ttt_steps, "chunk_tokens": data.backend.chunk_tokens,
           "rounds": len(next(iter(times.values()))),
           "hidden_size": arch.hidden_size, "draft_head_dim": arch.head_dim,
           "draft_vocab_size": arch.draft_vocab_size,
           "tokens_per_s": {k: round(tokens / min(v), 1) for k, v in times.items()},
           "timings": {k: timing_summary(v) for k, v in times.items()}}
    if "loop" in times and "speculators_step" in times:
        res["loop_vs_speculators_step"] = rnd(speed_ratio(times["loop"],
                                                          times["speculators_step"]))
        res["loop_vs_speculators_step_median"] = rnd(speed_ratio_median(
            times["loop"], times["speculators_step"]))
    if "loop" in times and "bare_same_chunks" in times:
        res["loop_vs_bare_same_chunks"] = rnd(speed_ratio(times["loop"],
                                                          times["bare_same_chunks"]))
    return res


# ---------------------------------------------------------------------------------------------
# Scaling


def scaling_draft(draft_params, hidden: int, vocab: int):
    """The draft for a scaling point: params' heads, and the default's proportions otherwise
    (head_dim = hidden / 2, MLP = 2.6875 x hidden: 64 / 344 at the default's hidden 128)."""
    return dataclasses.replace(draft_params, head_dim=max(2, hidden // 2),
                               intermediate_size=8 * round(hidden * 2.6875 / 8),
                               draft_vocab_size=min(1024, vocab // 4), hidden_size=None)


def bench_scaling(work: Path, draft_params, *, hiddens, seq_lens, vocab: int, tokens: int,
                  batch_tokens: int, n_packs: int, repeats: int) -> list[dict]:
    """Extraction and draft-training throughput of random-init verifiers of the embedded family
    at each (hidden size, sequence length): samples of length in [3/4 L, L], `tokens` tokens per
    extraction point, `n_packs` packs of `batch_tokens` per training point."""
    from eagle3pipe.hidden.oracle import tf_load
    from eagle3pipe.verifier.handle import Verifier

    rows = []
    for H in hiddens:
        vdir = random_verifier(work / f"verifier_h{H}", hidden=H, vocab=vocab)
        model = tf_load(Verifier(vdir))
        aux = [1, 2, 3]
        for L in seq_lens:
            log(f"scaling: hidden {H}, seq_len {L}")
            n = max(8, tokens // L)
            samples = synthetic_samples(n, max(8, 3 * L // 4), L, vocab, seed=H + L)
            ex = bench_extract(model, samples, aux, work / f"x_h{H}_L{L}", repeats=repeats,
                               with_stage=False, with_lm_head=False)
            dp = write_datapath(model, samples, aux, work / f"dp_h{H}_L{L}")
            bt = max(batch_tokens, L)
            need = n_packs * bt // L + 1  # enough samples for n_packs full packs
            if len(samples) < need:
                samples = synthetic_samples(need, max(8, 3 * L // 4), L, vocab, seed=H + L)
                dp = write_datapath(model, samples, aux, work / f"dp_h{H}_L{L}")
            tr = bench_train(vdir, dp, samples, scaling_draft(draft_params, H, vocab),
                             batch_tokens=bt, n_packs=n_packs, repeats=repeats,
                             variants=("loop", "speculators_step"))
            rows.append({
                "hidden_size": H, "seq_len": L,
                "extract_tokens_per_s": ex["tokens_per_s"]["split"],
                "forward_tokens_per_s": ex["tokens_per_s"]["forward"],
                "extract_vs_forward": ex["split_vs_forward"],
                "bytes_per_token_vs_min": ex["bytes_per_token_vs_min"],
                "train_tokens_per_s": tr["tokens_per_s"]["loop"],
                "speculators_step_tokens_per_s": tr["tokens_per_s"]["speculators_step"],
                "train_vs_speculators_step": tr["loop_vs_speculators_step"],
                "train_batch_tokens": bt, "extract_tokens": ex["tokens"],
                "train_tokens": tr["tokens"],
            })
            shutil.rmtree(work / f"x_h{H}_L{L}", ignore_errors=True)
            shutil.rmtree(work / f"dp_h{H}_L{L}", ignore_errors=True)
        del model
    return rows


def scaling_tsv(rows: list[dict]) -> str:
    """Wide TSV for `dvc plots` (x: hidden_size, one column per quantity and sequence length)."""
    seqs = sorted({r["seq_len"] for r in rows})
    hiddens = sorted({r["hidden_size"] for r in rows})
    cols = [f"{q}_seq{L}" for q in ("extract_tokens_per_s", "train_tokens_per_s") for L in seqs]
    lines = ["\t".join(["hidden_size"] + cols)]
    for H in hiddens:
        vals = []
        for c in cols:
            q, L = c.rsplit("_seq", 1)
            r = next((r for r in rows if r["hidden_size"] == H and r["seq_len"] == int(L)), None)
            vals.append("" if r is None else f"{r[q]:g}")
        lines.append("\t".join([str(H)] + vals))
    return "\n".join(lines) + "\n"


def scaling_png(rows: list[dict], path: Path) -> bool:
    """tokens/s against verifier hidden size, one line per sequence length, one panel for
    extraction and one for training, drawn with Pillow (pinned in requirements.lock; there is
    no matplotlib). Returns False when Pillow is missing."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return False
    seqs = sorted({r["seq_len"] for r in rows})
    hiddens = sorted({r["hidden_size"] for r in rows})
    colors = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
    W, H, left, right, top, bottom = 480, 340, 70, 20, 40, 50
    img = Image.new("RGB", (2 * W, H), "white")
    g = ImageDraw.Draw(img)
    try:
        font, big = ImageFont.load_default(size=13), ImageFont.load_default(size=15)
    except TypeError:  # Pillow without FreeType sizes
        font = big = ImageFont.load_default()
    for panel, (key, title) in enumerate((("extract_tokens_per_s", "extraction tokens/s"),
                                          ("train_tokens_per_s", "draft training tokens/s"))):
        x0 = panel * W
        ymax = max(r[key] for r in rows) * 1.1 or 1.0

        def px(h):
            i = hiddens.index(h)
            return x0 + left + (i / max(1, len(hiddens) - 1)) * (W - left - right)

        def py(v):
            return H - bottom - (v / ymax) * (H - top - bottom)
        g.text((x0 + W / 2, 8), title, fill="black", font=big, anchor="mt")
        g.line([(x0 + left, py(0)), (x0 + W - right, py(0))], fill="black")
        g.line([(x0 + left, py(0)), (x0 + left, py(ymax))], fill="black")
        for k in range(5):
            v = ymax * k / 4
            g.line([(x0 + left - 4, py(v)), (x0 + left, py(v))], fill="black")
            g.text((x0 + left - 6, py(v)), f"{v:,.0f}", fill="black", font=font, anchor="rm")
        for h in hiddens:
            g.text((px(h), py(0) + 6), str(h), fill="black", font=font, anchor="mt")
        g.text((x0 + left + (W - left - right) / 2, H - 8), "verifier hidden size",
               fill="black", font=font, anchor="mb")
        for j, L in enumerate(seqs):
            c = colors[j % len(colors)]
            pts = [(px(r["hidden_size"]), py(r[key])) for r in
                   sorted(rows, key=lambda r: r["hidden_size"]) if r["seq_len"] == L]
            if len(pts) > 1:
                g.line(pts, fill=c, width=2)
            for x, y in pts:
                g.ellipse([x - 3, y - 3, x + 3, y + 3], fill=c)
            g.text((x0 + W - right, top + 16 * j), f"seq_len {L}", fill=c, font=font,
                   anchor="rt")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    img.save(tmp, format="PNG")
    tmp.replace(path)
    return True
