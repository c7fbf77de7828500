"""Unit tests of pieces the pipeline tests only reach through DVC and vLLM: the training
schedule, the packer and its seeded epoch order, the store's bound, the capture spec and its
store keys, and the on-demand producer's order, window, deletion and hybrid budget (its engine a function that returns tensors: the
producer's own logic, not vLLM's, is under test here; tests/test_online.py runs it on vLLM)."""
from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3pipe.data import gc, store
from eagle3pipe.errors import Error
from eagle3pipe.hidden import keys, online, spec
from eagle3pipe.runtime import distributed, environment
from eagle3pipe.stages.train import batches
from eagle3pipe.stages.train.run import lr_lambda

# ---- the schedule: linear warm-up, then a half cosine to 0 (speculators' cosine shape)


def test_lr_warms_up_linearly_then_decays_to_zero():
    f = lr_lambda(4, 20)
    assert [f(s) for s in range(4)] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert f(4) == 1.0
    assert f(12) == pytest.approx(0.5)  # halfway through the decay
    assert f(20) == pytest.approx(0.0, abs=1e-12) and f(25) == 0.0
    decay = [f(s) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_lr_without_warmup_starts_at_the_peak():
    f = lr_lambda(0, 10)
    assert f(0) == 1.0 and f(5) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))


# ---- the packer


LENGTHS = [30, 200, 70, 10, 500, 64, 64, 1, 300, 40]


@pytest.mark.parametrize("device,impl,want", [("cpu", "auto", "eager"), ("cpu", "eager", "eager"),
                                             ("cuda", "auto", "fused"), ("cuda", "eager", "eager"),
                                             ("cuda", "fused", "fused")])
def test_train_loss_impl_chooses_speculators_loss(device, impl, want):
    b = distributed.backend_for(device, 512, impl)
    assert b.loss_impl == want
    assert b.chunk_tokens == (512 if device == "cpu" else None)


def test_fused_loss_is_refused_on_cpu_and_without_triton_naming_the_key(monkeypatch):
    with pytest.raises(Error, match=r"train.loss_impl is fused.*cpu(?s:.*)fix: set "
                                    r"train.loss_impl: eager"):
        distributed.backend_for("cpu", 512, "fused")
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # triton not importable
    for impl in ("auto", "fused"):
        with pytest.raises(Error, match=rf"train.loss_impl is {impl}.*triton does not import"
                                        r"(?s:.*)train.loss_impl: eager"):
            distributed.backend_for("cuda", 512, impl)
    assert distributed.backend_for("cuda", 512, "eager").loss_impl == "eager"


def test_pack_keeps_order_and_budget():
    packs = batches.pack(list(range(len(LENGTHS))), LENGTHS, 256)
    assert [i for p in packs for i in p] == list(range(len(LENGTHS)))
    for p in packs:
        assert sum(LENGTHS[i] for i in p) <= 256 or len(p) == 1  # a longer sample: alone
    assert [4] in packs  # 500 tokens: a batch of its own


def test_epoch_order_is_seeded_per_epoch():
    a = batches.epoch_batches(LENGTHS, 256, seed=0, epoch=0)
    assert a == batches.epoch_batches(LENGTHS, 256, seed=0, epoch=0)
    assert sorted(i for p in a for i in p) == list(range(len(LENGTHS)))
    others = [batches.epoch_batches(LENGTHS, 256, seed=s, epoch=e) for s, e in
              ((0, 1), (1, 0), (1, 1))]
    assert all(o != a for o in others)


# ---- the store's bound ($EAGLE3PIPE_STORE_MAX_BYTES)


def test_store_bound_default_size_and_refusal(monkeypatch):
    monkeypatch.delenv(environment.STORE_MAX_BYTES, raising=False)
    limit, source = store.bound()
    assert limit == 50 * 1024 ** 3 and "the default 50G" in source
    monkeypatch.setenv(environment.STORE_MAX_BYTES, "1.5G")
    assert store.bound() == (int(1.5 * 1024 ** 3), f"${environment.STORE_MAX_BYTES}=1.5G")
    monkeypatch.setenv(environment.STORE_MAX_BYTES, "lots")
    with pytest.raises(Error, match=r"EAGLE3PIPE_STORE_MAX_BYTES: 'lots' is not a size") as e:
        store.bound()
    assert "fix: set it to a size such as 50G, or unset it for the default 50G" in str(e.value)


# ---- temporaries named for their writer (pid and host): a store shared by several nodes


def _dead_pid() -> int:

    q = subprocess.Popen(["true"])
    q.wait()
    return q.pid


def test_temporaries_carry_pid_and_host_and_only_this_hosts_dead_ones_are_swept(tmp_path):
    from eagle3pipe.runtime import atomic

    out = tmp_path / "out.json"
    dead, other_host = _dead_pid(), "0" * 8 if atomic.HOST != "0" * 8 else "1" * 8
    mine_dead = tmp_path / f".out.json.{dead}-{atomic.HOST}.abc.tmp"
    theirs = tmp_path / f".out.json.{dead}-{other_host}.abc.tmp"  # the same pid, another node
    for f in (mine_dead, theirs):
        f.write_text("partial")
    assert atomic.dead_writers(tmp_path) == [mine_dead]
    atomic.write_text_atomic(out, "{}")
    assert out.read_text() == "{}" and not mine_dead.exists() and theirs.exists()


def test_store_writers_never_share_a_temporary_and_gc_removes_dead_writers_leftovers(
        tmp_path, monkeypatch):
    from eagle3pipe.runtime import atomic

    monkeypatch.setenv(environment.STORE, str(tmp_path / "store"))
    hs = store.Store("hidden")
    seen: list[Path] = []
    hs.put("k", lambda tmp: (seen.append(tmp), tmp.write_text("1")))
    hs.put("k", lambda tmp: (seen.append(tmp), tmp.write_text("2")))
    assert seen[0] != seen[1] and all(f".{atomic.writer_tag()}." in p.name for p in seen)
    assert hs.path("k").read_text() == "2" and oct(hs.path("k").stat().st_mode & 0o777) == \
        oct(0o666 & ~atomic._UMASK)
    left = hs.path("k").with_name(f".k.safetensors.{_dead_pid()}-{atomic.HOST}.xyz.tmp")
    left.write_text("half")
    capture_dir = tmp_path / "store" / f".vllm-hidden.{_dead_pid()}-{atomic.HOST}.q.tmp"
    (capture_dir / "sub").mkdir(parents=True)
    (capture_dir / "sub" / "a.safetensors").write_bytes(b"x" * 10)
    r = gc.gc(tmp_path, None, base=tmp_path / "store")
    assert (r["leftovers_removed"], r["leftovers_bytes"]) == (2, 14)
    assert not left.exists() and not capture_dir.exists() and hs.has("k")


def test_the_dataset_kind_is_one_database_its_rows_gc_and_bound_count_and_remove(
        tmp_path, monkeypatch):
    """data.store_db: replies are rows of one SQLite database, written a transaction per
    engine step; gc removes unreferenced rows oldest first, as it removes hidden files, and
    usage counts both kinds."""
    from eagle3pipe.data import leases

    monkeypatch.setenv(environment.STORE, str(tmp_path / "store"))
    t = store.table()
    assert not t.has("a") and store.usage() == (0, 0) and not t.path.exists()  # nothing made
    objs = {store.key(sample=i): {"reply": list(range(i)), "finish": "length"}
            for i in range(300)}
    t.put_many((k, store.json_entry(o)) for k, o in objs.items())
    t.put_many([(next(iter(objs)), b"other bytes")])  # an entry's key determines it: kept
    assert all(t.has(k) and t.get_json(k) == o for k, o in objs.items())
    n_bytes = sum(len(store.json_entry(o)) for o in objs.values())
    assert store.usage() == (300, n_bytes)
    with store.table() as other:  # another connection (another process) sees every row
        assert other.usage() == (300, n_bytes)
    hs, h = store.Store("hidden"), store.key(sample="h")
    hs.put_hidden(h, [1, 2], torch.zeros(2, SLOTS, H))
    assert store.usage() == (301, n_bytes + hs.path(h).stat().st_size)
    repo = tmp_path / "repo"
    repo.mkdir()
    keep = list(objs)[:5]
    with leases.hold(store.root(), {"dataset": keep}):
        r = gc.gc(repo, None)
    assert (r["entries"], r["removed"]) == (301, 296), r
    assert [k for k in objs if t.has(k)] == keep and not hs.has(h)
    t.close()
    (store.root() / "dataset.sqlite").write_bytes(b"not a database" * 100)
    for f in ("dataset.sqlite-wal", "dataset.sqlite-shm"):
        (store.root() / f).unlink(missing_ok=True)
    with pytest.raises(Error, match="dataset.sqlite: the dataset store's database") as e:
        store.table().has("a")
    assert "fix: if another process holds it" in str(e.value) and "remove it" in str(e.value)


def test_a_pin_outlives_the_entry_and_a_claim_is_one_live_writers(tmp_path, monkeypatch):
    from eagle3pipe.runtime import atomic

    monkeypatch.setenv(environment.STORE, str(tmp_path / "store"))
    hs, k = store.Store("hidden"), store.key(sample=1)
    assert hs.pin(k) is None  # not in the store
    hs.put(k, b"1")
    pinned = hs.pin(k)
    hs.path(k).unlink()  # another rank drops it: the pin still reads
    assert pinned.read_text() == "1" and atomic.LEFTOVER.fullmatch(pinned.name)
    assert hs.claim(k) and not hs.claim(k)  # held by a live writer (this one)
    hs.unclaim(k)
    assert hs.claim(k)
    hs.claim_path(k).write_text(f"{_dead_pid()}-{atomic.HOST}")  # its writer died
    assert gc.dead_claims() == [hs.claim_path(k)]
    r = gc.gc(tmp_path, None, base=tmp_path / "store")
    assert r["leftovers_removed"] == 1 and not hs.claim_path(k).exists()
    hs.claim_path(k).write_text(f"{_dead_pid()}-{atomic.HOST}")
    assert hs.claim(k) and hs.claim_path(k).read_text() == atomic.writer_tag()  # taken over


# ---- a hidden-state server's entries carry the capture identity, checked one by one


def test_a_servers_entry_is_refused_when_its_identity_is_not_the_manifests(tmp_path):
    from safetensors.torch import save_file

    from eagle3pipe.engines.connector import IDENTITY
    from eagle3pipe.hidden import on_demand

    want = on_demand.describe("fp", {"dtype": "float32"}, [1, 2, 3, 4], "0.32.0")
    restarted = on_demand.describe("fp", {"dtype": "float32"}, [1, 2, 4, 4], "0.32.0")
    tensors = {"hidden_states": torch.zeros(2, 4, 8), "token_ids": torch.tensor([1, 2])}
    for name, meta in [("same", want), ("other", restarted), ("none", None)]:
        save_file(tensors, tmp_path / f"{name}.safetensors",
                  metadata={IDENTITY: json.dumps(meta)} if meta else None)
    assert on_demand.identity_mismatch(on_demand.entry_identity(tmp_path / "same.safetensors"),
                                       want) == []
    assert on_demand.identity_mismatch(on_demand.entry_identity(tmp_path / "other.safetensors"),
                                       want) == ["layer_ids: got [1, 2, 4, 4], the manifest "
                                                 "needs [1, 2, 3, 4]"]
    [none] = on_demand.identity_mismatch(on_demand.entry_identity(tmp_path / "none.safetensors"),
                                         want)
    assert none.startswith("identity: the entry carries none")
    # a manifest that did not record vLLM's version does not ask for it
    old = on_demand.describe("fp", {"dtype": "float32"}, [1, 2, 3, 4], None)
    assert "vllm_version" not in old and on_demand.identity_mismatch(restarted | {
        "layer_ids": [1, 2, 3, 4]}, old) == []


def test_the_capture_engine_config_carries_the_identity_to_the_connector(tmp_path):
    from eagle3pipe.engines.connector import IDENTITY
    from eagle3pipe.hidden import capture

    plain = capture.engine_config([1, 2, 3, 4], tmp_path)["kv_transfer_config"]
    assert IDENTITY not in plain["kv_connector_extra_config"]
    ident = {"verifier": "fp", "layer_ids": [1, 2, 3, 4]}
    cfg = capture.engine_config([1, 2, 3, 4], tmp_path, ident)["kv_transfer_config"]
    assert json.loads(cfg["kv_connector_extra_config"][IDENTITY]) == ident


# ---- on CUDA, on-demand engines run batch-invariant, and their keys and identity say so


def test_on_demand_settings_add_batch_invariance_on_cuda_only_and_keys_and_identity_follow(
        monkeypatch):
    from eagle3pipe.engines import engine
    from eagle3pipe.hidden import keys, on_demand

    base = engine.probe_settings("bfloat16", False)
    # here, without CUDA: nothing added, so the keys and records are the offline ones
    assert engine.on_demand_settings(base) == base
    assert engine.numeric(base, None) == {k: base[k] for k in engine.NUMERIC}
    monkeypatch.setattr(engine, "cuda_available", lambda: True)
    inv = engine.on_demand_settings(base)
    assert engine.numeric(inv, None) == {**engine.numeric(base, None), "batch_invariant": True}
    assert "batch_invariant" not in engine.engine_kwargs(inv, "m")  # an env var, not an arg
    key = lambda s: keys.sample_keys(  # noqa: E731
        "fp", [[1, 2, 3]], [1, 2], engine.numeric(s, None), "bfloat16", "0.32.0")
    assert key(inv) != key(base)  # a batch-variant entry is never read as an invariant one
    want = on_demand.describe("fp", engine.numeric(inv, None), [1, 2], "0.32.0")
    [wrong] = on_demand.identity_mismatch(
        on_demand.describe("fp", engine.numeric(base, None), [1, 2], "0.32.0"), want)
    assert wrong.startswith("engine_settings: ") and "'batch_invariant': True" in wrong, wrong


def test_environment_sets_vllm_batch_invariant_where_the_settings_ask():

    code = ("import os\nfrom eagle3pipe.engines import engine as E\n"
            "s = E.probe_settings('bfloat16', False)\nE.environment(s)\n"
            "a = os.environ.get('VLLM_BATCH_INVARIANT')\n"
            "E.environment({**s, E.BATCH_INVARIANT: True})\n"
            "print(a, os.environ.get('VLLM_BATCH_INVARIANT'))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_BATCH_INVARIANT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["None", "1"], out


def test_the_frozen_heap_holds_the_imports_and_lets_an_engines_cycles_be_collected():
    """engine.frozen_heap: what was alive on entry stays frozen through vLLM's freeze and
    unfreeze calls (no-ops inside); a cycle made inside is never frozen and gc.collect() frees
    it (an engine's objects at its shutdown); the exit unfreezes and restores gc's own."""
    import gc
    import weakref

    from eagle3pipe.engines import engine

    class Node:
        pass

    # Frozen objects that die (other threads' frames, caches) leave the frozen count, so it
    # only bounds from above; a cycle that gc.collect() frees proves it was never frozen.
    real = gc.freeze, gc.unfreeze
    alive = Node()
    with engine.frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0 and gc.freeze is not real[0] and gc.unfreeze is not real[1]
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        gc.freeze()  # vLLM after an engine's start-up: would freeze the cycle
        gc.unfreeze()  # vLLM at its shutdown: would unfreeze the imports
        assert 0 < gc.get_freeze_count() <= frozen
        del a, b
        gc.collect()
        assert gone() is None
        held = Node()
        held.other = held
        later = weakref.ref(held)
        with engine.frozen_heap():  # nested: shares the outermost freeze, freezes nothing new
            assert 0 < gc.get_freeze_count() <= frozen
            del held
            gc.collect()
            assert later() is None
    assert gc.get_freeze_count() == 0 and (gc.freeze, gc.unfreeze) == real and alive


def test_refreeze_adds_what_was_made_since_the_freeze_and_collects_the_garbage_first():
    """engine.refreeze (each engine start with no engine alive): what is alive and was made
    inside the frozen heap (vLLM's modules imported by the first load check or engine start)
    leaves the collector's walks, garbage made there is collected, not frozen; outside a
    frozen heap it freezes nothing."""
    import gc
    import weakref

    from eagle3pipe.engines import engine

    class Node:
        pass

    def tracked(obj) -> bool:  # gc.get_objects() lists every generation but the frozen one
        return any(o is obj for o in gc.get_objects())

    outside = Node()
    outside.other = outside
    engine.refreeze()
    assert gc.get_freeze_count() == 0 and tracked(outside)
    with engine.frozen_heap():
        made, dead = Node(), Node()
        made.other, dead.other = made, dead
        gone = weakref.ref(dead)
        del dead
        assert tracked(made)
        engine.refreeze()
        assert gone() is None and not tracked(made)
    assert gc.get_freeze_count() == 0 and tracked(made)


_HELD = """
import ctypes, sys
from pathlib import Path
from eagle3pipe.runtime import heap

def rss_mib():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(x for x in status if x.startswith("VmRSS:")).split()[1]) / 1024

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
blocks = []
for _ in range(1024):  # 64 MiB in 64 KiB blocks: in the heap, below the mmap threshold
    blocks.append(libc.malloc(64 << 10))
    libc.memset(blocks[-1], 1, 64 << 10)
for p in blocks[:-1]:  # all freed but the top one: free space below a block in use
    libc.free(p)
freed = rss_mib()
released = heap.release_free() if sys.argv[1] == "release" else None
print(round(freed - rss_mib()), released)
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file() or
                    not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
                    reason="glibc's malloc_trim and /proc/self/status (Linux with glibc)")
def test_releasing_the_heap_gives_back_freed_memory_below_a_block_in_use():
    """runtime.heap.release_free: 63 MiB freed below a block still in use leave the resident
    set at once (glibc frees only from a heap's top by itself: the control, in a process of
    its own, gives back nothing)."""
    got = [subprocess.run([sys.executable, "-c", _HELD, mode], capture_output=True,
                          text=True, check=True).stdout.split() for mode in ("release", "keep")]
    (released_mib, ok), (kept_mib, _) = got
    assert ok == "True" and int(released_mib) >= 48 and abs(int(kept_mib)) <= 4, got


def test_a_cuda_engine_refuses_a_manifest_whose_keys_are_for_cpu_states(monkeypatch):
    from types import SimpleNamespace

    from eagle3pipe.config.view import RunSettings
    from eagle3pipe.engines import engine
    from eagle3pipe.hidden import on_demand

    m = online.Manifest(path=Path("artifacts/hidden/manifest.json"), mode="hybrid", keys={},
                        layer_ids=[1, 2], dtype="bfloat16", hidden_size=H,
                        engine=engine.numeric(engine.probe_settings("bfloat16", False), None))
    run = RunSettings(0.9, None, None, False, "auto", None, 4)
    v = SimpleNamespace(fingerprint="fp", model_dir="m", dir="m")
    monkeypatch.setattr(engine, "cuda_available", lambda: True)
    with pytest.raises(Error, match=r"artifacts/hidden/manifest.json: the extract stage ran "
                                    r"where vLLM has no batch-invariant mode(?s:.*)fix: run "
                                    r"`dvc repro -f -s extract` on this machine"):
        with on_demand.source(m, v, run, threads=1):
            pass


def test_a_server_that_went_away_is_retried_with_backoff_for_the_bounded_wait():
    import urllib.error

    from eagle3pipe.hidden import on_demand

    slept: list[float] = []
    calls = iter([ConnectionRefusedError(111, "refused"),
                  urllib.error.URLError(ConnectionResetError(104, "reset")), "answer"])

    def call():
        got = next(calls)
        if isinstance(got, BaseException):
            raise got
        return got

    assert on_demand.with_backoff(call, wait_s=600, what="s", sleep=slept.append) == "answer"
    assert slept == [1.0, 2.0]  # restarted within the wait: the run goes on

    def gone():
        raise urllib.error.URLError(ConnectionRefusedError(111, "refused"))
    slept.clear()
    with pytest.raises(urllib.error.URLError):
        on_demand.with_backoff(gone, wait_s=100, what="s", sleep=slept.append)
    assert slept == [1, 2, 4, 8, 16, 30, 30, 9] and sum(slept) == 100  # capped, then bounded
    for answered in (urllib.error.HTTPError("u", 500, "boom", None, None),
                     urllib.error.URLError(TimeoutError("timed out"))):
        slept.clear()

        def once(e=answered):
            raise e
        with pytest.raises(urllib.error.URLError):  # it answered (or took it): no retry
            on_demand.with_backoff(once, wait_s=100, what="s", sleep=slept.append)
        assert slept == []


def test_the_server_wait_is_a_number_of_seconds(monkeypatch):
    monkeypatch.setenv(environment.SERVER_WAIT, "5")
    assert environment.seconds(environment.SERVER_WAIT, default=600) == 5.0
    monkeypatch.delenv(environment.SERVER_WAIT)
    assert environment.seconds(environment.SERVER_WAIT, default=600) == 600.0
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(environment.SERVER_WAIT, bad)
        with pytest.raises(Error, match=r"\$EAGLE3PIPE_SERVER_WAIT: .* is not a number of "
                                        r"seconds(?s:.*)fix: set it to seconds such as 600"):
            environment.seconds(environment.SERVER_WAIT, default=600)


# ---- the on-demand producer


H, SLOTS = 4, 4


def _manifest(mode: str) -> online.Manifest:
    return online.Manifest(path=Path("manifest.json"), mode=mode, keys={}, layer_ids=[1, 2, 3, 4],
                           dtype="float32", hidden_size=H, engine={})


class Engine:
    """compute(prompts) as an engine gives it: (index, hidden [T, slots, H]) per prompt, the
    value a function of the tokens; records every prompt it was asked for."""

    def __init__(self):
        self.asked: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, prompts):
        with self.lock:
            self.asked += prompts
        for j, ids in enumerate(prompts):
            t = torch.tensor(ids, dtype=torch.float32)
            yield j, t[:, None, None].expand(len(ids), SLOTS, H).clone()


def _producer(mode: str, plan, lead: int = 0, window: int = 1, engine: Engine | None = None):
    tokens = {k: [i + 1, i + 2, i + 3] for i, k in enumerate(sorted({k for p in plan for k in p}))}
    engine = engine or Engine()
    p = online.Producer(engine, store.Store("hidden"), tokens, plan, m=_manifest(mode),
                        lead=lead, batch_size=2, window=window, check=lambda h, ids, k: None)
    return p, engine, tokens


def test_producer_serves_the_plan_in_order_within_its_window():
    plan = [["e1"], ["a", "b"], ["c"], ["d", "a"]]
    p, engine, tokens = _producer("online", plan, lead=1, window=1)
    p.start()
    got = p.get("e1")
    assert got["token_ids"].tolist() == tokens["e1"]
    assert got["hidden_states"][:, 0, 0].tolist() == [float(t) for t in tokens["e1"]]
    p.get("a"), p.get("b")
    # the window is 1 train pack: nothing past the first train pack until it is released
    assert sorted(map(tuple, engine.asked)) == sorted(tuple(tokens[k]) for k in ("e1", "a", "b"))
    p.release(["a", "b"])
    p.get("c")
    p.release(["c"])
    p.get("d")
    stats = p.close()
    assert stats["computed"] == 5 and stats["mode"] == "online"
    assert [tokens[k] for k in ("e1", "a", "b", "c", "d")] == engine.asked  # each once


def _consume(p, plan) -> dict:
    """The trainer's side: each pack's keys read, then the pack released; the producer's stats."""
    p.start()
    for pack in plan:
        for k in pack:
            p.get(k)
        p.release(pack)
    return p.close()


def test_online_deletes_after_the_last_use_and_hybrid_keeps_within_budget(monkeypatch):
    plan = [["a", "b"], ["a"], ["c"]]
    p, _, _ = _producer("online", plan, window=3)
    stats = _consume(p, plan)
    assert stats["deleted"] == 3 and stats["computed"] == 3, stats
    assert not any(p.hs.has(k) for k in ("a", "b", "c"))
    # hybrid: a bound of one entry's bytes keeps one entry; the others go
    monkeypatch.setenv(environment.STORE_MAX_BYTES, "0")
    stats = _consume(_producer("hybrid", plan, window=3)[0], plan)
    assert stats["kept_in_store"] == 0 and stats["deleted"] == 3, stats  # 0 keeps nothing
    one = store.Store("hidden").put_hidden("x", [1, 2, 3], torch.zeros(3, SLOTS, H)).stat().st_size
    store.Store("hidden").path("x").unlink()
    monkeypatch.setenv(environment.STORE_MAX_BYTES, str(one))
    assert _consume(_producer("hybrid", plan, window=3)[0], plan)["kept_in_store"] == 1
    # two ranks of one run share the bound: each keeps at most half of what it leaves free
    for k in ("a", "b", "c"):
        store.Store("hidden").path(k).unlink(missing_ok=True)
    monkeypatch.setenv(environment.STORE_MAX_BYTES, str(3 * one))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _consume(_producer("hybrid", plan, window=3)[0], plan)["kept_in_store"] == 1


def _hybrid_rank(rank: int, world: int, plan: list[list[str]], tokens: dict, barrier, out) -> None:
    """One training process of a hybrid run: every world-th pack of the run's plan, in lockstep
    with the others (as DDP's per-step all-reduce keeps them); puts (rank, the prompts its
    engine computed, its stats)."""
    os.environ["WORLD_SIZE"] = str(world)
    engine = Engine()
    mine = plan[rank::world]
    used = store.used_bytes()  # as supply() measures it: on every rank before any computes
    barrier.wait(timeout=60)
    p = online.Producer(engine, store.Store("hidden"), tokens, mine, m=_manifest("hybrid"),
                        lead=0, batch_size=2, window=1, check=lambda h, ids, k: None,
                        used=used).start()
    for pack in mine:
        for k in pack:
            p.get(k)
        p.release(pack)
        barrier.wait(timeout=60)
    out.put((rank, [tuple(t) for t in engine.asked], p.close()))


def _hybrid_run(world: int, epochs: int, samples: int) -> tuple[dict, list[tuple], list]:
    """`world` processes of one hybrid run over `epochs` seeded shuffles of `samples` samples in
    packs of 2: (each rank's stats, every prompt any rank's engine computed, the plan)."""
    import multiprocessing as mp

    names = [f"s{i}" for i in range(samples)]
    tokens = {k: [i + 1, i + 2, i + 3] for i, k in enumerate(names)}
    g = torch.Generator().manual_seed(0)
    plan = [[names[j] for j in order[i:i + 2]] for order in
            (torch.randperm(samples, generator=g).tolist() for _ in range(epochs))
            for i in range(0, samples, 2)]
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_hybrid_rank, args=(r, world, plan, tokens, barrier, out))
             for r in range(world)]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert all(proc.exitcode == 0 for proc in procs)
    return {r[0]: r[2] for r in results}, sum((r[1] for r in results), []), plan


@pytest.mark.integration  # starts processes
def test_two_hybrid_processes_share_one_bound_and_compute_each_sample_once(monkeypatch):
    one = store.Store("hidden").put_hidden("x", [1, 2, 3], torch.zeros(3, SLOTS, H)).stat().st_size
    store.Store("hidden").path("x").unlink()
    monkeypatch.setenv(environment.STORE_MAX_BYTES, str(8 * one))
    stats, computed, plan = _hybrid_run(world=2, epochs=2, samples=8)
    # each sample once in the whole run, as `eagle3pipe plan` counts hybrid's forwards (every
    # sample's tokens once: tools/plan.py modes_of): a sample that epoch 2 gives the other rank
    # is read from the store, where the rank that computed it in epoch 1 left it
    assert len(computed) == len(set(computed)) == 8, computed
    assert sum(map(len, computed)) == 8 * 3  # forwards in tokens: 8 samples of 3
    rank = [{k: n % 2 for n, pack in enumerate(plan[e * 4:e * 4 + 4]) for k in pack}
            for e in (0, 1)]
    moved = sum(rank[0][k] != rank[1][k] for k in rank[0])
    assert moved and sum(s["read_from_store"] for s in stats.values()) == moved
    assert sum(s["kept_in_store"] for s in stats.values()) == 8
    held = sum(p.stat().st_size for p in store.Store("hidden").entries())
    assert held <= 8 * one and not list(store.root().rglob("*.tmp"))  # no pins left behind
    assert not list(store.root().rglob(f"*{store.CLAIM}"))  # every claim released
    # a bound of 4 entries: the ranks keep 2 each and the store stays within it; the 4 kept
    # serve epoch 2, the others are computed again there (once: at most twice in two epochs)
    # unless the other rank pinned them before their rank dropped them
    for p in store.Store("hidden").entries():
        p.unlink()
    monkeypatch.setenv(environment.STORE_MAX_BYTES, str(4 * one))
    stats, computed, _ = _hybrid_run(world=2, epochs=2, samples=8)
    assert [s["kept_in_store"] for s in stats.values()] == [2, 2], stats
    assert 8 <= len(computed) <= 8 + 4 and max(map(computed.count, computed)) <= 2, computed
    assert sum(p.stat().st_size for p in store.Store("hidden").entries()) <= 4 * one


def test_online_cleanup_leaves_what_another_live_run_holds_a_lease_on():
    from eagle3pipe.data import leases

    plan = [["a", "b"], ["c"]]
    p, _, _ = _producer("online", plan, window=2)
    with leases.hold(store.root(), {"hidden": ["b", "zz"]}):  # another run reads b
        stats = _consume(p, plan)
    assert stats["computed"] == 3 and stats["deleted"] == 2, stats
    assert p.hs.has("b") and not p.hs.has("a") and not p.hs.has("c")


# ---- leases: what a live run still needs, which gc, bounds and other runs' cleanup keep


def test_a_lease_is_held_while_its_block_runs_and_its_heartbeat_renews_it():
    from eagle3pipe.data import leases

    base = store.root()
    with leases.hold(base, {"hidden": ["k1", "k2"], "dataset": ["r"]}, heartbeat=0.05) as mine:
        assert leases.held(base) == {"hidden": {"k1", "k2"}, "dataset": {"r"}}
        assert leases.held(base, mine=mine) == {}  # a run's own cleanup sees only others'
        os.utime(mine, (1, 1))  # as if its last beat were long ago: the next beat renews it
        deadline = time.time() + 10
        while mine.stat().st_mtime < 2 and time.time() < deadline:
            time.sleep(0.02)
        assert mine.stat().st_mtime > time.time() - 60 and leases.dead(base) == []
    assert not mine.exists() and leases.held(base) == {}


def test_a_held_lease_keeps_no_key_alive():
    """A data stage holds a lease per batch until its output is published: a key kept alive by
    each would grow with the data (bench/conversations.py's memory figure)."""
    import contextlib
    import sys

    from eagle3pipe.data import leases

    key = "".join(["k", "e", "y"])  # a string of its own (not interned)
    before = sys.getrefcount(key)
    with contextlib.ExitStack() as stack:  # as the dataset stage holds them
        stack.enter_context(leases.hold(store.root(), {"dataset": [key]}))
        assert sys.getrefcount(key) == before
        assert leases.held(store.root()) == {"dataset": {"key"}}


def test_leases_share_the_process_heartbeat_thread():
    """A lease per batch and turn depth (the dataset stage's) starts no thread of its own: a
    thread each grew the resident set with the number of batches."""
    import contextlib

    from eagle3pipe.data import leases

    with contextlib.ExitStack() as stack:
        stack.enter_context(leases.hold(store.root(), {"dataset": ["k0"]}))
        before = threading.active_count()
        for i in range(1, 30):
            stack.enter_context(leases.hold(store.root(), {"dataset": [f"k{i}"]}))
        assert threading.active_count() == before
        assert leases.held(store.root()) == {"dataset": {f"k{i}" for i in range(30)}}


def test_the_ranks_of_one_run_share_their_entries_and_other_runs_leases_hold():
    from eagle3pipe.data import leases

    base = store.root()
    with leases.hold(base, {"hidden": ["a"]}, run="job1") as rank0, \
            leases.hold(base, {"hidden": ["b"]}, run="job1") as rank1, \
            leases.hold(base, {"hidden": ["c"]}, run="job2"), \
            leases.hold(base, {"hidden": ["d"]}):
        assert leases.held(base, mine=rank0) == {"hidden": {"c", "d"}}
        assert leases.held(base, mine=rank1) == {"hidden": {"c", "d"}}
        assert leases.held(base) == {"hidden": {"a", "b", "c", "d"}}  # gc keeps every run's


def test_dead_leases_hold_nothing_and_gc_removes_them(tmp_path):
    from eagle3pipe.data import leases
    from eagle3pipe.runtime import atomic

    base = store.root()
    (base / leases.LEASES).mkdir(parents=True)
    doc = lambda ks: json.dumps({"keys": {"hidden": ks}})  # noqa: E731
    killed = base / leases.LEASES / f"{_dead_pid()}-{atomic.HOST}.a.json"  # its run was killed
    stalled = base / leases.LEASES / f"{os.getpid()}-{atomic.HOST}.b.json"  # no beat for long
    remote = base / leases.LEASES / "4242-0123abcd.c.json"  # another node's, beating
    for f, ks in ((killed, ["x0"]), (stalled, ["y0"]), (remote, ["z0"])):
        f.write_text(doc(ks))
    old = time.time() - leases.TTL_S - 1
    os.utime(stalled, (old, old))
    assert leases.held(base) == {"hidden": {"z0"}}
    assert leases.dead(base) == sorted([killed, stalled])
    hs = store.Store("hidden")
    for k in ("x0", "y0", "z0"):
        hs.put_hidden(k, [1, 2], torch.zeros(2, SLOTS, H))
    repo = tmp_path / "repo"
    repo.mkdir()
    r = gc.gc(repo, None)  # every unreferenced entry: all but the live lease's
    assert (r["removed"], r["leftovers_removed"]) == (2, 2), r
    assert hs.has("z0") and not hs.has("x0") and not hs.has("y0")
    assert not killed.exists() and not stalled.exists() and remote.exists()


def test_gc_and_a_bound_keep_what_a_live_run_leases_then_remove_it(tmp_path):
    from eagle3pipe.data import leases

    hs = store.Store("hidden")
    for k in ("old", "new"):
        hs.put_hidden(k, [1, 2], torch.zeros(2, SLOTS, H))
    repo = tmp_path / "repo"
    repo.mkdir()
    with leases.hold(store.root(), {"hidden": ["old"]}):
        r = gc.gc(repo, 0)  # a bound of nothing, as another run's enforce_bound could have
        assert r["removed"] == 1 and hs.has("old") and not hs.has("new"), r
    assert gc.gc(repo, 0)["removed"] == 1 and not hs.has("old")


def test_a_pack_the_trainer_is_past_is_not_computed_again():
    """The trainer may finish a pack whose keys an earlier pack made ready before the producer
    reaches it; online has then deleted them after their last use, and the producer must skip
    that pack rather than compute its keys again (for nothing: no one reads them)."""
    go = threading.Event()

    class Slow(Engine):
        def __call__(self, prompts):
            yield from super().__call__(prompts)
            go.wait(30)  # the producer's thread stays in pack 0 until the trainer is past pack 1

    plan = [["a"], ["a"], ["b"]]
    p, engine, tokens = _producer("online", plan, window=3, engine=Slow())
    p.start()
    for pack in plan[:2]:
        p.get("a")
        p.release(pack)
    assert not p.hs.has("a")  # its last use is done: deleted
    go.set()
    p.get("b")
    p.release(["b"])
    stats = p.close()
    assert stats["computed"] == 2 and engine.asked == [tokens["a"], tokens["b"]], stats


def test_a_failing_engine_fails_the_trainer_with_the_fix():
    def broken(prompts):
        raise RuntimeError("engine died")
        yield  # noqa: unreachable: a generator
    p = online.Producer(broken, store.Store("hidden"), {"a": [1, 2]}, [["a"]],
                        m=_manifest("online"), lead=0, batch_size=1, window=1,
                        check=lambda h, ids, k: None).start()
    with pytest.raises(online.OnlineError, match="producer failed: RuntimeError: engine died"):
        p.get("a")
    p.close()


# ---- the capture spec: the slots' layer ids, names and dtype, capture.json, the store keys


def test_capture_spec_slots_layer_ids_and_names():
    assert spec.layer_ids([1, 7, 13], 16) == [1, 7, 13, 16]
    assert spec.num_slots([1, 7, 13]) == 4
    assert spec.slot_names([1, 7, 13]) == ["layer_input_1", "layer_input_7", "layer_input_13",
                                           "final_pre_norm"]
    assert spec.torch_dtype("bfloat16") is torch.bfloat16
    assert set(spec.STORED_DTYPES) == {"bfloat16", "float16", "float32"}
    for name in spec.STORED_DTYPES:
        assert str(spec.torch_dtype(name)) == f"torch.{name}"


def test_capture_json_round_trips_and_refuses_what_no_capture_is(tmp_path):
    arch = type("Arch", (), {"aux_layer_ids": (1, 7, 13), "target_hidden_size": 128,
                             "verifier_num_layers": 16})()
    f = tmp_path / "capture.json"
    f.write_text(json.dumps(spec.render(arch)))
    got = spec.read_capture(f)
    assert (got.aux_layer_ids, got.hidden_size, got.verifier_num_layers, got.final) == \
        ((1, 7, 13), 128, 16, "pre_norm")
    assert got.layer_ids == [1, 7, 13, 16] and got.num_slots == 4
    for bad, match in [({"aux_layer_ids": [7, 1, 13]}, "distinct and ascending"),
                       ({"aux_layer_ids": [1, 7, 17]}, r"out of range \[0, 16\]"),
                       ({"final": "post_norm"}, "not supported"),
                       ({"hidden_size": 0}, "positive integer")]:
        f.write_text(json.dumps({**spec.render(arch), **bad}))
        with pytest.raises(spec.ExtractError, match=match):
            spec.read_capture(f)


def test_store_keys_change_with_each_thing_that_determines_the_states():
    base = dict(fingerprint="v1", token_lists=[[1, 2, 3]], ids=[1, 7, 13, 16],
                numeric={"dtype": "bfloat16", "tensor_parallel_size": 1}, dtype="bfloat16",
                vllm="0.32.0")
    [k] = keys.sample_keys(**base)
    assert keys.sample_keys(**base) == [k]  # the same inputs, the same key
    for change in [{"fingerprint": "v2"}, {"token_lists": [[1, 2, 4]]}, {"ids": [1, 7, 12, 16]},
                   {"numeric": {"dtype": "float32", "tensor_parallel_size": 1}},
                   {"dtype": "float32"}, {"vllm": "0.33.0"}]:
        assert keys.sample_keys(**{**base, **change}) != [k], change
