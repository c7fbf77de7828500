"""dvc.yaml is complete: every stage lists the code it runs, and the params it declares exist."""
from __future__ import annotations

import pytest

from eagle3pipe.tools import deps
from eagle3pipe.tools import invalidation as graph
from eagle3pipe.config import dvcfile

from helpers.micro import ROOT


def test_each_stage_lists_exactly_its_script_and_the_modules_it_imports():
    """`eagle3pipe deps --write` generates these; a stale extra reruns a stage for nothing, a
    missing one lets a code change go unnoticed."""
    stages = dvcfile.stages(ROOT / "dvc.yaml")
    for name, body in stages.items():
        listed = {d if isinstance(d, str) else next(iter(d)) for d in body["deps"]}
        script = f"stages/{name}.py"
        assert script in listed, f"stage {name} does not list its own script {script}"
    assert deps.sync(ROOT / "dvc.yaml") == [], "run `eagle3pipe deps --write`"


def test_deps_write_fixes_a_stale_dvc_yaml(tmp_path):
    import shutil

    for d in ("src", "stages"):
        shutil.copytree(ROOT / d, tmp_path / d)
    text = (ROOT / "dvc.yaml").read_text()
    stale = text.replace("      - src/eagle3pipe/stages/vocab/run.py\n", "      - src/eagle3pipe/verifier/embedded.py\n", 1)
    assert stale != text
    (tmp_path / "dvc.yaml").write_text(stale)
    assert deps.sync(tmp_path / "dvc.yaml") == ["vocab: +src/eagle3pipe/stages/vocab/run.py",
                                                 "vocab: -src/eagle3pipe/verifier/embedded.py"]
    deps.sync(tmp_path / "dvc.yaml", write=True)
    assert (tmp_path / "dvc.yaml").read_text() == text


def test_declared_params_are_schema_keys():
    from eagle3pipe.config import params as P

    leaves = P.leaf_keys()
    for name in dvcfile.stages(ROOT / "dvc.yaml"):
        for key in dvcfile.declared_params(name, ROOT / "dvc.yaml"):
            assert any(k == key or k.startswith(key + ".") for k in leaves), \
                f"stage {name} declares {key}, which params.py does not define"


@pytest.mark.integration
def test_invalidation_table_rows():
    """The promise in the README, as computed from dvc.yaml and the renderers."""
    t = graph.invalidation_table(ROOT / "dvc.yaml", ROOT / "tests/data/params.yaml",
                                 ROOT / "tests/data/verifier_config.json")
    assert t["draft.head_dim"] == ["configs", "train", "export", "smoke"]
    assert t["draft.aux_layer_ids"] == ["configs", "extract", "train", "export", "smoke"]
    assert t["draft.draft_vocab_size"] == ["configs", "vocab", "train", "export", "smoke"]
    assert t["draft.num_speculative_tokens"] == ["configs", "export", "smoke"]
    assert t["draft.dtype"] == ["configs", "export", "smoke"]
    assert t["train.learning_rate"] == ["train", "export", "smoke"]
    assert t["smoke.max_tokens"] == ["smoke"]
    assert t["extract.dtype"] == ["extract", "train", "export", "smoke"]
    assert t["verifier.hash_mode"] == ["verifier"]
    # every engine that runs the verifier reads the vllm: section, and what they feed follows;
    # configs renders the serving recipe from it (configs/serve/, which no stage reads)
    for key in ("vllm.tensor_parallel_size", "vllm.dtype", "vllm.gpu_memory_utilization"):
        assert t[key] == ["configs", "dataset", "vocab", "extract", "train", "export", "smoke"], key
    assert t["train.nproc_per_node"] == ["train", "export", "smoke"]
    # the EAGLE-3.1 switches and the layer type: configs, then what reads the rendered configs
    for key in ("draft.norm_before_fc", "draft.fc_norm", "draft.norm_output", "draft.draft_arch"):
        assert t[key] == ["configs", "train", "export", "smoke"], key
    assert "configs" not in t["verifier.embedded.train_steps"]
    assert "configs" in t["verifier.embedded.hidden_size"]


@pytest.mark.integration
def test_docs_show_the_generated_table():
    """docs/invalidation.md holds `python -m eagle3pipe.tools.invalidation`'s output as it is now."""
    t = graph.invalidation_table(ROOT / "dvc.yaml", ROOT / "params.yaml")
    table = graph.markdown(t, list(dvcfile.stages(ROOT / "dvc.yaml")))
    assert table in (ROOT / "docs/invalidation.md").read_text(), \
        "regenerate it: python -m eagle3pipe.tools.invalidation"
