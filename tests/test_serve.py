"""The serving recipe (configs/serve/, eagle3pipe.engines.serving) follows params.yaml and
`eagle3pipe check` finds a stale one; `eagle3pipe serve` refuses what cannot start, naming the
fix; and (slow) it serves the micro pipeline's export over HTTP: greedy chat replies equal a
server's without speculation, and vLLM's counters show the draft's tokens accepted."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from eagle3pipe.config import params as P
from eagle3pipe.engines import serving
from eagle3pipe.engines import engine
from eagle3pipe.tools import cli

from helpers.micro import ROOT
from helpers.pipeline import set_param, start, wait_for

VERIFIER_CONFIG = ROOT / "configs/verifier_config.json"


def render(tmp: Path, **changes) -> Path:
    """A copy of params.yaml with `changes` (dotted key: value), rendered into tmp/configs."""
    shutil.copy2(ROOT / "params.yaml", tmp / "params.yaml")
    for key, value in changes.items():
        set_param(tmp, key, value)
    assert cli.main(["render", "--params", str(tmp / "params.yaml"), "--verifier-config",
                     str(VERIFIER_CONFIG), "--out", str(tmp / "configs")]) == 0
    return tmp / "configs"


def check(tmp: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["check", "--params", str(tmp / "params.yaml"), "--verifier-config",
                   str(VERIFIER_CONFIG), "--configs", str(tmp / "configs"), "--no-scan"])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_recipe_is_params_and_check_follows_a_k_change(tmp_path, capsys):
    configs = render(tmp_path, **{"draft.num_speculative_tokens": 5})
    p = P.load(tmp_path / "params.yaml")
    settings = engine.settings_of(p.vllm)
    for fmt in serving.FORMATS:
        r = json.loads((configs / f"serve/{fmt}.json").read_text())
        spec = r["engine_args"]["speculative_config"]
        assert spec == {"method": "eagle3", "model": f"artifacts/export/{fmt}",
                        "num_speculative_tokens": 5}
        assert r["draft"] == f"artifacts/export/{fmt}" and r["num_speculative_tokens"] == 5
        assert r["engine_args"] == engine.engine_kwargs(settings, "artifacts/verifier",
                                                        speculative_config=spec, stats=True)
        assert r["environment"] == {"VLLM_CPU_OMP_THREADS_BIND": settings["cpu_omp_threads_bind"]}
        assert r["argv"] == serving.cli_args(r["engine_args"])
    sg = json.loads((configs / "serve/sglang.json").read_text())["argv"]
    flags = dict(zip(sg[::2], sg[1::2]))
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-draft-model-path"] == "artifacts/export/vllm"
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("5", "1", "6")
    assert flags["--dtype"] == settings["dtype"]
    assert flags["--context-length"] == str(settings["max_model_len"])

    assert check(tmp_path, capsys)[0] == 0
    set_param(tmp_path, "draft.num_speculative_tokens", 3)  # params move on, the recipe does not
    rc, out = check(tmp_path, capsys)
    assert rc == 1
    assert "serve/vllm.json: differs from what params.yaml renders" in out
    assert "num_speculative_tokens: on disk 5, params.yaml renders 3" in out
    assert "serve/sglang.json" in out
    render(tmp_path)
    assert check(tmp_path, capsys)[0] == 0


def test_an_engine_setting_reaches_the_recipe_and_a_hand_edit_is_found(tmp_path, capsys):
    configs = render(tmp_path, **{"vllm.max_model_len": 512})
    r = json.loads((configs / "serve/vllm.json").read_text())
    assert r["engine_args"]["max_model_len"] == 512
    assert r["argv"][r["argv"].index("--max-model-len") + 1] == "512"
    f = configs / "serve/speculators.json"
    f.write_text(f.read_text().replace('"num_speculative_tokens": 3', '"num_speculative_tokens": 4'))
    rc, out = check(tmp_path, capsys)
    assert rc == 1 and "serve/speculators.json: differs" in out and "on disk 4" in out


def test_vllms_own_parser_reads_the_recipe_flags_as_its_engine_args(tmp_path):
    """The flags the server gets (`python -m vllm.entrypoints.openai.api_server ARGV`) parse,
    with vLLM's own argument parser, to exactly the recipe's engine arguments."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    configs = render(tmp_path, **{"vllm.trust_remote_code": True})
    parser = make_arg_parser(FlexibleArgumentParser())
    for fmt in serving.FORMATS:
        r = json.loads((configs / f"serve/{fmt}.json").read_text())
        ns = vars(parser.parse_args(r["argv"]))
        assert {k: ns[k] for k in r["engine_args"]} == r["engine_args"], fmt


def test_chat_template_kwargs_reach_the_server_as_its_default(tmp_path):
    """dataset.chat_template_kwargs is the server's --default-chat-template-kwargs (vLLM's own
    parser reads it back); {} adds no flag and no field, vLLM's default."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    kwargs = {"enable_thinking": False, "reasoning_effort": "low"}
    configs = render(tmp_path, **{"dataset.chat_template_kwargs": kwargs})
    for fmt in serving.FORMATS:
        r = json.loads((configs / f"serve/{fmt}.json").read_text())
        assert r["frontend_args"] == {"default_chat_template_kwargs": kwargs}
        assert vars(parser.parse_args(r["argv"]))["default_chat_template_kwargs"] == kwargs
    (tmp_path / "plain").mkdir()
    plain = json.loads((render(tmp_path / "plain") / "serve/vllm.json").read_text())
    assert "frontend_args" not in plain and "--default-chat-template-kwargs" not in plain["argv"]
    assert vars(parser.parse_args(plain["argv"]))["default_chat_template_kwargs"] is None


# ---------------------------------------------------------------------------------------------
# eagle3pipe serve refuses before starting anything


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project dir as `eagle3pipe serve` reads it: params, rendered configs, the verifier
    stage's config (no weights: nothing here starts a server) and a (fake) export."""
    render(tmp_path)
    (tmp_path / "artifacts/verifier").mkdir(parents=True)
    shutil.copy2(VERIFIER_CONFIG, tmp_path / "artifacts/verifier/config.json")
    for fmt in serving.FORMATS:
        d = tmp_path / f"artifacts/export/{fmt}"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def serve_error(capsys, *args: str) -> str:
    capsys.readouterr()
    assert cli.main(["serve", *args]) == 2
    return capsys.readouterr().err


def test_serve_refuses_a_taken_port(project, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = serve_error(capsys, "--port", str(port))
    assert f"127.0.0.1:{port}: the port is taken" in err and "fix: pass a free port" in err


def test_serve_refuses_a_missing_export_verifier_or_stale_recipe(project, capsys):
    shutil.rmtree(project / "artifacts/export/speculators")
    err = serve_error(capsys, "--format", "speculators")
    assert "artifacts/export/speculators: config.json, model.safetensors missing" in err
    assert "fix: run `dvc repro export`" in err
    shutil.rmtree(project / "artifacts/verifier")
    err = serve_error(capsys)
    assert "artifacts/verifier: neither manifest.json nor config.json found" in err
    assert "dvc repro verifier" in err
    set_param(project, "draft.num_speculative_tokens", 4)
    err = serve_error(capsys)
    assert "serve/vllm.json: differs from what params.yaml renders" in err
    assert "fix: run `dvc repro configs`" in err


# ---------------------------------------------------------------------------------------------
# slow: the micro pipeline's export served over HTTP

PROMPTS = 3
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.read().decode()


def counter(metrics: str, name: str) -> float:
    """A Prometheus counter's total over its label sets."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def served(repo: Path, *args: str) -> tuple[list[dict], str]:
    """`eagle3pipe serve ARGS` in the repo: the greedy chat replies to the first PROMPTS
    training conversations' user turns, and /metrics; then SIGTERM, and the server's process
    group must be gone."""
    port, log = free_port(), repo.parent / f"serve-{'-'.join(args) or 'draft'}.log"
    proc = start(repo, "eagle3pipe", "serve", "--port", str(port), *args, log=log)
    try:
        line = wait_for("the ready line", lambda: next(
            (x for x in log.read_text().splitlines() if "eagle3pipe serve: ready at" in x), None),
            timeout=600, proc=proc, log=log, poll=0.5)
        pid = int(line.split("server pid ")[1].split(")")[0])
        base = f"http://127.0.0.1:{port}"
        model = json.loads(http(f"{base}/v1/models"))["data"][0]["id"]
        lines = (repo / "artifacts/dataset/train.jsonl").read_text().splitlines()[:PROMPTS]
        replies = []
        for rec in map(json.loads, lines):
            turns = rec["messages"][:max(i for i, m in enumerate(rec["messages"])
                                         if m["role"] == "user") + 1]
            r = json.loads(http(f"{base}/v1/chat/completions", {
                "model": model, "messages": turns, "temperature": 0, "seed": 0,
                "max_tokens": MAX_TOKENS}))
            replies.append({"text": r["choices"][0]["message"]["content"],
                            "tokens": r["usage"]["completion_tokens"]})
        metrics = http(f"{base}/metrics")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # eagle3pipe serve stops the server's group
        rc = proc.wait(timeout=120)
    assert rc == 0, log.read_text()[-4000:]
    assert "eagle3pipe serve: stopping the server" in log.read_text()
    wait_for("the server's process group to be gone", lambda: not group_alive(pid),
             timeout=15)  # eagle3pipe serve waits for it; an orphan's reaping may lag
    return replies, metrics


@pytest.mark.slow
def test_the_export_serves_greedy_replies_losslessly_and_accepts_draft_tokens(micro):
    repo, _ = micro
    spec, metrics = served(repo)
    plain, plain_metrics = served(repo, "--no-draft")
    assert spec == plain  # speculation changes no greedy token
    assert all(r["tokens"] > 0 for r in spec)
    accepted = counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    drafts = counter(metrics, "vllm:spec_decode_num_drafts_total")
    assert drafts > 0 and counter(plain_metrics, "vllm:spec_decode_num_drafts_total") == 0
    acceptance = 1 + accepted / drafts
    print(f"served over HTTP: mean acceptance length {acceptance:.4f} ({accepted:.0f} accepted "
          f"in {drafts:.0f} drafts, k = 3, {PROMPTS} prompts x {MAX_TOKENS} tokens)")
    assert acceptance > 1.0
