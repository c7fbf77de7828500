"""dvc.yaml is complete: every stage lists the code it runs, and the params it declares exist."""
from __future__ import annotations

from eagle3pipe import deps, graph
from eagle3pipe import params as P

from conftest import ROOT


def test_each_stage_lists_its_script_and_every_module_it_imports():
    stages = graph.load_stages(ROOT / "dvc.yaml")
    for name, body in stages.items():
        listed = {d if isinstance(d, str) else next(iter(d)) for d in body["deps"]}
        script = f"stages/{name}.py"
        assert script in listed, f"stage {name} does not list its own script {script}"
        missing = set(deps.closure(script, ROOT)) - listed
        assert not missing, f"dvc.yaml stage {name} runs {sorted(missing)} but does not list it"


def test_declared_params_are_schema_keys():
    leaves = P.leaf_keys()
    for name in graph.load_stages(ROOT / "dvc.yaml"):
        for key in P.declared_params(name, ROOT / "dvc.yaml"):
            assert any(k == key or k.startswith(key + ".") for k in leaves), \
                f"stage {name} declares {key}, which params.py does not define"


def test_invalidation_table_rows():
    """The promise in the README, as computed from dvc.yaml and the renderers."""
    t = graph.invalidation_table(ROOT / "dvc.yaml", ROOT / "params.yaml",
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
    assert "configs" not in t["verifier.embedded.train_steps"]
    assert "configs" in t["verifier.embedded.hidden_size"]
