"""Hidden states on demand (`extract.mode: online | hybrid`, speculators' words): the train stage
obtains each batch's verifier hidden states from a vLLM engine running the extract stage's
capture while the draft trains, instead of reading files the extract stage wrote.

The extract stage then publishes only the token rows and a manifest of each sample's store key
(eagle3pipe.data.store: the verifier's fingerprint, the engine's numeric settings, the layer ids,
the dtype and the tokens). The transport is the per-sample store: a producer thread computes the
samples of the next PREFETCH_PACKS packed batches ahead of the trainer and writes each as a store
entry (atomically, as the extract stage does); the trainer reads an entry through speculators'
own seam, a `hs_connectors.HiddenStatesTransfer` handed to its ArrowDataset (StoreTransfer), and
waits only for what is not there yet (the log and metrics/train_online.json say how long).
Same key, same bytes: the trained draft is byte-identical in every mode (tests/test_online.py),
as the engine computes a sample the same way whatever it is batched with (eagle3pipe.data.store).

online: an entry this run computed is deleted after its last use in the run (the eval split's
are used at every evaluation and deleted at the end); entries already in the store are read and
kept. hybrid: what is computed stays in the store, up to its bound ($EAGLE3PIPE_STORE_MAX_BYTES,
store.bound()), so later epochs and reruns compute nothing; past the bound it behaves as online.

The engine is either inside the train stage (extract.endpoint null: ColocatedEngine, one
training process) or vLLM's OpenAI server started by `eagle3pipe serve --hidden-states` on other
machines (extract.endpoint host:port: RemoteEngine), whose connector writes into
$EAGLE3PIPE_STORE/incoming on a filesystem both see.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from hs_connectors import HiddenStatesTransfer
from safetensors.torch import load_file

from eagle3pipe.config.view import RunSettings
from eagle3pipe.data import leases, store
from eagle3pipe.hidden import spec
from eagle3pipe.errors import Error
from eagle3pipe.runtime.units import human

log = logging.getLogger("eagle3pipe.hidden.online")

PREFETCH_PACKS = 4  # packed batches computed ahead of the trainer (eagle3pipe plan uses it)
MODES = ("online", "hybrid")
# a sample another process claimed (is computing) is waited for, polled this often, this long
# at most before it is computed here too (its claimant may be on a node that died)
CLAIM_POLL_S, CLAIM_WAIT_S = 0.05, 600.0


class OnlineError(Error, RuntimeError):
    pass


@dataclass(frozen=True)
class Manifest:
    """What the extract stage published for on-demand extraction (artifacts/hidden/manifest.json)."""
    path: Path
    mode: str
    keys: dict[str, list[str]]  # split -> each row's store key
    layer_ids: list[int]
    dtype: str
    hidden_size: int
    engine: dict[str, Any]  # the numeric engine settings the keys hash (engine.numeric)
    vllm_version: str | None = None  # the extract stage's vLLM (what a server must run)
    aux_layer_ids: list[int] | None = None
    oracle: dict[str, Any] | None = None  # extract.oracle_samples and oracle_tolerance

    @property
    def num_slots(self) -> int:
        return len(self.layer_ids)


def read_manifest(hidden_dir: str | Path) -> Manifest | None:
    """The on-demand manifest of an extract output, or None for an offline one."""
    path = Path(hidden_dir) / "manifest.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # an offline output is checked file by file (stages.train.batches)
    if doc.get("mode", "offline") not in MODES:
        return None
    try:
        return Manifest(path, doc["mode"], doc["sample_keys"], doc["layer_ids"], doc["dtype"],
                        doc["hidden_size"], doc["engine_settings"], doc.get("vllm_version"),
                        doc["aux_layer_ids"], doc.get("oracle"))
    except KeyError as e:
        raise OnlineError(f"{path}: no key {e}", fix="rerun `dvc repro extract`") from None


class Producer:
    """Computes, on a thread of its own, the store entries of `plan` (packs of keys in the order
    the trainer uses them: its first `lead` packs are the eval split's, needed at step 0 and
    kept to the end; then every epoch's packs, at most `window` ahead of release()); get(key)
    waits for one. `compute(prompts)` yields (index, hidden [T, slots, H]) per prompt (an
    engine); `check(hidden, tokens, key)` refuses what no verifier computes."""

    def __init__(self, compute: Callable[[list[list[int]]], Iterator[tuple[int, torch.Tensor]]],
                 hs: store.Store, tokens: dict[str, list[int]], plan: list[list[str]], *,
                 m: Manifest, lead: int, batch_size: int, window: int, check,
                 used: int | None = None):
        self.compute, self.hs, self.tokens, self.plan, self.m = compute, hs, tokens, plan, m
        self.lead, self.batch_size, self.window, self.check = lead, batch_size, window, check
        self.keep_always: set[str] = set()  # hybrid: computed and kept under the bound
        self.uses = {k: 0 for k in tokens}
        for pack in plan:
            for k in pack:
                self.uses[k] += 1
        self.cond = threading.Condition()
        # what get() can read: computed here, or pinned (store.pin) when its pack comes up, so
        # that an entry another rank of this run computed serves this one and stays readable
        # after that rank drops it
        self.ready: set[str] = set()
        self.pinned: dict[str, Path] = {}
        self.generated: set[str] = set()
        self.released = 0  # train packs the trainer is done with
        self.waited_s, self.error, self.stopping = 0.0, None, False
        self.computed = self.deleted = self.from_store = 0
        self.budget = self._hybrid_budget(used) if m.mode == "hybrid" else 0
        self.lease: Path | None = None  # this run's lease (supply), left out of _others()
        self.thread = threading.Thread(target=self._run, name="hidden-states", daemon=True)

    def _hybrid_budget(self, used: int | None) -> int:
        """This process's share of what the store's bound leaves free: every rank of a run
        (WORLD_SIZE) keeps at most 1/world of it, so that together they stay within it. `used`:
        what the store held before any rank of the run computed (supply()), None: now."""
        limit, source = store.bound()
        used = store.used_bytes() if used is None else used
        world = int(os.environ.get("WORLD_SIZE", "1"))
        log.info("hybrid: keeping computed hidden states in %s up to its bound %s (%s); %s used"
                 "%s", store.root(), human(limit), source, human(used),
                 f"; this rank's share 1/{world}" if world > 1 else "")
        return max(0, limit - used) // world

    def start(self) -> "Producer":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            for n, pack in enumerate(self.plan):
                with self.cond:
                    self.cond.wait_for(lambda: self.stopping or n < self.lead
                                       or n - self.lead - self.released < self.window)
                    if self.stopping:
                        return
                    if n >= self.lead and n - self.lead < self.released:
                        continue  # the trainer is past this pack (it was ready from an earlier one)
                    missing = list(dict.fromkeys(k for k in pack if k not in self.ready))
                self._obtain(missing)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread by get()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _obtain(self, keys: list[str]) -> None:
        """Each key ready: pinned where the store has it, computed where this process claims it
        (store.Store.claim), else waited for while another live writer computes it (another rank
        of this run at an epoch's turn, or another run), at most CLAIM_WAIT_S."""
        waited, pending = 0.0, keys
        while pending and not self.stopping:
            pending = [k for k in pending if not self._pin(k)]
            claimed = [k for k in pending if self.hs.claim(k)]
            try:
                mine = [k for k in claimed if not self._pin(k)]  # done between pin and claim
                for start in range(0, len(mine), self.batch_size):
                    self._compute(mine[start:start + self.batch_size])
            finally:
                for k in claimed:
                    self.hs.unclaim(k)
            pending = [k for k in pending if k not in claimed]
            if pending and waited >= CLAIM_WAIT_S:
                log.warning("%d samples stayed claimed by another process for %.0f s; computing "
                            "them here", len(pending), waited)
                for start in range(0, len(pending), self.batch_size):
                    self._compute(pending[start:start + self.batch_size])
                return
            if pending:
                time.sleep(CLAIM_POLL_S)
                waited += CLAIM_POLL_S

    def _pin(self, k: str) -> bool:
        """k is in the store (this run's earlier rank or epoch, or an earlier run): pinned and
        ready, nothing to compute."""
        pinned = self.hs.pin(k)
        if pinned is None:
            return False
        with self.cond:
            self.pinned[k] = pinned
            self.from_store += 1
            self.ready.add(k)
            self.cond.notify_all()
        return True

    def _compute(self, keys: list[str]) -> None:
        if self.compute is None:  # no engine started: every key was in the store at the start
            raise OnlineError(f"store entry {keys[0]} went missing during the run (removed by "
                              "hand, or by a process that ignores leases)",
                              fix="rerun `dvc repro train`: an engine starts for what is missing")
        prompts = [self.tokens[k] for k in keys]
        for j, hidden in self.compute(prompts):
            k = keys[j]
            stored = hidden.to(spec.torch_dtype(self.m.dtype)).contiguous()
            self.check(stored, prompts[j], k)
            path = self.hs.put_hidden(k, prompts[j], stored)
            with self.cond:
                self.computed += 1
                self.generated.add(k)
                if self.m.mode == "hybrid" and self.budget >= path.stat().st_size:
                    self.budget -= path.stat().st_size
                    self.keep_always.add(k)
                self.ready.add(k)
                self.cond.notify_all()

    def get(self, k: str) -> dict[str, torch.Tensor]:
        """The entry of key k, waiting for the producer if it is not computed yet."""
        t0 = time.perf_counter()
        with self.cond:
            self.cond.wait_for(lambda: k in self.ready or self.error is not None)
            self.waited_s += time.perf_counter() - t0
            if k not in self.ready:
                raise self._failure()
            path = self.pinned.get(k) or self.hs.path(k)
        return load_file(path)

    def _failure(self) -> BaseException:
        e = self.error
        if isinstance(e, Error):
            return e
        return OnlineError(f"the hidden-state producer failed: {type(e).__name__}: {e}",
                           fix="read the error above; rerun `dvc repro train` (nothing was "
                           "published)")

    def release(self, pack: list[str]) -> None:
        """The trainer is done with one pack of the plan: online deletes what this run computed
        and no later pack of the plan uses, unless another live run holds a lease on it."""
        others = self._others()
        with self.cond:
            self.released += 1
            for k in pack:
                self.uses[k] -= 1
                if self.uses[k] <= 0:
                    self._drop(k, others)
            self.cond.notify_all()

    def _others(self) -> set[str]:
        """The keys other live runs hold leases on (eagle3pipe.data.leases)."""
        return leases.held(self.hs.dir.parent, mine=self.lease).get(self.hs.kind, set())

    def _drop(self, k: str, others: set[str]) -> None:
        pinned = self.pinned.pop(k, None)
        if pinned is not None:
            pinned.unlink(missing_ok=True)
            self.ready.discard(k)
        if k in self.generated and k not in self.keep_always:
            if k not in others:  # another run reads it: its own cleanup or gc removes it later
                self.hs.path(k).unlink(missing_ok=True)
                self.deleted += 1
            self.generated.discard(k)
            self.ready.discard(k)

    def close(self) -> dict[str, Any]:
        """Stops the thread, drops what online keeps no longer; returns what the run did."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=600)
        others = self._others()
        with self.cond:
            for k in [*self.generated, *self.pinned]:
                self._drop(k, others)
        kept = sum(1 for k in self.keep_always if k in self.tokens and self.hs.has(k))
        return {"mode": self.m.mode, "computed": self.computed, "read_from_store": self.from_store,
                "deleted": self.deleted,
                "kept_in_store": kept, "engine_wait_seconds": round(self.waited_s, 3)}


class StoreTransfer(HiddenStatesTransfer):
    """speculators' transfer seam (ArrowDataset's `transfer`): row i's hidden states are the
    store entry of its manifest key, obtained from the producer."""

    def __init__(self, manifest: Manifest, split: str):
        self.manifest, self.keys = manifest, manifest.keys[split]
        self.producer: Producer | None = None  # set once the trainer's plan is known

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        if self.producer is None:
            raise OnlineError("hidden states were read before the producer started")
        return self.producer.get(self.keys[file_idx])

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise OnlineError("StoreTransfer never asks vLLM through speculators' client")


# ---------------------------------------------------------------------------------------------
# The train stage's side: which transfer each split reads through, and the engine behind it


def transfer(m: Manifest | None, split: str) -> StoreTransfer | None:
    """The split's StoreTransfer on demand; None offline (speculators' FileTransfer)."""
    return None if m is None else StoreTransfer(m, split)


def check_manifest(m: Manifest, num_slots: int, hidden_size: int) -> None:
    """The manifest's capture must be the draft's: its slots and the verifier's width."""
    if (m.num_slots, m.hidden_size) != (num_slots, hidden_size):
        raise OnlineError(f"{m.path}: captures {m.num_slots} slots of width {m.hidden_size}, "
                          f"the draft needs {num_slots} of width {hidden_size}",
                          fix="rerun `dvc repro extract` (the draft config changed since)")


@dataclass(frozen=True)
class Demand:
    """What a trainer will read on demand, in order, handed to supply() explicitly: every
    row's tokens by store key, and the packs of keys in the order it reads them (its first
    `lead` packs are the eval split's, read at every evaluation and kept to the end)."""
    transfers: tuple[StoreTransfer, ...]  # the splits' seams, which the producer feeds
    tokens: dict[str, list[int]]
    plan: list[list[str]]
    lead: int

    @property
    def manifest(self) -> Manifest:
        return self.transfers[0].manifest


@contextlib.contextmanager
def supply(demand: Demand | None, verifier_dir: str | Path, run: RunSettings | None, *,
           threads: int, record_to: Path | None,
           agree: Callable[[int], int] = lambda n: n) -> Iterator[Callable[[list[str]], None]]:
    """While the trainer runs: the producer of `demand` (offline, None: nothing), fed by the
    engine extract.endpoint names or by one started here with the manifest's numeric settings
    and the run-only ones (`run`), which first passes the extract stage's oracle on the first
    pack (oracle.check_engine; "oracle" in the record). Yields release(keys), which the
    trainer calls with each train pack's keys once it is done with them. On exit: what it
    computed, kept and deleted, and how long the trainer waited, logged and written to
    `record_to`.
    `agree(n)`: the largest n over the run's ranks (a collective, so that every rank measures
    the store before any computes): the store's use, from which each budgets its share."""
    if demand is None:
        yield lambda keys: None
        return
    if run is None:
        raise OnlineError("on-demand hidden states need the run-only settings",
                          fix="pass run=params.run_settings() (eagle3pipe.config.view)")
    from eagle3pipe.hidden import on_demand, oracle
    from eagle3pipe.hidden.checks import check_states
    from eagle3pipe.verifier.handle import Verifier

    m = demand.manifest
    v = Verifier(verifier_dir)

    def check(hidden: torch.Tensor, ids: list[int], k: str) -> None:
        check_states(hidden, ids, m.layer_ids, file=str(m.path), sample=f"store key {k}")

    hs = store.Store("hidden")
    used = agree(store.used_bytes()) if m.mode == "hybrid" else None
    # the lease first: from here no gc, other run's bound or cleanup removes an entry this run
    # found in the store and will read (eagle3pipe.data.leases); under torchrun's run id every
    # rank shares its entries (one rank's cleanup may remove what another computes again)
    with leases.hold(store.root(), {hs.kind: demand.tokens},
                     run=os.environ.get("TORCHELASTIC_RUN_ID")) as lease:
        needed = not all(hs.has(k) for k in demand.tokens)  # a hybrid rerun: no engine starts
        with on_demand.source(m, v, run, threads=threads, needed=needed) as compute:
            checked = oracle.check_engine(compute, v, m, demand.plan[0], demand.tokens) \
                if compute and m.oracle else None  # before any training step
            p = Producer(compute, hs, demand.tokens, demand.plan, m=m, lead=demand.lead,
                         batch_size=run.batch_size, window=PREFETCH_PACKS, check=check,
                         used=used)
            p.lease = lease
            p.start()
            for t in demand.transfers:
                t.producer = p
            try:
                yield p.release
            finally:
                stats = p.close()
    _report(m, run, needed, stats | ({"oracle": checked} if checked is not None else {}),
            record_to)


def _report(m: Manifest, run: RunSettings, needed: bool, stats: dict,
            record_to: Path | None) -> None:
    """What the producer computed, kept and deleted and how long the trainer waited: logged,
    and written to `record_to`."""
    engine = (run.endpoint or "engine in this stage") if needed else \
        "no engine started: every sample was in the store"
    log.info("%s: computed %d samples' hidden states (%s), read %d from the store, kept %d "
             "there, deleted %d; the trainer waited %.3f s for the engine", m.mode,
             stats["computed"], engine, stats["read_from_store"], stats["kept_in_store"],
             stats["deleted"], stats["engine_wait_seconds"])
    if record_to is not None:
        from eagle3pipe.runtime.jsonio import write_json

        write_json(record_to, stats)
