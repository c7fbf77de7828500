"""The schema of params.yaml: one frozen dataclass per section. A field with no default is
required; every field that consumers (speculators, vLLM, transformers) default differently has
no default here. eagle3pipe.config.params loads and validates a file against it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def spec(help: str, *, min: float | None = None, choices: tuple | None = None,
         even: bool = False, length: int | None = None, positive_items: bool = False,
         mapping: str | None = None, default: Any = dataclasses.MISSING) -> Any:
    """A key's help and constraints; `mapping` names what a mapping-valued key holds
    ("rope_scaling" or "template_kwargs": eagle3pipe.config.params.MAPPING_CHECKS)."""
    meta = dict(help=help, min=min, choices=choices, even=even, length=length,
                positive_items=positive_items, mapping=mapping)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EmbeddedVerifierParams:
    tokenizer_vocab_size: int = spec("byte-level BPE vocabulary size", min=300)
    hidden_size: int = spec("verifier hidden size", min=8)
    num_hidden_layers: int = spec("verifier decoder layers", min=1)
    num_attention_heads: int = spec("verifier attention heads", min=1)
    num_key_value_heads: int = spec("verifier KV heads", min=1)
    head_dim: int = spec("verifier head dim (explicit in its config.json)", min=2, even=True)
    intermediate_size: int = spec("verifier MLP width", min=1)
    max_position_embeddings: int = spec("verifier max positions", min=16)
    rope_theta: float = spec("verifier rope base", min=1.0)
    rms_norm_eps: float = spec("verifier RMSNorm epsilon", min=0.0)
    train_steps: int = spec("optimizer steps of verifier pre-training", min=0)
    batch_size: int = spec("sequences per verifier training step", min=1)
    seq_len: int = spec("tokens per verifier training sequence", min=8)
    learning_rate: float = spec("AdamW peak learning rate", min=0.0)
    adam_betas: list[float] = spec("AdamW (beta1, beta2), each in [0, 1)", length=2)
    weight_decay: float = spec("AdamW weight decay", min=0.0)
    warmup_steps: int = spec("linear warm-up steps before the cosine decay", min=0)
    min_lr_ratio: float = spec("the cosine decay's floor, as a share of learning_rate", min=0.0)
    seed: int = spec("seed of tokenizer/verifier training", min=0)
    threads: int = spec("torch CPU threads", min=1)


@dataclass(frozen=True)
class VerifierParams:
    path: str | None = spec("HF checkpoint directory of the verifier; null = embedded default")
    hash_mode: str = spec("how the verifier is fingerprinted", choices=("headers", "full"))
    embedded: EmbeddedVerifierParams | None = spec(
        "sizes of the embedded default verifier (required when path is null)")


@dataclass(frozen=True)
class DraftParams:
    num_attention_heads: int = spec("draft attention heads", min=1)
    num_key_value_heads: int = spec("draft KV heads", min=1)
    head_dim: int = spec("draft head dim; never derived from hidden/heads", min=2, even=True)
    intermediate_size: int = spec("draft MLP width", min=1)
    aux_layer_ids: list[int] = spec("verifier layers whose input residual feeds the draft",
                                    length=3)
    draft_vocab_size: int = spec("draft (lm_head) vocabulary size", min=1)
    norm_before_residual: bool = spec("apply hidden_norm before taking the residual")
    norm_before_fc: bool = spec("one RMSNorm over the 3 concatenated aux states before fc "
                                "(EAGLE-3.1; exclusive with fc_norm)")
    fc_norm: bool = spec("one RMSNorm per aux state before fc (the EAGLE-3.1 paper's form; "
                         "exclusive with norm_before_fc)")
    norm_output: bool = spec("feed the post-norm hidden state to the next speculative step "
                             "(EAGLE-3.1), not the pre-norm residual sum")
    draft_arch: str = spec("the draft's decoder layer (speculators' --draft-arch; vLLM's "
                           "llama_eagle3.py / qwen3_eagle3.py)", choices=("llama", "qwen3"))
    rope_theta: float = spec("draft rope base (published drafts differ from their verifier)",
                             min=1.0)
    rope_scaling: dict | None = spec("rope scaling dict, or null", mapping="rope_scaling")
    rms_norm_eps: float = spec("draft RMSNorm epsilon", min=0.0)
    max_position_embeddings: int = spec("draft max positions", min=16)
    hidden_act: str = spec("MLP activation", choices=("silu",))
    dtype: str = spec("dtype of the exported weights", choices=("bfloat16", "float16", "float32"))
    num_speculative_tokens: int = spec("tokens proposed per step when serving (k)", min=1)
    hidden_size: int | None = spec(
        "draft hidden size; must equal the verifier's (omit it: it is read from the verifier)",
        min=1, default=None)


@dataclass(frozen=True)
class VllmParams:
    """vLLM engine arguments, by vLLM's own names (vllm/engine/arg_utils.py EngineArgs; the
    CPU backend's environment variables without their VLLM_ prefix). One section for every
    engine that runs the verifier: dataset regeneration, extraction and smoke."""
    tensor_parallel_size: int = spec("GPUs (CPU: NUMA-bound ranks) per model replica", min=1)
    pipeline_parallel_size: int = spec("pipeline stages", min=1)
    data_parallel_size: int = spec("model replicas", min=1)
    enable_expert_parallel: bool = spec("shard MoE experts across the TP x DP ranks")
    gpu_memory_utilization: float = spec("share of each GPU's memory vLLM may use", min=0.01)
    max_model_len: int = spec("longest sequence an engine accepts (prompt + output)", min=16)
    dtype: str = spec("verifier compute dtype, the same in every engine",
                      choices=("float32", "bfloat16", "float16"))
    trust_remote_code: bool = spec("let transformers/vLLM run the checkpoint's own *.py")
    enforce_eager: bool = spec("no CUDA graphs (CPU: always eager)")
    kv_cache_memory_bytes: int | None = spec(
        "KV cache bound per engine; null: vLLM sizes it from gpu_memory_utilization (GPU)",
        min=1)
    cpu_omp_threads_bind: str = spec(
        "CPU only (VLLM_CPU_OMP_THREADS_BIND): cores per rank, e.g. 0|1 for TP 2; auto")
    seed: int = spec("engine seed", min=0)


@dataclass(frozen=True)
class DatasetParams:
    source: str | None = spec("a file of conversations inside conversations/ (.jsonl, .json, "
                              ".parquet, .arrow) in dataset.format, or null for stdlib prompts")
    format: str | None = spec("the source's rows: messages (OpenAI chat), sharegpt or mtbench; "
                              "never guessed: required with a source, null without one",
                              choices=("messages", "sharegpt", "mtbench"))
    max_turns: int | None = spec("user turns answered per conversation, each one sample "
                                 "(null: all)", min=1)
    chat_template_kwargs: dict = spec(
        "extra arguments to the verifier's chat template (vLLM's chat_template_kwargs, e.g. "
        "enable_thinking): the same in the dataset stage, the smoke stage and the serving "
        "recipe; {} for none", mapping="template_kwargs")
    num_samples: int = spec("stdlib prompts to keep, or conversation rows to read at most",
                            min=1)
    max_prompt_tokens: int = spec("prompt tokens kept per sample", min=1)
    max_new_tokens: int = spec("tokens the verifier regenerates per response", min=1)
    max_seq_len: int = spec("longest tokenized conversation", min=8)
    batch_size: int = spec("prompts (a conversation source: conversations) handed to the "
                           "engine at once, each reply stored as it finishes; the stage "
                           "holds one batch in memory", min=1)
    eval_fraction: float = spec("share of samples held out for draft evaluation", min=0.0)
    on_bad_input: str = spec("what a bad conversation row does", choices=("skip", "error"))
    seed: int = spec("sampling/split seed", min=0)
    snippet_lines: list[int] = spec("source null: each stdlib snippet is a run of "
                                    "this many lines, drawn uniformly in [min, max]", length=2)
    snippet_max_chars: int = spec("source null: a snippet's longest text (characters)", min=40)


@dataclass(frozen=True)
class ExtractParams:
    dtype: str = spec("stored hidden-state dtype", choices=("bfloat16", "float16", "float32"))
    batch_size: int = spec("sequences per engine call", min=1)
    threads: int = spec("torch CPU threads (the transformers oracle)", min=1)
    oracle_samples: int = spec("distinct training samples the transformers oracle checks "
                               "(0: none)", min=0)
    oracle_tolerance: float = spec("largest relative error per slot vLLM vs transformers",
                                   min=0.0)
    mode: str = spec("offline: every hidden state on disk before training; online: the train "
                     "stage gets each batch's from the verifier engine and keeps none; hybrid: "
                     "as online, kept in the per-sample store for later epochs and reruns",
                     choices=("offline", "online", "hybrid"))
    endpoint: str | None = spec("host:port of `eagle3pipe serve --hidden-states` (online and "
                                "hybrid); null: the engine runs inside the train stage")
    seed: int = spec("torch/numpy/random seed of the stage (the oracle's forward)", min=0)


# speculators 0.9's loss names (speculators/losses/utils.py, _EAGER_LOSS_FN_MAP and
# _FUSED_LOSS_FN_MAP; tests/test_train.py checks this list against them)
LOSSES = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")


@dataclass(frozen=True)
class TrainParams:
    seed: int = spec("training seed", min=0)
    threads: int = spec("torch CPU threads", min=1)
    device: str = spec("training device", choices=("cpu", "cuda"))
    nproc_per_node: int = spec("training processes per node (torchrun; one per GPU on cuda)",
                               min=1)
    epochs: int = spec("passes over the training samples", min=1)
    batch_tokens: int = spec("tokens per optimizer step (packed)", min=16)
    learning_rate: float = spec("AdamW peak learning rate", min=0.0)
    weight_decay: float = spec("AdamW weight decay", min=0.0)
    warmup_steps: int = spec("linear warm-up steps before cosine decay", min=0)
    ttt_steps: int = spec("test-time-training unroll steps", min=1)
    ttt_step_loss_decay: float = spec("TTT step i's loss is weighted decay**i (speculators' "
                                      "Trainer default 1.0: every step alike)", min=0.0)
    grad_clip: float = spec("largest gradient norm per step (speculators' Trainer clips at "
                            "1.0)", min=0.0)
    loss: str = spec("speculators' training loss by its name in speculators.losses: kl_div "
                     "(its EAGLE-3 default, forward KL to the verifier's distribution), ce "
                     "(cross-entropy on the verifier's greedy token), rkl, jsd, tv, nla, "
                     "lk_hybrid", choices=LOSSES)
    loss_impl: str = spec("how speculators.losses computes the loss: eager (plain torch, "
                          "every device), fused (its Triton kernel: cuda with Triton only), "
                          "auto (eager on cpu, fused on cuda)", choices=("auto", "eager", "fused"))
    eval_every: int = spec("steps between eval-loss logs", min=1)
    checkpoint_every: int = spec("steps between checkpoints (0: only when stopped by SIGTERM or "
                                 "SIGINT); `dvc repro` after a crash resumes from the newest "
                                 "one of the same inputs and params", min=0)
    cpu_chunk_tokens: int = spec("on CPU, a packed batch runs as micro-batches of at most this "
                                 "many tokens with gradient accumulation (the sdpa mask is "
                                 "quadratic in a pack's length); unused on cuda", min=16)
    init_from: str | None = spec("an exported draft (either format) under drafts/ to start "
                                 "from, e.g. drafts/previous (copied or `dvc add`ed there); "
                                 "null: a seeded random init")
    nnodes: int = spec("training nodes, one torchrun agent each (1: standalone on this one; "
                       "more: `eagle3pipe launch` prints the other nodes' command)", min=1,
                       default=1)
    rdzv_endpoint: str | None = spec("host:port of node 0 (the one `dvc repro` runs on) that "
                                     "every other node reaches; needed when train.nnodes > 1",
                                     default=None)


@dataclass(frozen=True)
class SmokeParams:
    num_prompts: int = spec("held-out prompts generated (or lines of smoke.prompts read, at "
                            "most)", min=1)
    max_tokens: int = spec("tokens generated per prompt", min=1)
    min_acceptance_length: float = spec("fail below this mean acceptance length", min=1.0)
    min_gain_over_ngram: float = spec("fail unless draft/ngram acceptance ratio reaches this",
                                      min=0.0)
    ngram_prompt_lookup_min: int = spec("ngram baseline: shortest lookup", min=1)
    ngram_prompt_lookup_max: int = spec("ngram baseline: longest lookup", min=1)
    seed: int = spec("vLLM seed", min=0)
    threads: int = spec("torch CPU threads", min=1)
    snippet_lines: list[int] = spec("prompts null: each stdlib snippet is a run of "
                                    "this many lines, drawn uniformly in [min, max]", length=2)
    snippet_max_chars: int = spec("prompts null: a snippet's longest text (characters)", min=40)
    agreement_prompts: int = spec("samples of the training data's eval split (the first of "
                                  "artifacts/dataset/eval.jsonl) the draft generates in vLLM, "
                                  "beside the trainer's estimate on that split", min=1)
    max_train_serve_gap: float = spec("fail when the draft's acceptance in vLLM on the eval "
                                      "split is below the trainer's estimate by more than this "
                                      "share of it", min=0.0)
    prompts: str | None = spec(
        "JSONL of chat prompts under prompts/ (the stage's dep), in smoke.prompts_format; "
        "null: the held-out stdlib prompts", default=None)
    prompts_format: str = spec("smoke.prompts' rows: messages ({messages, domain}: the last "
                               "user turn answered) or mtbench (MT-Bench's question.jsonl "
                               "{question_id, category, turns}: the first turn, per category)",
                               choices=("messages", "mtbench"), default="messages")
    k_sweep: list[int] = spec("k values also measured for acceptance and speedup (the draft in "
                              "the vllm layout and ngram); []: none", default=())
    timing_rounds: int = spec("timed rounds: each one generates the prompt set once with every "
                              "method, in alternating order", min=1, default=3)
    batch1_prompts: int = spec("the first this many prompts are also generated one request at "
                               "a time in every timed pass (batch-1 latency); 0: not measured",
                               min=0, default=0)


@dataclass(frozen=True)
class Params:
    verifier: VerifierParams = spec("the verifier the draft serves")
    draft: DraftParams = spec("the draft architecture")
    vllm: VllmParams = spec("the vLLM engine that runs the verifier in every stage")
    dataset: DatasetParams = spec("training conversations")
    extract: ExtractParams = spec("hidden-state extraction")
    train: TrainParams = spec("draft training")
    smoke: SmokeParams = spec("vLLM speculative-decoding smoke test")
