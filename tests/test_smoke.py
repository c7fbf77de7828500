"""The `smoke` stage: real vLLM (engine-less load check and in-process engines) on real draft
checkpoints written by tests/helpers/drafts.py for the micro verifier.

Engines run in a subprocess (the stage's CLI): vLLM's CPU worker replaces torch.set_num_threads
process-wide, which must not leak into other tests.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from helpers import drafts
from eagle3pipe.data import prompts
from eagle3pipe.stages.smoke import acceptance
from eagle3pipe.stages.smoke import run as smoke
from eagle3pipe.stages.smoke import agreement as smoke_agreement
from eagle3pipe.stages.smoke import inputs as smoke_inputs
from eagle3pipe.stages.smoke import speed
from eagle3pipe.errors import EXIT_INPUT, ParamsAt

from helpers.micro import engine_settings

ROOT = Path(__file__).resolve().parents[1]
K = drafts.MICRO_DRAFT["num_speculative_tokens"]
# 1 prefill token + 8 full speculative steps of k+1 tokens: every step proposes k drafts
MAX_TOKENS = 1 + 8 * (K + 1)


# ---------------------------------------------------------------------------------------------
# pure parts (no vLLM)


def test_k_is_the_exported_serving_default(micro_verifier, tmp_path):
    arch = drafts.micro_arch(micro_verifier)
    drafts.write_export(tmp_path / "export", arch, verifier_dir=micro_verifier,
                        num_speculative_tokens=5)
    assert smoke_inputs.speculative_tokens(tmp_path / "export") == 5
    cfg_path = tmp_path / "export" / "speculators" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(smoke_inputs.SmokeError, match=r"speculators/config.json.*speculative_tokens"):
        smoke_inputs.speculative_tokens(tmp_path / "export")


def test_missing_export_names_the_file(micro_verifier, tmp_path):
    arch = drafts.micro_arch(micro_verifier)
    drafts.write_export(tmp_path / "export", arch, verifier_dir=micro_verifier)
    (tmp_path / "export" / "vllm" / "model.safetensors").unlink()
    with pytest.raises(smoke_inputs.SmokeError, match=r"export/vllm: model.safetensors missing"):
        smoke_inputs.export_dirs(tmp_path / "export")


def test_acceptance_from_counters():
    r = acceptance.acceptance({"drafts": 10, "draft_tokens": 30, "accepted_tokens": 17,
                          "accepted_per_position": [9, 5, 3]}, 3, 57)
    assert r == {"mean_acceptance_length": 2.7, "acceptance_rate_per_position": [0.9, 0.5, 0.3],
                 "num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 17,
                 "tokens_generated": 57}
    assert acceptance.acceptance({"drafts": 3, "accepted_tokens": 1}, 2, 4)[
        "mean_acceptance_length"] == 1.3333
    none = acceptance.acceptance({}, 3, 0)
    assert none["mean_acceptance_length"] == 1.0 and none["num_drafts"] == 0
    rows = smoke.plot_rows({"vllm": r, "ngram": none})
    assert rows[0] == {"position": 1, "ngram": 0.0, "vllm": 0.9}
    assert [x["position"] for x in rows] == [1, 2, 3]


def test_mismatch_names_prompt_and_position():
    ref = [[1, 2, 3, 4], [5, 6, 7]]
    assert acceptance.mismatches(ref, [[1, 2, 3, 4], [5, 6, 7]]) == []
    diff = acceptance.mismatches(ref, [[1, 2, 9, 4], [5, 6, 7]])
    assert len(diff) == 1 and diff[0].startswith("prompt 0: first difference at output token 2")
    assert acceptance.mismatches(ref, [[1, 2, 3, 4], [5, 6]])[0].startswith("prompt 1:")


def test_draft_helper_writes_what_the_contract_check_accepts(micro_verifier, tmp_path):
    from eagle3pipe.draft import checkpoint as check

    arch = drafts.micro_arch(micro_verifier)
    drafts.write_export(tmp_path / "export", arch, verifier_dir=micro_verifier)
    for layout in ("vllm", "speculators"):
        assert check.check_checkpoint(tmp_path / "export" / layout, arch) == []


def test_k_sweep_is_checked_and_includes_the_serving_k():
    import types

    def ks(sweep):
        return smoke_inputs.sweep_ks(types.SimpleNamespace(k_sweep=sweep), 3,
                                     ParamsAt("params.yaml", {"smoke.k_sweep": 99}))

    assert ks([5, 1, 2]) == [1, 2, 3, 5] and ks([]) == []
    with pytest.raises(smoke_inputs.SmokeError, match=r"params.yaml:99: smoke.k_sweep: 0 is not a "
                                               r"positive integer[\s\S]*fix: list k values"):
        ks([1, 0])
    with pytest.raises(smoke_inputs.SmokeError, match=r"lists a k twice[\s\S]*fix: list each k once: "
                                               r"\[1, 2\]"):
        ks([1, 2, 1])


def _pass(seconds: dict, tokens: dict) -> speed.Pass:
    return speed.Pass([], seconds, tokens)


def test_speed_and_speedup_are_medians_with_their_spread():
    """Numbers given, not measured: tokens/s of each pass, its median/min/max, and the speedup
    as the ratio of medians with the per-round ratios' spread and the best-of ratio."""
    ref = [_pass({"a": 2.0, "b": 2.0}, {"a": 100, "b": 100}),  # 50 tokens/s
           _pass({"a": 1.0, "b": 1.0}, {"a": 100, "b": 100}),  # 100
           _pass({"a": 4.0, "b": 4.0}, {"a": 100, "b": 100})]  # 25
    fast = [_pass({"a": 1.0, "b": 1.0}, {"a": 100, "b": 100}),  # 100 (x2.0 in its round)
            _pass({"a": 1.0, "b": 0.25}, {"a": 100, "b": 100}),  # 160 (x1.6)
            _pass({"a": 1.0, "b": 3.0}, {"a": 100, "b": 100})]  # 50 (x2.0)
    s = speed.speed(ref)
    assert s["output_tokens_per_s"] == {"median": 50.0, "min": 25.0, "max": 100.0}
    assert s["ms_per_output_token"] == {"median": 20.0, "min": 10.0, "max": 40.0}
    assert s["seconds"] == [4.0, 2.0, 8.0]
    assert speed.speedup(fast, ref) == {"median": 2.0, "min": 1.6, "max": 2.0, "best": 1.6}
    # one domain: b's batches alone (50, 100, 25 vs 100, 400, 33.3 tokens/s)
    assert speed.speedup(fast, ref, ["b"])["median"] == 2.0
    assert speed.speed(fast, ["b"])["output_tokens_per_s"]["max"] == 400.0


def _served(rates):
    return {"mean_acceptance_length": 1 + sum(rates), "acceptance_rate_per_position": rates}


def test_agreement_compares_the_positions_both_sides_measure():
    """Serving is judged against training over min(k, ttt_steps) positions; only serving below
    training by more than the tolerance fails, with both figures and the likely causes."""
    trained = [0.9, 0.8, 0.7]
    rec, fail = smoke_agreement.compare(_served([0.88, 0.79, 0.69]), trained, 3,
                                        tolerance=0.1, prompts=8, replies_equal=8)
    assert fail is None and rec["positions"] == 3 and rec["training"]["tokens_per_step"] == 3.4
    assert rec["serving"]["tokens_per_step"] == 3.36 and rec["gap"] == round(0.04 / 3.4, 4)
    # k = 5 served, the trainer scored 3 positions: the first 3 are compared
    rec, fail = smoke_agreement.compare(_served([0.9, 0.8, 0.7, 0.6, 0.5]), trained, 5,
                                        tolerance=0.1, prompts=8, replies_equal=8)
    assert fail is None and rec["positions"] == 3 and rec["gap"] == 0.0
    # serving above training: recorded (negative gap), never a failure
    rec, fail = smoke_agreement.compare(_served([1.0, 1.0, 1.0]), trained, 3, tolerance=0.0,
                                        prompts=8, replies_equal=8)
    assert fail is None and rec["gap"] < 0
    rec, fail = smoke_agreement.compare(_served([0.5, 0.3, 0.1]), trained, 3, tolerance=0.1,
                                        prompts=8, replies_equal=3)
    assert rec["gap"] == round((3.4 - 1.9) / 3.4, 4)
    assert "1.9000 tokens per step" in fail and "estimated 3.4000" in fail and "44.1% lower" in fail
    assert "3/8 served replies equal the dataset's" in fail and "aux_layer_ids" in fail


def test_agreement_inputs_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(smoke_inputs.SmokeError, match=r"metrics.json: trainer metrics not "
                       r"found; run `dvc repro train`"):
        smoke_agreement.read_training(tmp_path / "metrics.json")
    (tmp_path / "metrics.json").write_text('{"eval": {"loss": 1.0}}')
    with pytest.raises(smoke_inputs.SmokeError, match=r"no eval.acc_pos0[\s\S]*fix: keep "
                       r"dataset.eval_fraction > 0"):
        smoke_agreement.read_training(tmp_path / "metrics.json")
    (tmp_path / "metrics.json").write_text('{"eval": {"acc_pos0": 0.5, "acc_pos1": 0.25}}')
    assert smoke_agreement.read_training(tmp_path / "metrics.json") == [0.5, 0.25]
    (tmp_path / "eval.jsonl").write_text("")
    with pytest.raises(smoke_inputs.SmokeError, match=r"eval split is empty[\s\S]*fix: set "
                       r"dataset.eval_fraction > 0"):
        smoke_agreement.read_eval(tmp_path, 4, 100, 64, 3)
    row = {"id": "s-1", "input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 0, 1]}
    (tmp_path / "eval.jsonl").write_text(json.dumps(row) + "\n")
    [p] = smoke_agreement.read_eval(tmp_path, 4, 100, 64, 3)
    assert (p.ids, p.reply, p.source) == ([5, 6], [7, 8], "s-1")  # the first reply only
    with pytest.raises(smoke_inputs.SmokeError, match=r"vllm.max_model_len 6 is shorter than "
                       r"eval sample s-1 \(4 tokens\) \+ k \+ 1 = 8"):
        smoke_agreement.read_eval(tmp_path, 4, 100, 6, 3)


def _tokenizer(verifier):
    from eagle3pipe.verifier.handle import Verifier

    return Verifier(verifier).tokenizer()


def _line(messages, **extra) -> str:
    return json.dumps({"messages": messages, **extra})


USER = [{"role": "user", "content": "def add(a, b):"}]
# (what the line holds, the message it must give: each names file:line and has a fix)
BAD_PROMPT_LINES = [
    ("not JSON", '{"messages": [', r"not valid JSON"),
    ("not UTF-8", b'{"messages": "\xff"}', r"not UTF-8"),
    ("an array", "[1, 2]", r"the line is a JSON array, not an object"),
    ("no messages", '{"domain": "code"}', r'no "messages"'),
    ("messages not a list", '{"messages": "hi"}', r'"messages" is a JSON string'),
    ("empty messages", '{"messages": []}', r'"messages" is empty'),
    ("a bad role", _line([{"role": "tool", "content": "x"}]),
     r"messages\[0\]\.role is 'tool', not one of system, user, assistant"),
    ("content not a string", _line([{"role": "user", "content": 3}]),
     r"messages\[0\]\.content is 3, not a string"),
    ("ends with the assistant", _line(USER + [{"role": "assistant", "content": "x"}]),
     r"the last turn is 'assistant'"),
    ("an empty domain", _line(USER, domain=""), r'"domain" is \'\', not a non-empty string'),
    ("a numeric domain", _line(USER, domain=7), r'"domain" is \'7\', not a non-empty string'),
]


@pytest.mark.parametrize("what,line,message", BAD_PROMPT_LINES,
                         ids=[c[0] for c in BAD_PROMPT_LINES])
def test_bad_prompt_line_names_file_line_and_fix(micro_verifier, tmp_path, what, line,
                                                 message):
    path = tmp_path / "prompts" / "bad.jsonl"
    path.parent.mkdir()
    raw = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(_line(USER, domain="ok").encode() + b"\n\n" + raw + b"\n")
    with pytest.raises(prompts.PromptsError) as e:
        prompts.read_prompts(path, _tokenizer(micro_verifier), 10, {},
                             ParamsAt("params.yaml", {"smoke.prompts": 7}))
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and re.search(message, msg), msg
    assert "smoke.prompts at params.yaml:7" in msg and "\n    fix: " in msg, msg


def test_prompts_file_domains_limit_and_bom(micro_verifier, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join([
        _line(USER, domain="code"), "", _line([{"role": "system", "content": "be brief"},
                                              *USER]),
        _line(USER, domain="code"), _line(USER, domain="never read")]).encode())
    got = prompts.read_prompts(path, _tokenizer(micro_verifier), 3, {})
    assert [(p.domain, p.source) for p in got] == [
        ("code", f"{path}:1"), ("default", f"{path}:3"), ("code", f"{path}:4")]
    assert len(got[1].ids) > len(got[0].ids)  # the system turn is in the prompt
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(prompts.PromptsError, match=r"empty.jsonl: no prompt in it"):
        prompts.read_prompts(empty, _tokenizer(micro_verifier), 3, {})


def test_mtbench_prompts_are_first_turns_by_category(micro_verifier, tmp_path):
    """smoke.prompts_format: mtbench reads MT-Bench's question.jsonl: each row's first turn is a
    prompt (a later turn would answer the verifier's own reply), its category the domain; a
    bad row is an error naming file:line, both keys and the row the format expects."""
    tok = _tokenizer(micro_verifier)
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Shorter."]},
        {"question_id": 2, "turns": ["def f(x):"]}]) + "\n")
    got = prompts.read_prompts(path, tok, 5, {}, fmt="mtbench")
    assert [(p.domain, p.source) for p in got] == [("writing", f"{path}:1"),
                                                   ("default", f"{path}:2")]
    assert got[0].ids == prompts.template_ids(tok, [{"role": "user", "content": "Write a haiku."}],
                                              add_generation_prompt=True, template_kwargs={})
    path.write_text('{"question_id": 1, "turns": "one"}\n')
    with pytest.raises(prompts.PromptsError) as e:
        prompts.read_prompts(path, tok, 5, {}, ParamsAt("params.yaml", {"smoke.prompts": 7}),
                             fmt="mtbench")
    msg = str(e.value)
    assert msg.startswith(f"{path}:1: ") and '"turns" is a JSON string, not a list' in msg, msg
    assert "smoke.prompts at params.yaml:7, smoke.prompts_format mtbench" in msg, msg
    assert '"turns": ["...", ...]' in msg, msg
    with pytest.raises(prompts.PromptsError, match=r'no "messages"'):  # the other format's rows
        prompts.read_prompts(path, tok, 5, {})


def test_prompts_must_lie_in_the_stages_dvc_dep(tmp_path, monkeypatch):
    """smoke.prompts is a file in prompts/, the directory dvc.yaml lists as a dep of the smoke
    stage: editing it reruns the stage. A file elsewhere would not, so it is refused."""
    from ruamel.yaml import YAML as _YAML

    body = _YAML(typ="safe").load((ROOT / "dvc.yaml").read_text())["stages"]["smoke"]
    assert prompts.PROMPTS_DIR in body["deps"]
    assert (ROOT / prompts.PROMPTS_DIR).is_dir()  # a fresh clone has it (DVC needs the dep)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "x.jsonl").write_text(_line(USER) + "\n")
    (tmp_path / "elsewhere.jsonl").write_text(_line(USER) + "\n")
    assert prompts.prompts_path("prompts/x.jsonl") == Path("prompts/x.jsonl")
    assert prompts.prompts_path("./prompts/x.jsonl") == Path("prompts/x.jsonl")
    for bad in ("elsewhere.jsonl", str(tmp_path / "prompts" / "x.jsonl"),
                "prompts/../elsewhere.jsonl", "prompts"):
        with pytest.raises(prompts.PromptsError, match=r"params.yaml:3: smoke.prompts: .* is "
                                                       r"not inside prompts/[\s\S]*fix: put"):
            prompts.prompts_path(bad, ParamsAt("params.yaml", {"smoke.prompts": 3}))
    with pytest.raises(prompts.PromptsError, match=r"prompts/y.jsonl not found"):
        prompts.prompts_path("prompts/y.jsonl")


def test_wall_clock_outputs_stay_out_of_dvc_lock():
    """The timing file and the speedup plot are listed by `dvc metrics show` / `dvc plots
    show` (top-level entries) but are no stage's output: dvc.lock holds only deterministic
    hashes, and no stage can depend on a timing."""
    from ruamel.yaml import YAML as _YAML

    doc = _YAML(typ="safe").load((ROOT / "dvc.yaml").read_text())
    outs = {o if isinstance(o, str) else next(iter(o)) for body in doc["stages"].values()
            for kind in ("outs", "metrics", "plots") for o in body.get(kind) or []}
    timing = f"metrics/{smoke.TIMING_NAME}"
    speedup = f"plots/{smoke.K_SPEEDUP_NAME}"
    assert timing not in outs and speedup not in outs
    assert f"plots/{smoke.K_ACCEPTANCE_NAME}" in outs  # deterministic: a stage output
    assert timing in doc["metrics"]
    plotted = {f for p in doc["plots"] for d in p.values() for f in d["y"]}
    assert {speedup, f"plots/{smoke.K_ACCEPTANCE_NAME}"} <= plotted
    assert all(next(iter(p.values()))["x"] == "k" for p in doc["plots"]
               if next(iter(p)) in ("smoke_k_acceptance", "smoke_k_speedup"))


# ---------------------------------------------------------------------------------------------
# engine-less load check (vLLM's model class and weight loader, no engine)


def _check(verifier, draft_dir):
    from eagle3pipe.engines import load_check as vllm_load

    return vllm_load.check_draft(engine_settings(), verifier, draft_dir,
                                 num_speculative_tokens=K)


@pytest.mark.parametrize("draft_vocab", [256, 96], ids=["vocab256", "vocab96-padded-by-vllm"])
def test_engineless_both_formats_load(micro_verifier, tmp_path, draft_vocab):
    """96 rows: vLLM pads lm_head to 128 rows; the padding is neither loaded nor a problem."""
    from eagle3pipe.draft import arch as A

    arch = drafts.micro_arch(micro_verifier, draft_vocab_size=draft_vocab)
    drafts.write_export(tmp_path / "export", arch, verifier_dir=micro_verifier)
    for layout in ("vllm", "speculators"):
        rep = _check(micro_verifier, tmp_path / "export" / layout)
        assert rep.problems == [], rep.problems
        assert rep.architecture == "Eagle3LlamaForCausalLM"
        assert rep.shared_embedding  # no embed_tokens in the export: vLLM shares the verifier's
        # every contract tensor but t2d (vLLM skips it by design) went through a weight loader
        assert rep.loaded_tensors == sorted(set(A.contract(arch, layout)) - {"t2d"})


def test_engineless_catches_weights_built_for_another_head_dim(micro_verifier, tmp_path):
    """vLLM silently narrows head_dim-64 weights under a config saying 32."""
    from eagle3pipe.draft import checkpoint as check

    arch = drafts.micro_arch(micro_verifier)
    assert arch.head_dim == 32
    d = drafts.write_draft(tmp_path / "hd64", arch, "vllm", verifier_dir=micro_verifier,
                           weights_arch=drafts.with_head_dim(arch, 64))
    rep = _check(micro_verifier, d)
    text = "\n".join(rep.problems)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert re.search(rf"tensor midlayer\.self_attn\.{proj}\.weight has shape .* trim", text), \
            text
    assert "[128, 128] but vLLM's model.layers.0.self_attn.qkv_proj.weight (shard 'q') holds " \
           "[64, 128]" in text
    # the contract check flags the same tensors, with the reason
    problems = "\n".join(check.check_checkpoint(d))
    assert "midlayer.self_attn.q_proj.weight has shape [128, 128]" in problems
    assert "head_dim=32" in problems


def test_engineless_catches_missing_fc(micro_verifier, tmp_path):
    arch = drafts.micro_arch(micro_verifier)
    for layout in ("vllm", "speculators"):
        d = drafts.write_draft(tmp_path / layout, arch, layout, verifier_dir=micro_verifier,
                               omit=("fc.weight",))
        rep = _check(micro_verifier, d)
        assert len(rep.problems) == 1, rep.problems
        assert "model.fc.weight [64, 192]: 12288 of 12288 values never loaded" in \
            rep.problems[0]
        assert "(fc.weight missing" in rep.problems[0]


def test_engineless_catches_missing_lm_head(micro_verifier, tmp_path):
    """Without lm_head vLLM would use the verifier's (512 rows) for a 256-row draft vocab."""
    arch = drafts.micro_arch(micro_verifier)
    d = drafts.write_draft(tmp_path / "d", arch, "vllm", verifier_dir=micro_verifier,
                           omit=("lm_head.weight",))
    (problem,) = _check(micro_verifier, d).problems
    assert "lm_head.weight [256, 64]" in problem and "verifier's lm_head" in problem


def test_engineless_reports_vllms_own_error_for_four_aux_layers(micro_verifier, tmp_path):
    """vLLM's fc input is fixed at 3 aux layers: an fc built for 4 fails loudly in vLLM."""
    import torch

    arch = drafts.micro_arch(micro_verifier)

    def fc_for_four(t):
        t["fc.weight"] = torch.zeros(arch.hidden_size, 4 * arch.target_hidden_size)

    d = drafts.write_draft(tmp_path / "d", arch, "vllm", verifier_dir=micro_verifier,
                           edit=fc_for_four)
    (problem,) = _check(micro_verifier, d).problems
    assert "vLLM failed while running vLLM's weight loader" in problem
    assert "[64, 256]" in problem and "[64, 192]" in problem


def test_stage_fails_before_any_engine_on_a_broken_export(micro_verifier, tmp_path,
                                                          monkeypatch):
    import types

    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "")  # restored after the test
    arch = drafts.micro_arch(micro_verifier)
    drafts.write_export(tmp_path / "export", arch, verifier_dir=micro_verifier,
                        omit=("fc.weight",))
    s = types.SimpleNamespace(num_prompts=2, max_tokens=8,
                              min_acceptance_length=1.0, min_gain_over_ngram=0.0,
                              ngram_prompt_lookup_min=1, ngram_prompt_lookup_max=4, seed=0,
                              threads=2, snippet_lines=[4, 12], snippet_max_chars=600,
                              prompts=None, k_sweep=[1, 3], timing_rounds=1,
                              batch1_prompts=1, agreement_prompts=2, max_train_serve_gap=0.1)
    dataset, train_metrics = _agreement_inputs(tmp_path, micro_verifier, [1.0] * K)
    with pytest.raises(smoke_inputs.SmokeError) as e:
        smoke.measure(s, engine_settings(), template_kwargs={}, export_dir=tmp_path / "export",
                      verifier_dir=micro_verifier, dataset_dir=dataset,
                      train_metrics=train_metrics, plots_path=tmp_path / "p.json")
    msg = str(e.value)
    assert "engine-less vLLM load check failed" in msg
    assert "export/vllm" in msg and "export/speculators" in msg and "fc.weight missing" in msg
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "p.json").exists()


# ---------------------------------------------------------------------------------------------
# the engine helper (subprocess: it leaves vLLM's process-wide state behind by design)

ENGINE_PROBE = """
import gc, json, os, sys
import torch
from eagle3pipe.engines import engine
from helpers.micro import engine_settings

torch.set_num_threads(3)
original = torch.set_num_threads
with engine.engine(engine_settings(), sys.argv[1], threads=2) as llm:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    made = [None]
    made[0] = made
    engine.refreeze()  # an engine is alive: its objects stay collectable, nothing is frozen
    inside = {"threads": torch.get_num_threads(), "no_op": torch.set_num_threads is not original,
              "frozen": gc.get_freeze_count() > 0, "dtype": str(llm.llm_engine.model_config.dtype),
              "in_process": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"],
              "refroze_alive": not any(o is made for o in gc.get_objects())}
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])],
                       SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
after = {"threads": torch.get_num_threads(), "restored": torch.set_num_threads is original,
         "frozen": gc.get_freeze_count(), "engine": llm.llm_engine}
torch.set_num_threads(1)
after["threads_settable"] = torch.get_num_threads() == 1
print(json.dumps({"inside": inside, "after": after, "tokens": len(out[0].outputs[0].token_ids)}))
"""


@pytest.mark.slow
def test_engine_helper_restores_what_vllm_changes(micro_verifier, tmp_path):
    """vllm_load.engine: the dtype it is given, an in-process engine in a frozen heap, and on
    exit torch's thread count and a working torch.set_num_threads (vLLM's CPU worker makes it a
    no-op), an unfrozen heap and the engine released."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    r = subprocess.run([sys.executable, "-c", ENGINE_PROBE, str(micro_verifier)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # float32 as given: vLLM's "auto" would have downcast the float32 checkpoint
    # what is made while an engine is alive is never frozen (engine.refreeze)
    assert got["inside"] == {"threads": 2, "no_op": True, "frozen": True,
                             "dtype": "torch.float32", "in_process": "0",
                             "refroze_alive": False}, got
    assert got["tokens"] == 4
    assert got["after"] == {"threads": 2, "restored": True, "frozen": 0, "engine": None,
                            "threads_settable": True}, got


# ---------------------------------------------------------------------------------------------
# the stage with real engines (subprocess: the stage's own CLI)


def _params(tmp_path: Path, **smoke_overrides) -> Path:
    """The default params.yaml with a small smoke section: 2 prompts, no k sweep, 1 timed
    round, unless overridden."""
    yaml = YAML(typ="rt")
    doc = yaml.load((ROOT / "params.yaml").read_text())
    small = dict(num_prompts=2, max_tokens=MAX_TOKENS, k_sweep=[], timing_rounds=1,
                 batch1_prompts=0, agreement_prompts=2)
    for k, v in {**small, **smoke_overrides}.items():
        doc["smoke"][k] = v
    out = tmp_path / "params.yaml"
    with out.open("w") as fh:
        yaml.dump(doc, fh)
    return out


def _agreement_inputs(tmp_path: Path, verifier: Path, trained: list[float],
                      n: int = 2) -> tuple[Path, Path]:
    """An eval split of `n` chat prompts, each with a reply of MAX_TOKENS id-0 tokens (what
    the zero-norm verifier generates), in the dataset stage's format, and the trainer's metrics
    file with acc_pos{i} = trained[i]."""
    from eagle3pipe.data.samples import write_jsonl

    tok = _tokenizer(verifier)
    rows = []
    for i in range(n):
        ids = prompts.template_ids(tok, [{"role": "user", "content": f"def f{i}(x):"}],
                                   add_generation_prompt=True, template_kwargs={})
        rows.append({"id": f"t-{i}", "input_ids": ids + [0] * MAX_TOKENS,
                     "loss_mask": [0] * len(ids) + [1] * MAX_TOKENS, "messages": []})
    (tmp_path / "dataset").mkdir(exist_ok=True)
    write_jsonl(tmp_path / "dataset" / "eval.jsonl", rows)
    metrics = tmp_path / "train_metrics.json"
    metrics.write_text(json.dumps({"eval": {f"acc_pos{i}": r for i, r in enumerate(trained)}}))
    return tmp_path / "dataset", metrics


def _stage(tmp_path: Path, params: Path, export: Path, verifier: Path,
           trained: list[float] = (1.0,) * K):
    dataset, train_metrics = _agreement_inputs(tmp_path, verifier, list(trained))
    cmd = [sys.executable, str(ROOT / "stages" / "smoke.py"), "--params", str(params),
           "--dvc-yaml", str(ROOT / "dvc.yaml"), "--export", str(export),
           "--verifier", str(verifier), "--dataset", str(dataset),
           "--train-metrics", str(train_metrics),
           "--metrics", str(tmp_path / "metrics" / "smoke.json"),
           "--plots", str(tmp_path / "plots" / "smoke_acceptance.json")]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_positive_control_accepts_every_draft(micro_verifier_copy, tmp_path):
    """Final norms zeroed in verifier and draft: every logit ties at 0, both pick id 0, so every
    draft is accepted: mean acceptance length exactly k + 1, in both formats and at every k of
    the sweep. Speed is measured for every method (values not asserted: timings), in a file
    of its own; the deterministic metrics hold none."""
    verifier = drafts.zero_final_norm(micro_verifier_copy)
    arch = drafts.micro_arch(verifier)
    export = drafts.write_export(tmp_path / "export", arch, verifier_dir=verifier,
                                 mode="zero_norm", num_speculative_tokens=K)
    r = _stage(tmp_path, _params(tmp_path, k_sweep=[1, K], timing_rounds=2, batch1_prompts=1),
               export, verifier)
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads((tmp_path / "metrics" / "smoke.json").read_text())
    # the k sweep: k = 1 and the serving k, draft and ngram; acceptance exactly k + 1
    assert sorted(m["k_sweep"]) == ["1", str(K)]
    one = m["k_sweep"]["1"]["vllm"]
    assert one["mean_acceptance_length"] == 2.0 and one["acceptance_rate_per_position"] == [1.0]
    assert one["lossless"] and one["num_drafts"] == 2 * (MAX_TOKENS - 1) // 2
    # at the serving k the sweep is the main run's (one engine, one counted pass)
    main = {k: v for k, v in m["formats"]["vllm"].items() if k != "gain_over_ngram"}
    assert m["k_sweep"][str(K)]["vllm"] == main and main["mean_acceptance_length"] == K + 1
    assert set(m["k_sweep"]["1"]) == {"vllm", "ngram"} and "domains" not in m
    k_rows = json.loads((tmp_path / "plots" / "smoke_k_acceptance.json").read_text())
    assert k_rows == [{"k": 1, "ngram": m["k_sweep"]["1"]["ngram"]["mean_acceptance_length"],
                       "vllm": 2.0},
                      {"k": K, "ngram": m["ngram"]["mean_acceptance_length"], "vllm": K + 1}]
    timing = json.loads((tmp_path / "metrics" / "smoke_timing.json").read_text())
    assert set(timing["methods"]) == {"non-speculative", "vllm", "speculators", "ngram"}
    for name, t in timing["methods"].items():
        assert len(t["seconds"]) == 2  # one per timed round
        for q in ("output_tokens_per_s", "ms_per_output_token"):
            assert 0 < t[q]["min"] <= t[q]["median"] <= t[q]["max"], (name, q, t[q])
        if name != "non-speculative":
            sp = t["speedup"]
            assert sp["median"] > 0 and sp["min"] <= sp["max"], (name, sp)
            assert timing["speedup"][name] == sp["median"]
    assert sorted(timing["k_sweep"]) == ["1", str(K)]
    assert timing["best_k"]["serving_k"] == K and timing["best_k"]["vllm"]["k"] in (1, K)
    # batch 1: the first prompt alone, every method, every k of the sweep, the same shape
    one = timing["batch_1"]
    assert one["num_prompts"] == 1 and timing["batch_size"] == 2
    assert set(one["methods"]) == set(timing["methods"]) and sorted(one["k_sweep"]) == ["1", str(K)]
    for name, t in one["methods"].items():
        assert len(t["seconds"]) == 2 and t["output_tokens_per_s"]["min"] > 0, (name, t)
    assert one["best_k"]["serving_k"] == K
    speed_rows = json.loads((tmp_path / "plots" / "smoke_k_speedup.json").read_text())
    assert [row["k"] for row in speed_rows] == [1, K]
    assert set(speed_rows[0]) == {"k", "vllm", "ngram", "vllm_batch_1", "ngram_batch_1"}
    assert speed_rows[1]["vllm_batch_1"] == one["k_sweep"][str(K)]["vllm"]["speedup"]["median"]
    # the timing file names the deterministic metrics it was measured with
    assert timing["smoke_metrics_sha256"] == hashlib.sha256(
        (tmp_path / "metrics" / "smoke.json").read_bytes()).hexdigest()
    assert m["num_speculative_tokens"] == K
    for fmt in ("vllm", "speculators"):
        f = m["formats"][fmt]
        assert f["mean_acceptance_length"] == K + 1
        assert f["acceptance_rate_per_position"] == [1.0] * K
        assert f["lossless"] is True
        assert f["num_drafts"] == 2 * (MAX_TOKENS - 1) // (K + 1)
        assert f["tokens_generated"] == 2 * MAX_TOKENS
    assert m["mean_acceptance_length"]["ngram"] == m["ngram"]["mean_acceptance_length"]
    rows = json.loads((tmp_path / "plots" / "smoke_acceptance.json").read_text())
    assert [r["position"] for r in rows] == list(range(1, K + 1))
    assert all(set(r) == {"position", "vllm", "speculators", "ngram"} for r in rows)
    # training and serving agree: every eval-split position accepted on both sides, and
    # served replies are the dataset's (the zero-norm verifier's id-0 tokens)
    a = m["train_serve_agreement"]
    assert a["num_prompts"] == 2 and a["replies_equal_dataset"] == 2 and a["positions"] == K
    assert a["serving"]["acceptance_rate_per_position"] == [1.0] * K
    assert a["serving"]["tokens_per_step"] == a["training"]["tokens_per_step"] == K + 1
    assert a["gap"] == 0.0 and m["thresholds"]["max_train_serve_gap"] == 0.1
    assert not re.search(r"_s\"|seconds|time", json.dumps(m))  # no timings in metrics
    for line in r.stderr.splitlines():
        if "engine start" in line:
            print(line)


@pytest.mark.slow
def test_untrained_draft_fails_the_threshold_and_the_agreement(micro_verifier, tmp_path):
    """A random draft speculates losslessly (the verifier decides) but is almost never right:
    acceptance near 1, the stage fails naming the threshold and writes no metrics. The
    trainer's metrics file claims 3.4 tokens per step on the eval split: serving gives about
    1, so the agreement gate fails too, naming both figures and the likely causes."""
    arch = drafts.micro_arch(micro_verifier)
    export = drafts.write_export(tmp_path / "export", arch, verifier_dir=micro_verifier,
                                 mode="random")
    r = _stage(tmp_path, _params(tmp_path, min_acceptance_length=1.5), export, micro_verifier,
               trained=[0.9, 0.8, 0.7])
    assert r.returncode == EXIT_INPUT, r.stderr[-4000:]
    found = dict(re.findall(r"(vllm|speculators): mean acceptance length ([\d.]+) \(k=3\) is "
                            r"below smoke.min_acceptance_length 1.5", r.stderr))
    assert set(found) == {"vllm", "speculators"}, r.stderr[-4000:]
    assert all(1.0 <= float(v) < 1.2 for v in found.values()), found
    gap = re.search(r"training and serving disagree: on 2 prompts of the eval split vLLM's "
                    r"draft gives ([\d.]+) tokens per step over the first 3 positions, the "
                    r"trainer estimated 3.4000 on the same split", r.stderr)
    assert gap and 1.0 <= float(gap.group(1)) < 1.2, r.stderr[-4000:]
    assert "above smoke.max_train_serve_gap 10.0%" in r.stderr
    assert "aux layers" in r.stderr and "vocab map" in r.stderr and "norm_before_residual" in \
        r.stderr
    assert "lossless" not in r.stderr  # speculation was still exact
    assert not (tmp_path / "metrics" / "smoke.json").exists()


@pytest.mark.slow
def test_per_domain_prompts_from_a_jsonl(micro_verifier_copy, tmp_path):
    """smoke.prompts: a user's copy of MT-Bench's question.jsonl in prompts/
    (smoke.prompts_format: mtbench) with two categories and one row without a category
    ("default"). Each category is generated as its own batch; acceptance (positive control:
    exactly k + 1) and speed are reported per category, and they add up to the overall counts.
    (The messages format reaches the same domains: test_prompts_file_domains_limit_and_bom.)"""
    verifier = drafts.zero_final_norm(micro_verifier_copy)
    arch = drafts.micro_arch(verifier)
    export = drafts.write_export(tmp_path / "export", arch, verifier_dir=verifier,
                                 mode="zero_norm", num_speculative_tokens=K)
    (tmp_path / "prompts").mkdir()
    rows = [{"question_id": 81, "category": "code", "turns": ["def add(a, b):", "And sub?"]},
            {"question_id": 82, "category": "prose", "turns": ["Explain a list."]},
            {"question_id": 83, "category": "code", "turns": ["class Stack:"]},
            {"question_id": 84, "turns": ["import os"]}]
    (tmp_path / "prompts" / "eval.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n")
    params = _params(tmp_path, prompts="prompts/eval.jsonl", num_prompts=10,
                     prompts_format="mtbench")
    r = _stage(tmp_path, params, export, verifier)
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads((tmp_path / "metrics" / "smoke.json").read_text())
    assert m["prompts"] == "prompts/eval.jsonl" and m["num_prompts"] == 4
    domains = ["code", "prose", "default"]
    assert sorted(m["domains"]) == sorted(domains)
    assert [m["domains"][d]["num_prompts"] for d in domains] == [2, 1, 1]
    for fmt in ("vllm", "speculators"):
        per = [m["domains"][d][fmt] for d in domains]
        assert all(x["mean_acceptance_length"] == K + 1 for x in per), per
        for key in ("num_drafts", "num_accepted_tokens", "tokens_generated"):
            assert sum(x[key] for x in per) == m["formats"][fmt][key], key
        assert per[0]["num_drafts"] == 2 * per[1]["num_drafts"]  # 2 prompts vs 1
    timing = json.loads((tmp_path / "metrics" / "smoke_timing.json").read_text())
    assert sorted(timing["domains"]) == sorted(domains)
    for d, row in timing["domains"].items():
        assert set(row) == {"non-speculative", "vllm", "speculators", "ngram"}
        assert all(row[n]["speedup"]["median"] > 0 for n in row if n != "non-speculative")
    assert "k_sweep" not in m and "best_k" not in timing  # k_sweep: []
    # the per-k plots (a DVC output) hold the serving k alone
    rows = json.loads((tmp_path / "plots" / smoke.K_ACCEPTANCE_NAME).read_text())
    assert rows == [{"k": K, "ngram": m["ngram"]["mean_acceptance_length"],
                     "vllm": m["formats"]["vllm"]["mean_acceptance_length"]}], rows
