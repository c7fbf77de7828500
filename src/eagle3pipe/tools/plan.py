"""`eagle3pipe plan`: what each stage will run, hold and write, and what cannot work, from
params.yaml and the verifier's config.json alone (no model loaded, no engine started).

Hand-checkable figures: hidden-state bytes/token = (NUM_AUX + 1) x H x bytes(extract.dtype)
(57,344 for bf16 at H 7168); tokens = dataset.num_samples x (max_prompt_tokens +
max_new_tokens), an upper bound; draft parameters = numel of arch.contract's floating tensors
(d2t/t2d are index maps; arch.derive refuses a draft whose weights exceed the largest single
accelerator, arch.LARGEST_ACCELERATOR_BYTES, before any plan is made); verifier weights from the safetensors headers beside config.json, else
estimated from the config (dense/MoE, GQA/MLA); training memory per process = draft params x
(4 weights + 4 grads + 8 AdamW) B + activations (an estimate). Stages call build(), render()
and disk_problem() to print the same report and to refuse an output that cannot fit.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from eagle3pipe.draft import arch as A
from eagle3pipe.verifier import families
from eagle3pipe.config import params as P
from eagle3pipe.verifier.handle import VerifierInfo, read_config

GiB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ADAMW_BYTES_PER_PARAM = 4 + 4 + 8  # float32 weights + grads + AdamW's two moments
TOKEN_ROW_BYTES = 8 + 8  # input_ids + loss_mask, int64, per token (extract's Arrow rows)
HS_TOKEN_IDS_BYTES = 8  # token_ids int64 beside every hs_{i}.safetensors' hidden_states


@dataclass
class Stage:
    name: str
    engine: str
    processes: int
    tokens: int | None = None
    disk_bytes: int | None = None
    device_bytes: int | None = None  # per device (GPU), or the whole host's share on CPU
    host_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    params_file: str
    verifier_config: str
    model_type: str | None
    hidden_size: int
    gpu: bool
    device_bytes: int  # one GPU's memory (--device-gib), or the host's memory without a GPU
    hidden_bytes_per_token: int
    draft_params: int
    draft_bytes: int
    verifier_params: int
    verifier_weight_bytes: int
    verifier_weights_from: str
    stages: list[Stage]
    assumptions: list[str]
    problems: list[str]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def hidden_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes of one token's stored hidden states: (3 aux + 1 last) x H x bytes(dtype)."""
    return (A.NUM_AUX + 1) * hidden_size * DTYPE_BYTES[dtype]


def tensor_totals(specs: dict[str, A.TensorSpec]) -> tuple[int, int]:
    """(parameters: numel of the floating tensors, bytes of every tensor) of a contract:
    arch.totals, the same count arch.derive bounds by A.LARGEST_ACCELERATOR_BYTES."""
    return A.totals(specs)


def activation_floats_per_token(specs: dict[str, A.TensorSpec]) -> int:
    """Floats kept for backward per token and TTT step: every contract matrix's input and
    output width (a rough estimate, read off the contract's shapes)."""
    return sum(s.shape[0] + s.shape[1] for s in specs.values() if len(s.shape) == 2)


def dataset_tokens(params: P.Params) -> int:
    d = params.dataset
    return d.num_samples * (d.max_prompt_tokens + d.max_new_tokens)


def _header_totals(config_file: Path) -> tuple[int, int, str] | None:
    """(tensor elements, bytes, where) from the safetensors headers beside config.json."""
    from eagle3pipe.verifier.fingerprint import safetensors_header

    files = sorted(config_file.parent.glob("*.safetensors"))
    if not files:
        return None
    numel = nbytes = 0
    for f in files:
        _, header = safetensors_header(f)
        for name, t in header.items():
            if name != "__metadata__":
                numel += math.prod(t["shape"])
                nbytes += int(t["data_offsets"][1]) - int(t["data_offsets"][0])
    return numel, nbytes, f"safetensors headers of {len(files)} file(s) in {config_file.parent}"


def _attention_params(cfg: dict) -> int:
    H, heads = cfg["hidden_size"], cfg.get("num_attention_heads") or 1
    if "kv_lora_rank" in cfg:  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
        nope, rope, v, kv = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                             cfg["v_head_dim"], cfg["kv_lora_rank"])
        ql = cfg.get("q_lora_rank")
        q = H * ql + ql + ql * heads * (nope + rope) if ql else H * heads * (nope + rope)
        return q + H * (kv + rope) + kv + kv * heads * (nope + v) + heads * v * H
    kvh = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or H // heads
    return 2 * H * heads * hd + 2 * H * kvh * hd


def config_param_estimate(cfg: dict) -> tuple[int, str]:
    """(parameters, how) of a decoder config: attention (GQA or MLA), dense or MoE MLPs,
    norms, embeddings and lm_head. An estimate: biases, MTP layers and extra heads omitted."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    dense_layers = min(cfg.get("first_k_dense_replace", 0), L) if experts else L
    dense_mlp = 3 * H * cfg.get("intermediate_size", 4 * H)
    moe_ff = cfg.get("moe_intermediate_size", cfg.get("intermediate_size", 4 * H))
    moe_mlp = (experts + (cfg.get("n_shared_experts") or 0)) * 3 * H * moe_ff + experts * H
    total = (L * (_attention_params(cfg) + 2 * H) + dense_layers * dense_mlp
             + (L - dense_layers) * moe_mlp + V * H * (1 if cfg.get("tie_word_embeddings") else 2)
             + H)
    kind = (f"MoE ({experts} experts, first {dense_layers} layers dense)" if experts
            else "dense (the config has no n_routed_experts/num_experts)")
    attn = "MLA" if "kv_lora_rank" in cfg else "GQA"
    how = f"estimated from config.json shapes: {kind}, {attn} attention"
    if families.decoder_type(cfg) in families.MLA_TYPES and not (experts and attn == "MLA"):
        how += (f" (model_type {cfg['model_type']} is MoE with MLA, but the config lacks "
                "n_routed_experts/moe_intermediate_size/kv_lora_rank...: far below the real "
                "checkpoint)")
    return total, how


def _weight_bytes(quant: dict | None, vllm_dtype: str) -> tuple[float, str]:
    """(bytes per weight, the assumption) when only the config is known."""
    if not quant:
        return DTYPE_BYTES[vllm_dtype], (f"no quantization_config: every weight in vllm.dtype "
                                         f"{vllm_dtype} ({DTYPE_BYTES[vllm_dtype]} B)")
    bits = quant.get("bits") or quant.get("num_bits") or next(
        (g.get("weights", {}).get("num_bits") for g in quant.get("config_groups", {}).values()),
        8 if "fp8" in str(quant.get("quant_method", "")).lower() else None)
    method = quant.get("quant_method", "?")
    if not bits:
        return DTYPE_BYTES[vllm_dtype], f"quantization_config ({method}): no bit width, " \
            f"assumed vllm.dtype {vllm_dtype}"
    return bits / 8, (f"quantization_config ({method}): {bits}-bit weights assumed for every "
                      "weight (embeddings and norms usually stay 16-bit: a lower bound)")


def verifier_weights(whole: dict, cfg: dict, config_file: Path,
                     vllm_dtype: str) -> tuple[int, int, str]:
    """(parameters or tensor elements, bytes in the engine, where the figure comes from)."""
    quant = cfg.get("quantization_config") or whole.get("quantization_config")
    headers = _header_totals(config_file)
    if headers is not None:
        numel, stored, where = headers
        if quant:
            return numel, stored, where + " (quantized: bytes as stored)"
        return numel, numel * DTYPE_BYTES[vllm_dtype], where + f" (cast to vllm.dtype {vllm_dtype})"
    n, how = config_param_estimate(cfg)
    per_weight, assumption = _weight_bytes(quant, vllm_dtype)
    return n, int(n * per_weight), f"{how}; {assumption}"


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


FREE_BYTES_ENV = "EAGLE3PIPE_FREE_BYTES"  # what-if (and tests): the free disk to plan against


def disk_problem(bytes_needed: int, path: str | Path, key: str) -> str | None:
    """A message when `bytes_needed` exceed the free disk where `path` (or its nearest existing
    parent) lives; None when it fits. `key` is the params key that sizes the output.
    $EAGLE3PIPE_FREE_BYTES stands in for the measured free space."""
    from eagle3pipe.runtime.disk import free_bytes

    where, free = free_bytes(path)
    if os.environ.get(FREE_BYTES_ENV):
        free = int(os.environ[FREE_BYTES_ENV])
    if bytes_needed <= free:
        return None
    return (f"{path}: {key}: needs {human(bytes_needed)} but {where} has {human(free)} free"
            f"\n    fix: free disk there, put {path} on a larger disk, or lower {key}")


# the params key that sizes each stage's output (disk_problem's `key`)
SIZED_BY = {"verifier": "verifier.embedded", "dataset": "dataset.num_samples",
            "extract": "dataset.num_samples", "train": "draft (its size) and train.epochs",
            "export": "draft (its size)"}


def stage_report(stage: str, params_file: str | Path, out: str | Path | None
                 ) -> tuple[list[str], str | None]:
    """What `eagle3pipe plan` says about one stage (its table row and notes, for the start of
    the stage's log), and a refusal when its output would not fit on the free disk of the
    filesystem it is written to (None when it fits). ([], None) when there is no verifier
    config to plan from yet (the embedded verifier before the verifier stage built it)."""
    from eagle3pipe.draft.formats import ConfigError, default_verifier_config

    params = P.load(params_file)
    try:
        vcfg = default_verifier_config(params.verifier.path)
    except ConfigError:
        return [], None
    p = build(params, vcfg, artifacts=Path(out).parent if out else "artifacts")
    row = next((s for s in p.stages if s.name == stage), None)
    if row is None:
        return [], None
    lines = [f"plan ({'GPU' if p.gpu else 'CPU'}): {row.engine}, {row.processes} process(es), "
             f"tokens {row.tokens if row.tokens is not None else '-'}, disk "
             f"{human(row.disk_bytes)}, memory/device {human(row.device_bytes)}, host "
             f"{human(row.host_bytes)}"] + [f"plan: {n}" for n in row.notes]
    lines += [f"plan problem: {x.splitlines()[0]}" for x in p.problems]
    if out is None or not row.disk_bytes:
        return lines, None
    return lines, disk_problem(row.disk_bytes, out, SIZED_BY.get(stage, stage))


def human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


@dataclass(frozen=True)
class _Figures:
    tokens: int
    hidden_per_token: int
    draft_params: int
    draft_bytes: int
    train_bytes: int  # the float32 training checkpoint
    activation_floats: int
    verifier_params: int
    verifier_bytes: int
    verifier_disk: int  # what the embedded verifier stage writes (its stored dtype)
    gpu: bool


def _engine_stage(name: str, v: P.VllmParams, f: _Figures, tokens: int, disk: int | None,
                  extra: int = 0) -> Stage:
    """A stage that runs the verifier in vLLM; `extra` is what it adds per device (a draft)."""
    shards = v.tensor_parallel_size * v.pipeline_parallel_size
    ranks = shards * v.data_parallel_size
    kv = v.kv_cache_memory_bytes or 0
    per_device = f.verifier_bytes // shards + extra + kv
    ep = " EP" if v.enable_expert_parallel else ""
    label = (f"vLLM TP{v.tensor_parallel_size} PP{v.pipeline_parallel_size} "
             f"DP{v.data_parallel_size}{ep} {'GPU' if f.gpu else 'CPU'}")
    host = (per_device - kv) * ranks + kv * v.data_parallel_size  # CPU: every rank is here
    s = Stage(name, label, ranks, tokens, disk, per_device, None if f.gpu else host)
    s.notes.append(f"verifier {human(f.verifier_bytes)} / (TP x PP = {shards})"
                   + (f" + draft {human(extra)}" if extra else "")
                   + (f" + KV cache {human(kv)} (vllm.kv_cache_memory_bytes)" if kv else
                      f" + KV cache up to vllm.gpu_memory_utilization {v.gpu_memory_utilization}"
                      " of the device"))
    return s


def _verifier_stage(params: P.Params, f: _Figures) -> Stage:
    e = params.verifier.embedded
    if params.verifier.path is not None or e is None:
            return Stage("verifier", f"none (fingerprint: {params.verifier.hash_mode})", 1,
                     notes=[f"fingerprints {params.verifier.path}; writes a manifest only"])
    s = Stage("verifier", f"torch CPU x{e.threads} threads (embedded)", 1,
              tokens=e.train_steps * e.batch_size * e.seq_len, disk_bytes=f.verifier_disk,
              host_bytes=f.verifier_params * ADAMW_BYTES_PER_PARAM)
    s.notes.append(f"trains {f.verifier_params:,} parameters for {e.train_steps} steps of "
                   f"{e.batch_size} x {e.seq_len} tokens")
    return s


def _train_stage(params: P.Params, f: _Figures) -> Stage:
    t = params.train
    act = t.batch_tokens * t.ttt_steps * f.activation_floats * 4
    per_process = f.draft_params * ADAMW_BYTES_PER_PARAM + act
    train_tokens = int(f.tokens * (1 - params.dataset.eval_fraction)) * t.epochs
    on_gpu = t.device == "cuda"
    s = Stage("train", f"torchrun x{t.nproc_per_node} ({t.device})", t.nproc_per_node,
              train_tokens, f.train_bytes, per_process if on_gpu else None,
              None if on_gpu else per_process * t.nproc_per_node)
    s.notes.append(f"estimate: {f.draft_params:,} params x {ADAMW_BYTES_PER_PARAM} B (weights, "
                   f"grads, AdamW) + activations {t.batch_tokens} tokens x {t.ttt_steps} TTT "
                   f"steps x {f.activation_floats:,} floats x 4 B = {human(act)}")
    return s


def _stages(params: P.Params, f: _Figures) -> list[Stage]:
    v, tokens = params.vllm, f.tokens
    hidden = tokens * f.hidden_per_token
    rows = tokens * (HS_TOKEN_IDS_BYTES + TOKEN_ROW_BYTES)
    dataset = _engine_stage("dataset", v, f, tokens, tokens * TOKEN_ROW_BYTES)
    dataset.notes.append(f"tokens <= {params.dataset.num_samples:,} samples x "
                         f"({params.dataset.max_prompt_tokens} + "
                         f"{params.dataset.max_new_tokens}); disk ~{TOKEN_ROW_BYTES} B/token")
    extract = _engine_stage("extract", v, f, tokens, hidden + rows)
    extract.notes.append(f"hidden states {f.hidden_per_token:,} B/token x {tokens:,} tokens = "
                         f"{human(hidden)}, + {human(rows)} of token ids and rows")
    export = Stage("export", "none (torch CPU)", 1, None, len(A.LAYOUTS) * f.draft_bytes,
                   None, f.train_bytes + f.draft_bytes,
                   [f"{len(A.LAYOUTS)} layouts x {human(f.draft_bytes)} in "
                    f"{params.draft.dtype}"])
    engines = 2 + len(A.LAYOUTS)  # non-speculative, one per exported layout, ngram
    smoke = _engine_stage("smoke", v, f, params.smoke.num_prompts * params.smoke.max_tokens
                          * engines, None, extra=f.draft_bytes // v.tensor_parallel_size)
    smoke.notes.append(f"{engines} engines one after another, {params.smoke.num_prompts} "
                       f"prompts x {params.smoke.max_tokens} tokens each")
    return [_verifier_stage(params, f), dataset, extract, _train_stage(params, f), export,
            smoke]


def _heads_problems(params: P.Params, cfg: dict, bad) -> None:
    """The verifier's heads against vLLM's tensor-parallel ranks (the draft's: params.py)."""
    tp, key = params.vllm.tensor_parallel_size, "vllm.tensor_parallel_size"
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    if heads and heads % tp:
        bad(key, f"{tp} does not divide the verifier's num_attention_heads {heads}: vLLM "
            "shards attention heads over the tensor-parallel ranks",
            f"pick a tensor_parallel_size that divides {heads}")
    elif kv and "kv_lora_rank" not in cfg and kv % tp and tp % kv:
        bad(key, f"{tp} and the verifier's num_key_value_heads {kv} do not divide one another "
            "(vLLM splits or replicates KV heads)", f"pick a divisor or multiple of {kv}")


def _machine_problems(params: P.Params, cfg: dict, f: _Figures, bad) -> None:
    """vLLM's known limits on this machine (CPU build vs the GPU path)."""
    v = params.vllm
    from eagle3pipe.verifier.preflight import eagle3_limit

    limit = eagle3_limit(cfg, "the verifier config", cpu=not f.gpu)  # the preflight's words
    if limit:
        bad("verifier.path", limit.message, limit.fix)
    ranks = v.tensor_parallel_size * v.pipeline_parallel_size
    if not f.gpu and ranks > 1 and v.cpu_omp_threads_bind == "auto":
        bad("vllm.cpu_omp_threads_bind", f"auto with TP x PP = {ranks} ranks on vLLM's CPU "
            "backend: it refuses to start (\"Not enough allowed NUMA nodes\")",
            "give each rank its cores, e.g. \"0|1\" for 2 ranks")
    if params.train.device == "cuda" and not f.gpu:
        bad("train.device", "cuda, but torch sees no GPU on this machine",
            "use train.device: cpu here, or run training on a GPU machine")


def _fit_problems(params: P.Params, stages: list[Stage], device: int, gpu: bool, bad) -> None:
    """Stages whose memory exceeds one device (GPU) or the host (CPU)."""
    util = params.vllm.gpu_memory_utilization
    for s in stages:
        if s.engine.startswith("vLLM") and gpu and s.device_bytes > device * util:
            bad("vllm.tensor_parallel_size", f"{s.name}: {human(s.device_bytes)} per GPU "
                f"exceeds {util} x {human(device)}", "raise vllm.tensor_parallel_size or "
                "pipeline_parallel_size (or use a quantized checkpoint)")
        elif s.name == "train" and (s.device_bytes or 0) > device:
            bad("train.nproc_per_node", f"train: the draft needs {human(s.device_bytes)} per "
                f"GPU (estimate), more than the device's {human(device)}",
                "lower train.batch_tokens, or a smaller draft (draft.intermediate_size, "
                "draft.draft_vocab_size)")
        elif s.host_bytes and s.host_bytes > host_memory_bytes():
            key = {"train": "train.nproc_per_node", "verifier": "verifier.embedded"}.get(
                s.name, "verifier.path")
            bad(key, f"{s.name}: needs {human(s.host_bytes)} of host memory, this machine has "
                f"{human(host_memory_bytes())}", "run it on a larger machine or the GPU path")


def problems_of(params: P.Params, cfg: dict, f: _Figures, stages: list[Stage], device: int,
                artifacts: str | Path) -> list[str]:
    file, lines = P.source_of(params), P.lines_of(params)
    found: list[P.Problem] = []
    P.check_engine(params, file, lines, found)  # the draft's heads vs TP, max_model_len

    def bad(key: str, msg: str, fix: str) -> None:
        found.append(P.Problem(file, lines.get(key), key, msg, fix))

    _heads_problems(params, cfg, bad)
    _machine_problems(params, cfg, f, bad)
    _fit_problems(params, stages, device, f.gpu, bad)
    out = [str(p) for p in found]
    extract = next(s for s in stages if s.name == "extract")
    disk = disk_problem(extract.disk_bytes, Path(artifacts) / "hidden", "dataset.num_samples")
    return out + ([disk] if disk else [])


def build(params: P.Params, verifier_config: str | Path, *, gpu: bool | None = None,
          device_gib: float = 80.0, artifacts: str | Path = "artifacts") -> Plan:
    """The plan of a run of `params` on this machine. gpu None: torch's answer; a GPU's memory
    is device_gib, without a GPU the host's memory stands for the device."""
    gpu = cuda_available() if gpu is None else gpu
    device = int(device_gib * GiB) if gpu else host_memory_bytes()
    whole, cfg, cfg_file = read_config(verifier_config)
    info = VerifierInfo.from_config(cfg_file)
    arch = A.derive(params.draft, info, params_file=P.source_of(params),
                    lines=P.lines_of(params))
    specs = A.contract(arch, "speculators")
    draft_params, draft_bytes = tensor_totals(specs)
    _, train_bytes = tensor_totals(A.contract(dataclasses.replace(arch, dtype="float32"),
                                              "speculators"))
    v_params, v_bytes, v_from = verifier_weights(whole, cfg, cfg_file, params.vllm.dtype)
    stored = DTYPE_BYTES.get(cfg.get("dtype") or cfg.get("torch_dtype"), 4)
    f = _Figures(dataset_tokens(params), hidden_bytes_per_token(info.hidden_size,
                                                                params.extract.dtype),
                 draft_params, draft_bytes, train_bytes, activation_floats_per_token(specs),
                 v_params, v_bytes, v_params * stored, gpu)
    stages = _stages(params, f)
    assumptions = [f"verifier weights: {v_from}",
                   "tokens are upper bounds: every sample at max_prompt_tokens + max_new_tokens",
                   "training memory and activations are estimates"]
    return Plan(P.source_of(params), str(cfg_file), info.model_type, info.hidden_size, gpu,
                device, f.hidden_per_token, draft_params, draft_bytes, v_params, v_bytes,
                v_from, stages, assumptions,
                problems_of(params, cfg, f, stages, device, artifacts))


COLUMNS = (("stage", 9), ("engine", 40), ("procs", 5), ("tokens", 13), ("disk written", 12),
           ("memory/device", 13), ("host memory", 11))


def _row(cells: list[str]) -> str:
    out = []
    for (_, width), cell in zip(COLUMNS, cells):
        out.append(cell.ljust(width) if not out or width == 40 else cell.rjust(width))
    return "  ".join(out).rstrip()


def render(plan: Plan) -> str:
    """The human form: the figures, a fixed-width table of the stages, notes and problems."""
    dtype_bytes = plan.hidden_bytes_per_token // ((A.NUM_AUX + 1) * plan.hidden_size)
    machine = (f"GPU, {human(plan.device_bytes)} per device (--device-gib)" if plan.gpu else
               f"CPU only (torch sees no GPU): host memory {human(plan.device_bytes)}")
    lines = [f"plan: {plan.params_file}; verifier config {plan.verifier_config}",
             f"  machine: {machine}",
             f"  verifier: {plan.model_type}, H {plan.hidden_size}: {plan.verifier_params:,} "
             f"parameters, {human(plan.verifier_weight_bytes)} in the engine",
             f"  draft: {plan.draft_params:,} parameters (arch.contract), "
             f"{human(plan.draft_bytes)} exported",
             f"  hidden states: ({A.NUM_AUX} + 1) x {plan.hidden_size} x {dtype_bytes} B = "
             f"{plan.hidden_bytes_per_token:,} B/token", "",
             _row([c for c, _ in COLUMNS]), _row(["-" * w for _, w in COLUMNS])]
    for s in plan.stages:
        lines.append(_row([s.name, s.engine, str(s.processes),
                           "-" if s.tokens is None else f"{s.tokens:,}", human(s.disk_bytes),
                           human(s.device_bytes), human(s.host_bytes)]))
    lines += ["", "notes:"] + [f"  {s.name}: {n}" for s in plan.stages for n in s.notes]
    lines += ["assumptions:"] + [f"  - {a}" for a in plan.assumptions]
    if plan.problems:
        lines += [f"problems ({len(plan.problems)}):"] + [f"  - {p}" for p in plan.problems]
    else:
        lines.append("problems: none")
    return "\n".join(lines)
