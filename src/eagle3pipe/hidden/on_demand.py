"""The engine behind on-demand hidden states (extract.mode online/hybrid, eagle3pipe.hidden.online):
vLLM with the extract stage's capture (eagle3pipe.hidden.capture), either inside the train
stage or as vLLM's OpenAI server elsewhere (extract.endpoint), started by `eagle3pipe serve
--hidden-states` from the same params (eagle3pipe.tools.serve).

The server's connector writes each request's states into $EAGLE3PIPE_STORE/incoming
(storage()), a directory on the filesystem the store is on, which must be shared by the server
and every training node; the server writes server.json there before it starts (describe():
the verifier's fingerprint, the numeric engine settings, the layer ids it captures and its vLLM
version), and the trainer refuses a server whose capture differs from the manifest's, or whose
server.json it cannot see (the store is not shared). Every file the server writes carries the
same identity as its metadata (eagle3pipe.engines.connector), and the trainer checks each one:
a server restarted mid-run with other aux ids, another verifier or another vLLM is refused at
its first entry, naming the field and both values. A request is one prompt (max_tokens 1, greedy), sent
concurrently with the rest of its engine call so that the server batches them, as speculators'
own client does (speculators/data_generation/vllm_client.py); the response's
kv_transfer_params name the file.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file

from eagle3pipe.config.view import RunSettings
from eagle3pipe.data import store
from eagle3pipe.errors import Error
from eagle3pipe.runtime import environment

INCOMING = "incoming"
SERVER_JSON = "server.json"
REQUEST_TIMEOUT_S = 600.0
# a server that went away (killed, restarting) is waited for this long in all, by default
# ($EAGLE3PIPE_SERVER_WAIT), retrying after 1, 2, 4, ... s, at most MAX_BACKOFF_S apart
SERVER_WAIT_S = 600.0
MAX_BACKOFF_S = 30.0
log = logging.getLogger("eagle3pipe.hidden.on_demand")


class EndpointError(Error, RuntimeError):
    pass


def _unreachable(e: BaseException) -> bool:
    """A server that cannot be reached (refused, reset, gone mid-answer), not one that answered
    with an error."""
    if isinstance(e, urllib.error.HTTPError):
        return False
    reason = getattr(e, "reason", e)
    if isinstance(reason, TimeoutError):  # it took the request and did not answer in time
        return False
    return isinstance(e, ConnectionError) or isinstance(reason, (ConnectionError, OSError))


def with_backoff(call, *, wait_s: float, what: str, sleep=time.sleep):
    """call(), retried while its server cannot be reached, after 1, 2, 4, ... s (at most
    MAX_BACKOFF_S apart) and `wait_s` seconds in all; then the last error, raised."""
    delay, waited = 1.0, 0.0
    while True:
        try:
            return call()
        except (urllib.error.URLError, OSError) as e:
            if not _unreachable(e) or waited >= wait_s:
                raise
            pause = min(delay, MAX_BACKOFF_S, wait_s - waited)
            log.warning("%s: unreachable (%s); retrying in %.0f s (%.0f of %.0f s waited)",
                        what, getattr(e, "reason", e), pause, waited, wait_s)
            sleep(pause)
            waited, delay = waited + pause, delay * 2


def storage() -> Path:
    return store.root() / INCOMING


def describe(fingerprint: str, numeric: dict, layer_ids: list[int], version: str | None) -> dict:
    """What a hidden-state server captures (server.json, and every entry's metadata), compared
    with the manifest's; `version`: vLLM's (None: a manifest that did not record it)."""
    return {"verifier": fingerprint, "engine_settings": numeric, "layer_ids": list(layer_ids),
            **({"vllm_version": version} if version else {})}


def identity_mismatch(got: dict | None, want: dict) -> list[str]:
    """Each field of the capture identity in which `got` (an entry's metadata) differs from
    `want` (the manifest's), as 'field: got X, the manifest needs Y'."""
    if got is None:
        return ["identity: the entry carries none (a server of another eagle3pipe version, or "
                "files written by hand)"]
    return [f"{k}: got {got.get(k)!r}, the manifest needs {v!r}" for k, v in want.items()
            if got.get(k) != v]


def entry_identity(path: Path) -> dict | None:
    """The capture identity a server's file carries (its safetensors metadata), or None."""
    from safetensors import safe_open

    from eagle3pipe.engines.connector import IDENTITY

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta[IDENTITY]) if IDENTITY in meta else None


@contextlib.contextmanager
def source(m, v, run: RunSettings, *, threads: int, needed: bool = True) -> Iterator[Any]:
    """compute(prompts) -> (index, hidden [T, slots, H]) per prompt, from the server at
    run.endpoint, or from an engine started here with the manifest's numeric
    settings and the run-only ones; none when nothing is `needed` (all in the store)."""
    if not needed:
        yield None
        return
    if run.endpoint:
        yield Server(run.endpoint, describe(v.fingerprint, m.engine, m.layer_ids,
                                            m.vllm_version))
        return
    from eagle3pipe.engines import engine
    from eagle3pipe.hidden import capture
    if engine.on_demand_settings(m.engine).get(engine.BATCH_INVARIANT) and \
            not m.engine.get(engine.BATCH_INVARIANT):
        raise EndpointError(
            f"{m.path}: the extract stage ran where vLLM has no batch-invariant mode (no CUDA), "
            "so its store keys are for states computed on CPU, and this engine runs on CUDA",
            fix="run `dvc repro -f -s extract` on this machine (its keys are then for CUDA's "
            "batch-invariant states), or train where extract ran")
    settings = {**m.engine, **run.vllm()}
    parent = store.root()
    parent.mkdir(parents=True, exist_ok=True)
    with capture.storage_dir(parent) as where, engine.engine(
            settings, v.model_dir, tokenizer=v.dir, threads=threads,
            **capture.engine_config(m.layer_ids, Path(where))) as llm:
        torch._C.set_num_threads(threads)  # vLLM's CPU worker set its own count (and no-ops
        # torch.set_num_threads): the trainer runs with train.threads, as offline
        yield lambda prompts: capture.hidden_states(llm, prompts, batch_size=len(prompts))


class Server:
    """The client of `eagle3pipe serve --hidden-states` at host:port."""

    def __init__(self, endpoint: str, want: dict):
        self.endpoint, self.base = endpoint, f"http://{endpoint}/v1"
        serve = ("start it there with `eagle3pipe serve --hidden-states --host 0.0.0.0 --port "
                 f"{endpoint.rpartition(':')[2]}` (this repository, the same params.yaml and "
                 "$EAGLE3PIPE_STORE), or fix extract.endpoint")
        try:
            self.model = self._call("/models")["data"][0]["id"]
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
            raise EndpointError(f"extract.endpoint {endpoint}: no vLLM server answers "
                                f"{self.base}/models ({e})", fix=serve) from None
        f = storage() / SERVER_JSON
        if not f.is_file():
            raise EndpointError(
                f"{f}: missing, so the server at {endpoint} writes its hidden states where "
                "this node cannot read them", fix="put $EAGLE3PIPE_STORE on a filesystem "
                "shared by the server and every training node, the same path on each")
        got = json.loads(f.read_text())
        self.want = want
        wrong = identity_mismatch(got, want)
        if wrong:
            raise EndpointError(f"the server at {endpoint} captures other states than this "
                                f"run's manifest needs: {'; '.join(wrong)}",
                                fix="restart the server from this params.yaml (`eagle3pipe "
                                "serve --hidden-states`) on the kind of device extract ran on "
                                "(CUDA engines run batch-invariant: engine_settings say so)")

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return json.loads(resp.read())

    def _request(self, ids: list[int]) -> Path:
        r = self._call("/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
                                        "temperature": 0.0})
        return Path((r.get("kv_transfer_params") or {}).get("hidden_states_path", ""))

    def __call__(self, prompts: list[list[int]]) -> Iterator[tuple[int, torch.Tensor]]:
        from eagle3pipe.hidden.capture import FLUSH_TIMEOUT_S

        wait = environment.seconds(environment.SERVER_WAIT, default=SERVER_WAIT_S)

        def request(ids: list[int]) -> Path:
            return with_backoff(lambda: self._request(ids), wait_s=wait,
                                what=f"extract.endpoint {self.endpoint}")
        try:
            with ThreadPoolExecutor(max(1, len(prompts))) as pool:
                paths = list(pool.map(request, prompts))
        except (urllib.error.URLError, OSError) as e:
            gone = _unreachable(e)
            raise EndpointError(
                f"extract.endpoint {self.endpoint}: "
                + (f"unreachable for {wait:.0f} s (${environment.SERVER_WAIT}) after it had "
                   f"answered: {getattr(e, 'reason', e)}" if gone else f"a request failed ({e})"),
                fix="check the server's log; restart it (`eagle3pipe serve --hidden-states`) "
                "and rerun `dvc repro train`: it resumes from its last checkpoint") from None
        for j, (ids, path) in enumerate(zip(prompts, paths)):
            deadline = time.monotonic() + FLUSH_TIMEOUT_S
            while not path.is_file():
                if time.monotonic() > deadline:
                    raise EndpointError(f"{path}: the server at {self.endpoint} named this "
                                        "file, which did not appear here", fix="put "
                                        "$EAGLE3PIPE_STORE on a filesystem shared by the server "
                                        "and every training node, the same path on each")
                time.sleep(0.02)
            wrong = identity_mismatch(entry_identity(path), self.want)
            if wrong:
                path.unlink()
                raise EndpointError(
                    f"{path}: the server at {self.endpoint} computed this entry with another "
                    "capture than this run's manifest (" + "; ".join(wrong) + "): it was "
                    "restarted with other settings since this run started", fix="restart "
                    "the server from this params.yaml (`eagle3pipe serve --hidden-states`) "
                    "and rerun `dvc repro train` (it resumes from its last checkpoint)")
            data = load_file(str(path))
            path.unlink()
            if data["token_ids"].tolist() != list(ids):
                raise EndpointError(f"{path}: token ids differ from the prompt's; the server "
                                    "reordered or truncated it", fix="check the server's "
                                    "max_model_len (vllm.max_model_len)")
            yield j, data["hidden_states"]
