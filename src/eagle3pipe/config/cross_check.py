"""The checks of params.yaml that need several of its keys (the verifier's own facts are checked
in eagle3pipe.stages.verifier.run): draft heads and switches, the embedded verifier, the engines'
parallelism, the smoke thresholds, the dataset split, training's start and nodes, the
hidden-state mode. Each problem names file, line and key and carries the fix; params.load lists
every one at once."""
from __future__ import annotations

from pathlib import Path

from eagle3pipe.config.schema import Params
from eagle3pipe.errors import Problem


# the folder train.init_from names a draft in: a dependency of the train stage (dvc.yaml), so a
# draft copied or `dvc add`ed there is content-addressed like every other input
INIT_DIR = "drafts"


def inside_init_dir(path: str) -> bool:
    """True when `path` is a relative path to a directory below INIT_DIR (no `..`)."""
    parts = Path(path).parts
    return (not Path(path).is_absolute() and len(parts) >= 2 and parts[0] == INIT_DIR
            and ".." not in parts)


def cross_check(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    """Checks that need several keys of params.yaml alone (verifier checks live in verifier.py)."""
    _draft_problems(p, file, lines, problems)
    if not _embedded_problems(p, file, lines, problems):
        return
    check_engine(p, file, lines, problems)
    _smoke_dataset_problems(p, file, lines, problems)
    _train_problems(p, file, lines, problems)
    _extract_problems(p, file, lines, problems)
    s = p.smoke
    if s.batch1_prompts > s.num_prompts:
        problems.append(Problem(file, lines.get("smoke.batch1_prompts"), "smoke.batch1_prompts",
                                f"{s.batch1_prompts} is more than smoke.num_prompts "
                                f"{s.num_prompts}: batch 1 times the first prompts of the set",
                                f"use at most {s.num_prompts}"))
    if not 0.0 <= p.dataset.eval_fraction < 1.0:
        problems.append(Problem(file, lines.get("dataset.eval_fraction"), "dataset.eval_fraction",
                                f"must be in [0, 1), got {p.dataset.eval_fraction}",
                                "use e.g. 0.1"))


def _draft_problems(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    d = p.draft
    if d.num_attention_heads % d.num_key_value_heads:
        problems.append(Problem(file, lines.get("draft.num_key_value_heads"),
                                "draft.num_key_value_heads",
                                f"{d.num_key_value_heads} does not divide num_attention_heads "
                                f"{d.num_attention_heads} (grouped-query attention)",
                                "pick a divisor of draft.num_attention_heads"))
    if d.norm_before_fc and d.fc_norm:
        problems.append(Problem(file, lines.get("draft.fc_norm"), "draft.fc_norm",
                                "true together with draft.norm_before_fc: one RMSNorm over the "
                                "concatenated aux states and one per aux state are exclusive "
                                "(speculators' Eagle3SpeculatorConfig refuses the pair)",
                                "set one of draft.norm_before_fc and draft.fc_norm to false "
                                "(EAGLE-3.1 uses fc_norm; speculators' CLI norm_before_fc)"))
    ids = d.aux_layer_ids
    if len(set(ids)) != len(ids):
        problems.append(Problem(file, lines.get("draft.aux_layer_ids"), "draft.aux_layer_ids",
                                f"duplicated layer ids {ids}", "list 3 distinct verifier layers"))
    elif list(ids) != sorted(ids):
        problems.append(Problem(file, lines.get("draft.aux_layer_ids"), "draft.aux_layer_ids",
                                f"{ids} is not ascending; vLLM concatenates aux states in layer "
                                "order, so any other order trains the draft on permuted inputs",
                                f"write them ascending: {sorted(ids)}"))


def _embedded_problems(p: Params, file: str, lines: dict, problems: list[Problem]) -> bool:
    """The verifier section's own consistency; False when no verifier is named (then nothing
    that needs one is checked)."""
    e = p.verifier.embedded
    if p.verifier.path is None and e is None:
        problems.append(Problem(file, lines.get("verifier.embedded") or lines.get("verifier.path"),
                                "verifier.embedded", "is null while verifier.path is null: "
                                "nothing says which verifier to use",
                                "set verifier.path to a checkpoint dir, or give the embedded "
                                "verifier's sizes"))
        return False
    if p.verifier.path is None and e.num_attention_heads % e.num_key_value_heads:
        problems.append(Problem(file, lines.get("verifier.embedded.num_key_value_heads"),
                                "verifier.embedded.num_key_value_heads",
                                f"{e.num_key_value_heads} does not divide num_attention_heads "
                                f"{e.num_attention_heads}", "pick a divisor"))
    if p.verifier.path is None and e.hidden_size % e.num_attention_heads:
        problems.append(Problem(file, lines.get("verifier.embedded.num_attention_heads"),
                                "verifier.embedded.num_attention_heads",
                                f"{e.num_attention_heads} does not divide hidden_size "
                                f"{e.hidden_size}; transformers' LlamaConfig rejects that",
                                "pick a divisor of verifier.embedded.hidden_size"))
    if p.verifier.path is None and any(b >= 1.0 for b in e.adam_betas):
        problems.append(Problem(file, lines.get("verifier.embedded.adam_betas"),
                                "verifier.embedded.adam_betas",
                                f"{list(e.adam_betas)}: each beta must be below 1 (AdamW)",
                                "use e.g. [0.9, 0.95]"))
    return True


def _smoke_dataset_problems(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    s = p.smoke
    most = p.draft.num_speculative_tokens + 1
    if s.min_acceptance_length > most:
        problems.append(Problem(file, lines.get("smoke.min_acceptance_length"),
                                "smoke.min_acceptance_length",
                                f"{s.min_acceptance_length} can never be reached: with "
                                f"draft.num_speculative_tokens {most - 1} a step accepts at most "
                                f"k + 1 = {most} tokens", f"use a value <= {most}"))
    if s.ngram_prompt_lookup_min > s.ngram_prompt_lookup_max:
        problems.append(Problem(file, lines.get("smoke.ngram_prompt_lookup_min"),
                                "smoke.ngram_prompt_lookup_min",
                                "is larger than smoke.ngram_prompt_lookup_max",
                                "make min <= max"))
    for section in ("dataset", "smoke"):
        lo, hi = getattr(p, section).snippet_lines
        if not 1 <= lo <= hi:
            problems.append(Problem(file, lines.get(f"{section}.snippet_lines"),
                                    f"{section}.snippet_lines",
                                    f"[{lo}, {hi}] is not [min, max] with 1 <= min <= max",
                                    "use e.g. [4, 12]"))
    _source_problems(p, file, lines, problems)
    if p.dataset.eval_fraction > 0 and p.dataset.num_samples < 2:
        problems.append(Problem(file, lines.get("dataset.num_samples"), "dataset.num_samples",
                                f"{p.dataset.num_samples} sample cannot fill both a train and an "
                                f"eval split (dataset.eval_fraction {p.dataset.eval_fraction})",
                                "use at least 2, or dataset.eval_fraction: 0"))


def _source_problems(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    """dataset.format and dataset.max_turns against dataset.source: a source's format is
    declared, never guessed; the stdlib snippets (source null) have neither."""
    d = p.dataset
    if d.source is None:
        for key, value in (("format", d.format), ("max_turns", d.max_turns)):
            if value is not None:
                problems.append(Problem(
                    file, lines.get(f"dataset.{key}"), f"dataset.{key}",
                    f"{value} is set but dataset.source is null: the stdlib snippets are one "
                    "user turn each, in no file format", f"set dataset.{key}: null, or point "
                    "dataset.source at a file in conversations/"))
    elif d.format is None:
        problems.append(Problem(
            file, lines.get("dataset.format"), "dataset.format",
            f"is null but dataset.source is {d.source}: a source's format is never guessed",
            "set dataset.format: messages ({\"messages\": [...]}), sharegpt "
            "({\"conversations\": [...]}) or mtbench ({\"turns\": [...]})"))


def _train_problems(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    t = p.train
    if t.init_from is not None and not inside_init_dir(t.init_from):
        problems.append(Problem(file, lines.get("train.init_from"), "train.init_from",
                                f"{t.init_from!r} is not a directory under {INIT_DIR}/"
                                f", the folder the train stage depends on (dvc.yaml), so "
                                "editing or replacing it would rerun nothing",
                                f"copy the draft export into {INIT_DIR}/<name> (or "
                                f"`dvc add {INIT_DIR}/<name>`) and set "
                                f"train.init_from: {INIT_DIR}/<name>"))
    if t.loss_impl == "fused" and t.device == "cpu":
        problems.append(Problem(file, lines.get("train.loss_impl"), "train.loss_impl",
                                "fused is speculators' Triton kernel, which runs on cuda only, "
                                "and train.device is cpu",
                                "use train.loss_impl: eager (or auto), or train.device: cuda"))
    if t.nnodes > 1 and not _endpoint(t.rdzv_endpoint):
        unset = t.rdzv_endpoint is None  # then the key just set is nnodes
        key = "train.nnodes" if unset else "train.rdzv_endpoint"
        problems.append(Problem(file, lines.get(key), key,
                                (f"{t.nnodes} needs node 0's address, but train.rdzv_endpoint "
                                 "is null" if unset else f"{t.rdzv_endpoint!r} is not host:port "
                                 f"(train.nnodes is {t.nnodes}: the other nodes need node 0's "
                                 "address)"),
                                "set train.rdzv_endpoint to host:port of the node that runs "
                                "`dvc repro` (a port every node can reach, e.g. "
                                "node0.cluster:29500), or train.nnodes: 1"))


def _extract_problems(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    """extract.mode and extract.endpoint against each other and the training processes."""
    e, t = p.extract, p.train
    if e.endpoint is not None and not _endpoint(e.endpoint):
        problems.append(Problem(file, lines.get("extract.endpoint"), "extract.endpoint",
                                f"{e.endpoint!r} is not host:port",
                                "set the host:port that `eagle3pipe serve --hidden-states` "
                                "listens on (e.g. infer0.cluster:8100), or null"))
    if e.endpoint is not None and e.mode == "offline":
        problems.append(Problem(file, lines.get("extract.endpoint"), "extract.endpoint",
                                f"{e.endpoint!r} is set, but extract.mode is offline (the "
                                "extract stage runs its own engine; the endpoint would be unused)",
                                "set extract.mode: online or hybrid, or extract.endpoint: null"))
    procs = t.nproc_per_node * t.nnodes
    if e.mode != "offline" and e.endpoint is None and procs > 1:
        problems.append(Problem(file, lines.get("extract.mode"), "extract.mode",
                                f"{e.mode} with the engine inside the train stage needs one "
                                f"training process; train.nproc_per_node x train.nnodes = {procs}",
                                "serve the verifier with `eagle3pipe serve --hidden-states` and "
                                "set extract.endpoint to its host:port, or train with one process"))


def _endpoint(value: str | None) -> bool:
    """host:port with a non-empty host and a port in 1..65535."""
    host, _, port = (value or "").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def tp_problem(tp: int, heads: int | None, kv_heads: int | None, whose: str, why: str = ""
               ) -> tuple[str, str] | None:
    """(message, fix) when vLLM cannot shard `whose` attention over `tp` tensor-parallel ranks:
    the query heads must split evenly; the KV heads must split or be replicated (one divides the
    other; vLLM's QKVParallelLinear). kv_heads None: no KV heads to shard (MLA's latent KV)."""
    if heads and heads % tp:
        return (f"{tp} does not divide the {whose}'s num_attention_heads {heads}"
                + (f": {why}" if why else ""), f"pick a tensor_parallel_size that divides {heads}")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        return (f"{tp} and the {whose}'s num_key_value_heads {kv_heads} do not divide one another "
                "(vLLM splits or replicates KV heads)", f"pick a divisor or multiple of {kv_heads}")
    return None


def check_engine(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    """What vLLM would refuse only after loading weights: heads that do not split over the
    tensor-parallel ranks (vLLM's draft runs at the verifier's TP size), sequences longer than
    the engine accepts. The verifier's own heads are checked against it in the verifier stage."""
    v, d = p.vllm, p.draft
    key = "vllm.tensor_parallel_size"
    bad = tp_problem(v.tensor_parallel_size, d.num_attention_heads, d.num_key_value_heads,
                     "draft", "vLLM shards the draft's heads over the same ranks as the verifier's")
    if bad:
        problems.append(Problem(file, lines.get(key), key, *bad))
    if p.dataset.max_seq_len > v.max_model_len:
        problems.append(Problem(file, lines.get("vllm.max_model_len"), "vllm.max_model_len",
                                f"{v.max_model_len} is shorter than dataset.max_seq_len "
                                f"{p.dataset.max_seq_len}: the dataset engine would refuse "
                                "its own samples", f"raise it to at least "
                                f"{p.dataset.max_seq_len}"))
    if not 0.0 < v.gpu_memory_utilization <= 1.0:
        problems.append(Problem(file, lines.get("vllm.gpu_memory_utilization"),
                                "vllm.gpu_memory_utilization",
                                f"must be in (0, 1], got {v.gpu_memory_utilization}",
                                "use e.g. 0.9"))
