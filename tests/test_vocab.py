"""The vocab stage: d2t/t2d from loss-masked token counts, speculators' convention."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3pipe.errors import ParamsAt
from eagle3pipe.draft import vocab_map
from eagle3pipe.stages.vocab import run as vocab
from eagle3pipe.data.samples import SamplesError
from eagle3pipe.draft.vocab_map import VocabError

ROOT = Path(__file__).resolve().parents[1]


def write_samples(path: Path, samples: list[tuple[list[int], list[int]]]) -> Path:
    with path.open("w") as fh:
        for i, (ids, mask) in enumerate(samples):
            fh.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": mask,
                                 "messages": []}) + "\n")
    return path


def targets(d2t: torch.Tensor) -> list[int]:
    return (torch.arange(len(d2t)) + d2t).tolist()


def test_mapping_holds_the_most_frequent_masked_tokens(tmp_path):
    # masked: 7 x5, 42 x4, 3 x3, 90 x2, 11 x2 (tie with 90: lower id wins), 60 x1
    # unmasked 99 is the most frequent token of all and must not count
    samples = [([99, 99, 99, 99, 99, 99, 7, 7, 7, 42, 42], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]),
               ([99, 99, 7, 7, 42, 42, 3, 3, 3, 90, 90, 11, 11, 60],
                [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])]
    f = write_samples(tmp_path / "train.jsonl", samples)
    counts, n = vocab.count_masked_tokens(f, 128, progress=False)
    assert n == 2 and counts == {7: 5, 42: 4, 3: 3, 90: 2, 11: 2, 60: 1}
    d2t, t2d = vocab.build_mapping(counts, 4, 128)
    assert d2t.dtype == torch.int64 and d2t.shape == (4,)
    assert t2d.dtype == torch.bool and t2d.shape == (128,)
    # target = draft + d2t[draft], ascending, exactly the ids t2d marks, in order
    assert targets(d2t) == torch.nonzero(t2d).flatten().tolist() == [3, 7, 11, 42]
    assert d2t.tolist() == [3, 6, 9, 39]  # offsets, not target ids (an all-zero d2t is wrong)
    st = vocab.stats(counts, d2t, n)
    assert st["masked_tokens"] == 17 and st["distinct_tokens_seen"] == 6
    assert st["masked_tokens_covered"] == 5 + 4 + 3 + 2 and st["filled"] == 0
    assert st["coverage"] == round(14 / 17, 6)


def test_same_as_speculators_and_fills_lowest_unused_ids(tmp_path):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts = {5: 3, 2: 3, 40: 1}
    d2t, t2d = vocab.build_mapping(counts, 6, 64)
    ref_d2t, ref_t2d = build_vocab_mappings_from_distribution(counts, 6, 64)
    assert torch.equal(d2t, ref_d2t) and torch.equal(t2d, ref_t2d)
    assert targets(d2t) == [0, 1, 2, 3, 5, 40]  # seen 2, 5, 40; filled 0, 1, 3
    st = vocab.stats(counts, d2t, 1)
    assert st["filled"] == 3 and st["coverage"] == 1.0
    # draft vocab == verifier vocab: identity mapping
    d2t, t2d = vocab.build_mapping(counts, 64, 64)
    assert d2t.abs().sum() == 0 and bool(t2d.all())


def test_build_writes_deterministic_files(tmp_path):
    samples = [([(i * 7) % 50 for i in range(30)], [i % 2 for i in range(30)]) for _ in range(3)]
    f = write_samples(tmp_path / "train.jsonl", samples)
    st = vocab.build(f, 16, 100, tmp_path / "a", progress=False)
    vocab.build(f, 16, 100, tmp_path / "b", progress=False)
    for name in ("vocab_map.safetensors", "stats.json", "d2t.npy", "t2d.npy"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    d2t, t2d = vocab_map.load(tmp_path / "a")
    assert targets(d2t) == torch.nonzero(t2d).flatten().tolist()
    assert json.loads((tmp_path / "a/stats.json").read_text()) == st
    # the names and format `speculators train --d2t-path/--t2d-path` reads, with its own loader
    from speculators.train.cli import _load_mappings

    d, t, n = _load_mappings(tmp_path / "a/d2t.npy", tmp_path / "a/t2d.npy", 16)
    assert torch.equal(d, d2t) and torch.equal(t, t2d) and n == 16


def test_draft_vocab_larger_than_vocab_refused(tmp_path):
    f = write_samples(tmp_path / "train.jsonl", [([1, 2], [1, 1])])
    with pytest.raises(VocabError, match=r"params.yaml:41: draft.draft_vocab_size: 65 "
                                         r"exceeds the verifier's vocab_size \(64\)"):
        vocab.build(f, 65, 64, tmp_path / "out", progress=False,
                    at=ParamsAt("params.yaml", {"draft.draft_vocab_size": 41}))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("line, message", [
    ('{"id": "b", "input_ids": [1, 2], "loss_mask": [1]}', "loss_mask must be a list of 0/1"),
    ('{"id": "b", "input_ids": [1, 70], "loss_mask": [1, 1]}',
     "token id 70 outside the verifier vocabulary"),
    ('{"id": "b", "input_ids": [1, 2], "loss_mask": [1, 2]}', "loss_mask must be a list of 0/1"),
    ('{"id": "b", "input_ids": [1, 2]', "invalid JSON"),
    ('{"id": "b", "loss_mask": [1]}', "missing key(s) ['input_ids']"),
])
def test_bad_dataset_lines_name_file_and_line(tmp_path, line, message):
    f = tmp_path / "train.jsonl"
    f.write_text('{"id": "a", "input_ids": [1], "loss_mask": [1]}\n' + line + "\n")
    with pytest.raises(SamplesError, match=re.escape(f"{f}:2: ") + ".*" + re.escape(message)):
        vocab.count_masked_tokens(f, 64, progress=False)


def test_empty_dataset_refused(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text("\n")
    with pytest.raises(VocabError, match="no samples"):
        vocab.count_masked_tokens(f, 64, progress=False)


@pytest.mark.integration
def test_stage_script_refuses_draft_vocab_larger_than_vocab(tmp_path):
    text = (ROOT / "params.yaml").read_text()
    assert text.count("draft_vocab_size: 1024") == 1
    (tmp_path / "params.yaml").write_text(text)
    config = tmp_path / "verifier" / "config.json"  # the fields VerifierInfo reads; vocab 512
    config.parent.mkdir()
    config.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 512}))
    lineno = next(i for i, l in enumerate(text.splitlines(), 1) if "draft_vocab_size:" in l)
    f = write_samples(tmp_path / "train.jsonl", [([1, 2], [1, 1])])
    r = subprocess.run([sys.executable, str(ROOT / "stages/vocab.py"), "--params", "params.yaml",
                        "--dvc-yaml", str(ROOT / "dvc.yaml"), "--dataset", str(f),
                        "--verifier-config", str(config),
                        "--out", "vocab"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert f"params.yaml:{lineno}: draft.draft_vocab_size: 1024 exceeds" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "vocab").exists()
