"""Each stage's estimate: what it will run, hold and write, from the figures
(eagle3pipe.estimates.figures). `ESTIMATES` maps a stage to its estimate, in the pipeline's
order; configs and vocab write a few small files and have none. The stage runner logs a stage's
estimate and refuses an output that cannot fit (eagle3pipe.estimates.check); `eagle3pipe plan`
tabulates them all."""
from __future__ import annotations

from eagle3pipe.config.schema import Params
from eagle3pipe.draft import arch as A
from eagle3pipe.estimates.figures import (
    ADAMW_BYTES_PER_PARAM,
    HS_TOKEN_IDS_BYTES,
    TOKEN_ROW_BYTES,
    Estimate,
    Estimator,
    Figures,
    engine_estimate,
    oracle_flop,
)
from eagle3pipe.estimates.size import config_param_estimate
from eagle3pipe.runtime.units import human


def verifier(params: Params, f: Figures) -> Estimate:
    """The embedded verifier's training, or a path verifier's fingerprint (a manifest only)."""
    e = params.verifier.embedded
    if params.verifier.path is not None or e is None:
        return Estimate("verifier", f"none (fingerprint: {params.verifier.hash_mode})", 1,
                        notes=[f"fingerprints {params.verifier.path}; writes a manifest only"])
    # the size the params ask for: the config on disk may be a previous build's
    n, _ = config_param_estimate({
        "hidden_size": e.hidden_size, "num_hidden_layers": e.num_hidden_layers,
        "vocab_size": e.tokenizer_vocab_size, "intermediate_size": e.intermediate_size,
        "num_attention_heads": e.num_attention_heads,
        "num_key_value_heads": e.num_key_value_heads, "head_dim": e.head_dim,
        "tie_word_embeddings": False})
    return Estimate(
        "verifier", f"torch CPU x{e.threads} threads (embedded)", 1,
        tokens=e.train_steps * e.batch_size * e.seq_len, disk_bytes=n * 4,  # float32 weights
        host_bytes=n * ADAMW_BYTES_PER_PARAM, sized_by="verifier.embedded",
        notes=[f"trains {n:,} parameters for {e.train_steps} steps of "
               f"{e.batch_size} x {e.seq_len} tokens"])


def dataset(params: Params, f: Figures) -> Estimate:
    """The verifier in vLLM regenerating every reply; ~TOKEN_ROW_BYTES of disk per token."""
    d = params.dataset
    e = engine_estimate("dataset", params.vllm, f, f.tokens, f.tokens * TOKEN_ROW_BYTES,
                        sized_by="dataset.num_samples")
    e.notes.append(f"tokens <= {d.num_samples:,} samples x ({d.max_prompt_tokens} + "
                   f"{d.max_new_tokens}); disk ~{TOKEN_ROW_BYTES} B/token")
    return e


def extract(params: Params, f: Figures) -> Estimate:
    """The verifier in vLLM capturing every token's states: the largest output of the run."""
    hidden = f.tokens * f.hidden_per_token
    rows = f.tokens * (HS_TOKEN_IDS_BYTES + TOKEN_ROW_BYTES)
    e = engine_estimate("extract", params.vllm, f, f.tokens, hidden + rows,
                        sized_by="dataset.num_samples")
    e.notes.append(f"hidden states {f.hidden_per_token:,} B/token x {f.tokens:,} tokens = "
                   f"{human(hidden)}, + {human(rows)} of token ids and rows")
    n = params.extract.oracle_samples
    if n:
        d = params.dataset
        need = f.oracle_embedding_bytes + f.oracle_layer_bytes
        e.notes.append(
            f"oracle (extract.oracle_samples {n}): {human(need)} of host memory, one decoder "
            f"layer at a time in float32 (the embedding {human(f.oracle_embedding_bytes)} + "
            f"the largest layer {human(f.oracle_layer_bytes)}, from the {f.oracle_from}), "
            "skipped above $EAGLE3PIPE_ORACLE_MEMORY (unset: half the free host memory); its "
            f"work: the verifier's {f.num_layers} layers read once, {n} samples x <= "
            f"{d.max_prompt_tokens + d.max_new_tokens} tokens x 2 x "
            f"{f.oracle_active_params:,} parameters each token passes through = "
            f"{oracle_flop(params, f):.2g} FLOP in float32")
    return e


def train(params: Params, f: Figures) -> Estimate:
    """Per process: the draft's weights, grads and AdamW state, plus activations. On disk: the
    checkpoint (float32 weights and AdamW's two moments), twice while the next one is written
    beside it (eagle3pipe.stages.train.checkpoint), and the output."""
    t = params.train
    checkpoint = f.draft_params * 3 * 4
    act = t.batch_tokens * t.ttt_steps * f.activation_floats * 4
    per_process = f.draft_params * ADAMW_BYTES_PER_PARAM + act
    train_tokens = int(f.tokens * (1 - params.dataset.eval_fraction)) * t.epochs
    on_gpu = t.device == "cuda"
    return Estimate(
        "train", f"torchrun x{t.nproc_per_node} ({t.device})", t.nproc_per_node, train_tokens,
        f.train_bytes + 2 * checkpoint, per_process if on_gpu else None,
        None if on_gpu else per_process * t.nproc_per_node,
        [f"estimate: {f.draft_params:,} params x {ADAMW_BYTES_PER_PARAM} B (weights, grads, "
         f"AdamW) + activations {t.batch_tokens} tokens x {t.ttt_steps} TTT steps x "
         f"{f.activation_floats:,} floats x 4 B = {human(act)}",
         f"disk: the output and up to 2 checkpoints of {human(checkpoint)} (weights and AdamW "
         "moments, float32) in .eagle3pipe/checkpoints"],
        sized_by="draft (its size) and train.epochs")


def export(params: Params, f: Figures) -> Estimate:
    """One file per exported layout, each the draft in draft.dtype."""
    n = len(A.LAYOUTS)
    return Estimate("export", "none (torch CPU)", 1, None, n * f.draft_bytes, None,
                    f.train_bytes + f.draft_bytes,
                    [f"{n} layouts x {human(f.draft_bytes)} in {params.draft.dtype}"],
                    sized_by="draft (its size)")


def smoke(params: Params, f: Figures) -> Estimate:
    """Every engine (no speculation, one per exported layout, ngram) one after another."""
    s, v = params.smoke, params.vllm
    engines = 2 + len(A.LAYOUTS)
    e = engine_estimate("smoke", v, f, s.num_prompts * s.max_tokens * engines, None,
                        extra=f.draft_bytes // v.tensor_parallel_size)
    e.notes.append(f"{engines} engines one after another, {s.num_prompts} prompts x "
                   f"{s.max_tokens} tokens each")
    return e


ESTIMATES: dict[str, Estimator] = {"verifier": verifier, "dataset": dataset, "extract": extract,
                                   "train": train, "export": export, "smoke": smoke}
