"""engines/forward_check.py: an exported draft computes the same logits in vLLM's draft class as in
speculators' Eagle3DraftModel, at every speculative step, for every combination of the EAGLE-3.1
switches and decoder layers, in both export layouts; and the gate fails, naming the step and the
size, when a config switch reaches only one side."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3pipe.draft import arch as A
from eagle3pipe.engines import forward_check as fc
from eagle3pipe.runtime.jsonio import dumps
from helpers import drafts
from helpers.micro import engine_settings

pytestmark = pytest.mark.integration  # vLLM's draft classes on exported drafts

K = 3  # speculative steps, as the micro pipeline serves
T = 8  # prefix length
NORMS = ("none", "norm_before_fc", "fc_norm")
COMBOS = [(norm, out, layer) for layer in ("llama", "qwen3") for norm in NORMS
          for out in (False, True)]


def switched_arch(verifier_dir: Path, *, norm: str, norm_output: bool, layer: str
                  ) -> A.DraftArch:
    """The micro draft with the switches: norm in NORMS, norm_output, the decoder layer."""
    return replace(drafts.micro_arch(verifier_dir), draft_arch=layer,
                   norm_before_fc=norm == "norm_before_fc", fc_norm=norm == "fc_norm",
                   norm_output=norm_output)


def switched_weights(arch: A.DraftArch, layout: str, *, seed: int = 0
                     ) -> dict[str, torch.Tensor]:
    """drafts.make_weights (every tensor of arch.contract, the switches' input_norm [3H],
    fc_norm.i [H] and Qwen3 q/k norms [head_dim] included), every norm weight drawn from
    U(0.5, 1.5): none is 1, so a norm one side skips shows. Same values in both layouts."""
    t = drafts.make_weights(arch, layout, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name in sorted(t, key=lambda n: A.rename(n, layout, "speculators")):
        if "norm" in name:
            t[name] = 0.5 + torch.rand(t[name].shape, generator=g)
    return t


def write_switched_export(root: Path, verifier: Path, *, norm: str, norm_output: bool,
                          layer: str) -> Path:
    """root/{speculators,vllm}/{config.json, model.safetensors}, as the export stage lays it."""
    arch = switched_arch(verifier, norm=norm, norm_output=norm_output, layer=layer)
    for layout in A.LAYOUTS:
        out = root / layout
        out.mkdir(parents=True, exist_ok=True)
        t = switched_weights(arch, layout)
        save_file({k: v.contiguous() for k, v in sorted(t.items())},
                  str(out / "model.safetensors"))
        cfg = drafts.config_for(arch, layout, verifier_dir=verifier, num_speculative_tokens=K)
        (out / "config.json").write_text(dumps(cfg))
    return root


def edit_config(draft_dir: Path, edit) -> None:
    """Applies `edit` to draft_dir/config.json (the weights stay as they are)."""
    path = draft_dir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(dumps(cfg))


@pytest.fixture(scope="module")
def inputs(micro_verifier):
    return fc.random_inputs(micro_verifier, length=T, seed=0)


def _compare(verifier, draft_dir, inputs, **kw) -> fc.Report:
    hidden, ids = inputs
    return fc.compare(engine_settings(), verifier, draft_dir, hidden_states=hidden,
                      input_ids=ids, steps=K, **kw)


@pytest.mark.parametrize("norm,norm_output,layer", COMBOS,
                         ids=[f"{n}-{'normout' if o else 'prenorm'}-{l}" for n, o, l in COMBOS])
def test_vllm_computes_what_speculators_trains(micro_verifier, tmp_path, inputs, norm,
                                               norm_output, layer):
    root = write_switched_export(tmp_path / "export", micro_verifier, norm=norm,
                                 norm_output=norm_output, layer=layer)
    for layout in A.LAYOUTS:
        rep = _compare(micro_verifier, root / layout, inputs)
        print(rep.summary())
        assert rep.load_problems == [], rep.load_problems
        assert rep.architecture == {"llama": "Eagle3LlamaForCausalLM",
                                    "qwen3": "Eagle3Qwen3ForCausalLM"}[layer]
        assert rep.reference.endswith("speculators/config.json")
        assert [d.step for d in rep.steps] == [1, 2, 3] and rep.prefix.positions == T
        assert rep.ok, rep.summary()


@pytest.mark.parametrize("layout", A.LAYOUTS)
def test_norm_output_flipped_in_the_export_fails_on_step_2(micro_verifier, tmp_path, inputs,
                                                           layout):
    """Weights unchanged, norm_output flipped in the served config.json: step 1 is the same
    (its logits are lm_head(norm(h)) either way), step 2 gets another hidden input."""
    root = write_switched_export(tmp_path / "export", micro_verifier, norm="fc_norm",
                                 norm_output=True, layer="llama")
    trained = json.loads((root / "speculators" / "config.json").read_text())
    edit_config(root / layout, lambda c: c.update(norm_output=False))
    rep = _compare(micro_verifier, root / layout, inputs, reference=trained)
    print(rep.summary())
    assert not rep.ok
    assert rep.prefix.ok(rep.tolerance) and rep.steps[0].ok(rep.tolerance)
    assert rep.steps[0].max_rel < 1e-5
    assert rep.first_failure is rep.steps[1] and rep.steps[1].max_rel > 1e-2
    assert "differ from step 2" in rep.summary()
    assert f"step 2: max |diff| {rep.steps[1].max_abs:.3g}" in rep.summary()


def test_flat_config_without_norm_before_fc_fails(micro_verifier, tmp_path, inputs):
    """vLLM reads norm_before_fc from the flat config (llama_eagle3.py LlamaModel.__init__):
    without it vLLM builds no input_norm and drops its tensor, speculators applies it."""
    root = write_switched_export(tmp_path / "export", micro_verifier, norm="norm_before_fc",
                                 norm_output=False, layer="llama")
    removed = []
    edit_config(root / "vllm", lambda c: removed.extend(
        [c.pop("norm_before_fc", None), (c.get("eagle_config") or {}).pop("norm_before_fc", None)]))
    assert True in removed  # the export said so, where vLLM reads it
    rep = _compare(micro_verifier, root / "vllm", inputs)  # reference: ../speculators
    print(rep.summary())
    assert not rep.ok and rep.first_failure.step == 1
    assert rep.steps[0].max_rel > 1e-2
    assert "differ from step 1" in rep.summary()
    assert any("input_norm.weight was never loaded" in p for p in rep.load_problems)


def test_inputs_that_do_not_fit_the_draft_are_refused(micro_verifier, tmp_path, inputs):
    root = write_switched_export(tmp_path / "export", micro_verifier, norm="none",
                                 norm_output=False, layer="llama")
    hidden, ids = inputs
    with pytest.raises(fc.ForwardCheckError, match=r"expected \[T, 192\].*\n    fix: "):
        fc.compare(engine_settings(), micro_verifier, root / "vllm",
                   hidden_states=hidden[:, :64], input_ids=ids, steps=K)
    (root / "speculators" / "config.json").unlink()
    with pytest.raises(fc.ForwardCheckError, match="cannot read the draft.s training config"):
        fc.compare(engine_settings(), micro_verifier, root / "vllm", hidden_states=hidden,
                   input_ids=ids, steps=K)


def test_identical_logits_agree_whatever_their_size():
    """A draft whose logits are all 0 (the smoke stage's positive control: final norm zero)
    computes the same on both sides: no relative figure divides by its zero scale."""
    zeros = torch.zeros(4, 8)
    d = fc._diff(1, zeros, zeros.clone())
    assert (d.max_abs, d.max_rel, d.agree) == (0.0, 0.0, 4) and d.ok(fc.TOLERANCE)
    off = fc._diff(1, zeros, zeros + torch.tensor([0.0] * 7 + [1e-3]))
    assert off.max_rel == 1.0 and not off.ok(fc.TOLERANCE)
