"""The train stage: real speculators Eagle3DraftModel on real hidden states of the micro verifier
(a real forward pass), real safetensors, real dvclive output."""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3pipe.draft import arch as archmod
from eagle3pipe.stages.train import batches
from eagle3pipe.runtime import distributed
from eagle3pipe.draft import formats, parsing
from eagle3pipe.draft import vocab_map
from eagle3pipe.stages.train import run as trainmod
from eagle3pipe.stages.train import model as train_model
from eagle3pipe.verifier.handle import VerifierInfo
from helpers.training import MICRO_TRAIN, make_inputs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def inputs(micro_verifier, tmp_path_factory):
    return make_inputs(micro_verifier, tmp_path_factory.mktemp("train_inputs"))


def run_train(inp, out: Path, metrics: Path, **overrides):
    p = types.SimpleNamespace(**{**MICRO_TRAIN, **overrides})
    return trainmod.train(p, inp.draft_config, inp.verifier, inp.hidden, inp.vocab, out,
                          metrics_dir=metrics, progress=False)


@pytest.fixture(scope="module")
def trained(inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    final = run_train(inputs, root / "train", root / "metrics")
    return types.SimpleNamespace(out=root / "train", metrics=root / "metrics", final=final)


def _tsv(path: Path) -> list[tuple[int, float]]:
    rows = path.read_text().splitlines()
    head = rows[0].split("\t")
    assert "timestamp" not in head, "dvclive plots must not carry timestamps (committed files)"
    return [(int(r.split("\t")[head.index("step")]), float(r.split("\t")[-1])) for r in rows[1:]]


@pytest.mark.integration
def test_checkpoint_is_exactly_the_speculators_contract(inputs, trained):
    spec = archmod.contract(dataclasses.replace(inputs.arch, dtype="float32"), "speculators")
    with safe_open(str(trained.out / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        got = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in names}
    assert names == sorted(spec), set(names) ^ set(spec)
    assert not any(n.startswith(("embed_tokens", "verifier_")) for n in names)
    for n, s in spec.items():
        assert got[n] == (s.shape, s.dtype), (n, got[n], s)
    # head_dim is the explicit 32, not 64/4
    assert got["layers.0.self_attn.q_proj.weight"][0] == (4 * 32, 2 * 64)
    cfg = json.loads((trained.out / "config.json").read_text())
    tl = cfg["transformer_layer_config"]
    assert tl["head_dim"] == 32 and tl["hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["norm_before_residual"] is True
    assert cfg["draft_vocab_size"] == 128
    # the lm_head rows are the verifier's rows selected by t2d (frozen, as speculators trains)
    t = load_file(str(trained.out / "model.safetensors"))
    ver = load_file(str(inputs.verifier / "model.safetensors"))
    assert torch.equal(t["lm_head.weight"], ver["lm_head.weight"][t["t2d"]])
    assert torch.equal(torch.arange(128) + t["d2t"], torch.nonzero(t["t2d"]).flatten())


@pytest.mark.integration
def test_training_reduces_eval_loss_and_logs_dvclive(trained):
    evals = _tsv(trained.metrics / "plots" / "metrics" / "eval" / "loss.tsv")
    assert evals[0][0] == 0 and len(evals) >= 3
    first, last = evals[0][1], evals[-1][1]
    assert last < 0.8 * first, evals
    train_rows = _tsv(trained.metrics / "plots" / "metrics" / "train" / "loss.tsv")
    assert [s for s, _ in train_rows] == list(range(1, len(train_rows) + 1))
    m = json.loads((trained.metrics / "metrics.json").read_text())
    assert m["step"] == len(train_rows)
    assert m["eval"]["loss"] == pytest.approx(last)
    assert "loss" in m["train"]
    accs = [m["eval"][f"acc_pos{i}"] for i in range(3)]
    assert 0.0 < accs[0] <= 1.0 and accs[0] >= accs[1] >= accs[2] >= 0.0  # cumulative
    assert m["eval"]["accept_len"] == pytest.approx(1 + sum(accs), abs=1e-4)
    assert not (trained.metrics / "dvc.yaml").exists()


@pytest.mark.slow
def test_two_runs_are_byte_identical(inputs, trained, tmp_path):
    run_train(inputs, tmp_path / "train", tmp_path / "metrics")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "train" / name).read_bytes() == (trained.out / name).read_bytes(), name
    for f in sorted(trained.metrics.rglob("*")):
        if f.is_file():
            other = tmp_path / "metrics" / f.relative_to(trained.metrics)
            assert other.read_bytes() == f.read_bytes(), f


@pytest.mark.integration
def test_checkpoint_reloads_in_speculators(inputs, trained):
    from speculators.models.eagle3 import Eagle3DraftModel

    m = Eagle3DraftModel.from_pretrained(str(trained.out))
    t = load_file(str(trained.out / "model.safetensors"))
    sd = m.state_dict()
    for name, tensor in t.items():
        assert torch.equal(sd[name].to(tensor.dtype), tensor), name


@pytest.mark.integration
def test_trainer_parts_are_what_fit_runs(inputs, trained):
    """setup -> TrainState, evaluate and step are fit()'s own parts: a fresh state's eval and
    first step give the values the trained fixture's fit() logged at steps 0 and 1."""
    s = trainmod.setup(types.SimpleNamespace(**MICRO_TRAIN), inputs.draft_config,
                       inputs.verifier, inputs.hidden, inputs.vocab, max_steps=1)
    assert (s.limit, s.step) == (1, 0)
    for e, packs in enumerate(s.per_epoch):  # one rank: the seeded epoch order, all of it
        assert packs == batches.epoch_batches(s.train.lengths, MICRO_TRAIN["batch_tokens"], 0, e)
    plots = trained.metrics / "plots" / "metrics"
    ev = trainmod.evaluate(s)
    assert float(f"{ev['loss']:.6g}") == _tsv(plots / "eval" / "loss.tsv")[0][1]
    s.model.train()
    before = s.core.fc.weight.detach().clone()
    loss, lr = trainmod.step(s, s.per_epoch[0][0])
    assert s.step == 1 and not torch.equal(before, s.core.fc.weight)
    assert _tsv(plots / "train" / "loss.tsv")[0] == (1, float(f"{loss:.6g}"))
    assert lr == pytest.approx(MICRO_TRAIN["learning_rate"] / (MICRO_TRAIN["warmup_steps"] + 1))
    trainmod.evaluate(s)
    assert s.core.training  # evaluate restores the mode it found


def test_single_process_distributed_plumbing(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    d = distributed.setup_distributed("cpu")
    assert d == distributed.Dist() and d.main and d.device.type == "cpu"
    layer = torch.nn.Linear(2, 2)
    assert distributed.wrap_model(layer, d) is layer  # no DDP alone
    t = torch.ones(3)
    assert distributed.all_reduce(t, d) is t and torch.equal(t, torch.ones(3))
    if not torch.cuda.is_available():
        with pytest.raises(distributed.DistributedError, match="sees no CUDA device"):
            distributed.setup_distributed("cuda")


def test_packing_is_seeded_and_bounded():
    lengths = [100, 300, 50, 700, 20, 256, 256, 10]
    a = batches.epoch_batches(lengths, 512, seed=0, epoch=1)
    assert a == batches.epoch_batches(lengths, 512, seed=0, epoch=1)
    assert a != batches.epoch_batches(lengths, 512, seed=0, epoch=2)
    assert sorted(i for b in a for i in b) == list(range(len(lengths)))
    for b in a:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 512


def test_bad_inputs_name_the_file(inputs, tmp_path):
    bad = tmp_path / "draft_config.json"
    d = json.loads(inputs.draft_config.read_text())
    d.pop("head_dim")
    bad.write_text(json.dumps(d))
    with pytest.raises(parsing.ConfigError, match=r"draft_config\.json.*head_dim"):
        parsing.read_draft_config(bad)
    # a vocab map whose d2t is all zeros loads in vLLM and is wrong: rejected here
    t = load_file(str(inputs.vocab / "vocab_map.safetensors"))
    (tmp_path / "v").mkdir()
    save_file({"d2t": torch.zeros_like(t["d2t"]), "t2d": t["t2d"]},
              str(tmp_path / "v" / "vocab_map.safetensors"))
    with pytest.raises(vocab_map.VocabError, match="d2t and t2d disagree"):
        vocab_map.load(tmp_path / "v", inputs.arch.draft_vocab_size, inputs.arch.vocab_size)
    # a draft config for another verifier (stale configs/) is rejected
    other = tmp_path / "other.json"
    d = json.loads(inputs.draft_config.read_text())
    d["hidden_size"] = d["target_hidden_size"] = 128
    other.write_text(json.dumps(d))
    with pytest.raises(trainmod.TrainInputError, match="hidden_size=128.*stale"):
        trainmod.check_against_verifier(parsing.read_draft_config(other),
                                        VerifierInfo.from_config(inputs.verifier))


def test_transformer_layer_config_keeps_explicit_head_dim(inputs):
    cfg = train_model.speculator_config(inputs.arch, inputs.verifier, speculative_tokens=3,
                                     attn_impl="sdpa").transformer_layer_config
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
    assert cfg._attn_implementation == "sdpa"
    # the layer trained is the layer the configs stage renders for export
    assert cfg.to_dict() == formats.transformer_layer_config(inputs.arch).to_dict()


def test_the_loss_names_params_accept_are_speculators_own():
    """train.loss is checked against schema.LOSSES without importing speculators; both of
    speculators' implementations must know every name (and no other)."""
    from speculators.losses import utils

    from eagle3pipe.config import schema

    assert set(schema.LOSSES) == set(utils._EAGER_LOSS_FN_MAP) == set(utils._FUSED_LOSS_FN_MAP)


def test_cpu_micro_batches_give_the_packed_step(inputs):
    """CPU runs a pack as <=chunk-token micro-batches; weighted by loss-mask share, loss and
    gradient equal one packed forward (speculators' token-weighted mean over the pack)."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    torch.manual_seed(0)
    a = parsing.read_draft_config(inputs.draft_config)
    d2t, t2d = vocab_map.load(inputs.vocab, a.draft_vocab_size, a.vocab_size)
    model = trainmod.build_model(a, inputs.verifier, d2t, t2d, speculative_tokens=3,
                                 attn_impl="sdpa")
    ds = batches.open_datapath(inputs.hidden / "train", 1024, torch.float32)
    exact = dataclasses.replace(distributed.backend_for("cpu", MICRO_TRAIN["cpu_chunk_tokens"],
                                                        "eager"),
                                autocast=None,
                                data_dtype=torch.float32)
    collate = CollateFn(1024, a.target_hidden_size, 3, dtype=torch.float32,
                        preprocess=shift_batch)
    idx = [0, 1, 2, 3, 4]
    lc = resolve_loss_config("kl_div", "eager")
    results = []
    for chunk in (None, 300):
        b = batches.Batches(ds, inputs.hidden / "train", collate,
                             dataclasses.replace(exact, chunk_tokens=chunk))
        micro = b.micro(idx)
        assert (len(micro) == 1) == (chunk is None)
        model.zero_grad()
        loss, counts = train_model.run_batch(model, micro, ttt_steps=3, ttt_step_loss_decay=1.0,
                                          loss_config=lc,
                                          backend=b.backend, d=distributed.Dist(),
                                          backward=True)
        results.append((loss, counts, model.fc.weight.grad.clone()))
    (l1, c1, g1), (l2, c2, g2) = results
    assert l1.item() == pytest.approx(l2.item(), rel=1e-4)
    assert torch.allclose(g1, g2, rtol=1e-3, atol=1e-6)
    assert torch.equal(c1[1::4], c2[1::4])  # same positions counted


@pytest.mark.integration
def test_stage_script_runs_from_params(inputs, tmp_path):
    """stages/train.py with the dvc.yaml arguments, params read through for_stage('train')."""
    params = (ROOT / "params.yaml").read_text()
    params = re.sub(r"\n  epochs: \d+", "\n  epochs: 1", params).replace("batch_tokens: 2048",
                                                                         "batch_tokens: 512")
    (tmp_path / "params.yaml").write_text(params)
    # inside a git repo without DVC, plain dvclive would `dvc init` it: ours never touches DVC
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    r = subprocess.run(
        [sys.executable, str(ROOT / "stages" / "train.py"), "--params", "params.yaml",
         "--draft-config", str(inputs.draft_config), "--verifier", str(inputs.verifier),
         "--hidden", str(inputs.hidden), "--vocab", str(inputs.vocab), "--out",
         "artifacts/train", "--metrics-dir", "metrics/train", "--dvc-yaml", str(ROOT / "dvc.yaml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "artifacts" / "train" / "model.safetensors").is_file()
    assert (tmp_path / "metrics" / "train" / "metrics.json").is_file()
    assert not (tmp_path / ".dvc").exists() and not (tmp_path / "metrics" / "train" /
                                                     "dvc.yaml").exists()
    assert "acceptance length (training estimate)" in r.stderr  # stage.main logs to stderr


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_torchrun_ddp_path(inputs, tmp_path):
    """The multi-process path (torchrun, DDP, sharded packs, all-reduced eval, rank-0 writes) on
    CPU over gloo, as `dvc repro` launches it with train.nproc_per_node: 2; a launch that
    disagrees with train.nproc_per_node is refused. Two torchrun agents on localhost as two
    nodes (train.nnodes: 2, one process each), a second launch of the same world, give the
    same weights as the two processes on one node (test_parallel.py reruns a launch as is)."""
    import os
    import shutil
    import signal

    params = (ROOT / "params.yaml").read_text()
    params = re.sub(r"\n  epochs: \d+", "\n  epochs: 1", params).replace(
        "batch_tokens: 2048", "batch_tokens: 256").replace("threads: 2\n  device",
                                                            "threads: 1\n  device").replace(
        "nproc_per_node: 1", "nproc_per_node: 2")
    (tmp_path / "params.yaml").write_text(params)
    args = ["--params", "params.yaml", "--draft-config", str(inputs.draft_config),
            "--verifier", str(inputs.verifier), "--hidden", str(inputs.hidden), "--vocab",
            str(inputs.vocab), "--out", "artifacts/train", "--metrics-dir", "metrics/train",
            "--dvc-yaml", str(ROOT / "dvc.yaml"), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def torchrun(n: int):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", str(n), str(ROOT / "stages" / "train.py"),
                               *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=env)

    r = torchrun(2)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "device cpu x 2" in r.stderr
    ckpt = load_file(str(tmp_path / "artifacts" / "train" / "model.safetensors"))
    spec = archmod.contract(dataclasses.replace(inputs.arch, dtype="float32"), "speculators")
    assert sorted(ckpt) == sorted(spec)
    m = json.loads((tmp_path / "metrics" / "train" / "metrics.json").read_text())
    first = _tsv(tmp_path / "metrics" / "train" / "plots" / "metrics" / "eval" / "loss.tsv")[0][1]
    assert m["eval"]["loss"] < first
    first_weights = (tmp_path / "artifacts" / "train" / "model.safetensors").read_bytes()
    r = torchrun(1)  # one process while params say two
    assert r.returncode != 0 and "train.nproc_per_node is 2" in r.stderr, r.stderr[-2000:]

    # two nodes of one process each, on localhost: node 0 is the stage's own command line (it
    # becomes torchrun), node 1 runs what `eagle3pipe launch` prints, each in its own directory
    port = _free_port()
    two = params.replace("nproc_per_node: 2", "nproc_per_node: 1").replace(
        "nnodes: 1", "nnodes: 2").replace("rdzv_endpoint: null",
                                          f"rdzv_endpoint: 127.0.0.1:{port}")
    dvc_yaml = tmp_path / "dvc.yaml"
    stage_args = shlex.join([str(ROOT / "stages" / "train.py"), *args[:-3], "--dvc-yaml",
                           str(dvc_yaml), "--no-progress"])
    dvc_yaml.write_text(re.sub(r"cmd: python stages/train.py [^\n]*",
                               lambda _: f"cmd: python {stage_args}",
                               (ROOT / "dvc.yaml").read_text(), count=1))
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for d in nodes:
        d.mkdir()
        (d / "params.yaml").write_text(two)
    shown = subprocess.run([sys.executable, "-m", "eagle3pipe.tools.cli", "launch", "--params",
                            str(nodes[1] / "params.yaml"), "--dvc-yaml", str(dvc_yaml),
                            "--node-rank", "1"], capture_output=True, text=True, check=True)
    line = shlex.split(shown.stdout.strip())
    assert line[:3] == ["torchrun", "--nnodes", "2"] and "--node-rank" in line, line
    assert line[line.index("--master-port") + 1] == str(port)
    node1 = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *line[1:]],
                             cwd=nodes[1], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    r = subprocess.run([sys.executable, *shlex.split(stage_args)], cwd=nodes[0],
                       capture_output=True, text=True, timeout=600, env=env)
    out1 = node1.communicate(timeout=120)
    assert r.returncode == 0 and node1.returncode == 0, (r.stderr[-3000:], out1[1][-3000:])
    assert "device cpu x 2" in r.stderr
    assert (nodes[0] / "artifacts/train/model.safetensors").read_bytes() == first_weights
    assert not (nodes[1] / "artifacts").exists()  # rank 0, on node 0, alone publishes

    # a node that dies mid-training: node 0 fails with one message naming that, publishes
    # nothing; the run above, from the same directories, shows that a rerun is safe
    for out in ("artifacts", "metrics"):
        shutil.rmtree(nodes[0] / out, ignore_errors=True)
    long = re.sub(r"\n  epochs: \d+", "\n  epochs: 40", two)
    for d in nodes:
        (d / "params.yaml").write_text(long)
    node1 = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *line[1:]],
                             cwd=nodes[1], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    node0 = subprocess.Popen([sys.executable, *shlex.split(stage_args)], cwd=nodes[0],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=env)
    seen = []
    for text in node0.stderr:
        seen.append(text)
        if "step 0: eval loss" in text:  # both nodes are training
            os.killpg(node1.pid, signal.SIGKILL)
            break
    rest = node0.communicate(timeout=300)[1]
    node1.wait(timeout=60)
    err = "".join(seen) + rest
    assert node0.returncode != 0, err[-3000:]
    assert "another training process died or became unreachable" in err, err[-4000:]
    assert "eagle3pipe launch" in err and "fix: " in err, err[-3000:]
    assert not (nodes[0] / "artifacts").exists() and not (nodes[0] / "metrics" /
                                                          "train").exists()
