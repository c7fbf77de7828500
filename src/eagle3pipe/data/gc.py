"""The per-sample store's size: garbage collection (`eagle3pipe gc`) and the bound each data
stage enforces after publishing (eagle3pipe.data.store's docstring says what is kept and why).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eagle3pipe.data import leases
from eagle3pipe.data.store import CLAIM, FILES, KINDS, Store, bound, root, table, usage
from eagle3pipe.runtime.atomic import dead_writers, remove, writer_alive
from eagle3pipe.runtime.units import human

log = logging.getLogger("eagle3pipe.data.gc")


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
    for kind in FILES:
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
    with table(base) as t:
        # (mtime, kind, key, bytes, path or None: a row of the dataset kind's table)
        entries = [(m, "dataset", k, b, None) for m, k, b in t.rows()]
        entries += [(p.stat().st_mtime, kind, p.name[:-len(ext)], p.stat().st_size, p)
                    for kind, ext in FILES.items() for p in Store(kind, base).entries()]
        total = sum(e[3] for e in entries)
        removed = freed = 0
        rows: list[str] = []
        for _, kind, k, size, p in sorted(entries, key=lambda e: e[:3]):
            if max_bytes is not None and total - freed <= max_bytes:
                break
            if k in keep[kind]:
                continue
            if not dry_run and p is None:
                rows.append(k)
            elif not dry_run:
                p.unlink()
            removed, freed = removed + 1, freed + size
        t.remove(rows)
    kept_bytes = total - freed
    left, left_bytes = leftovers(base or root(), dry_run=dry_run)
    return {"store": str((base or root())), "entries": len(entries), "bytes": total,
            "removed": removed, "freed_bytes": freed, "bytes_after": kept_bytes,
            "leftovers_removed": len(left), "leftovers_bytes": left_bytes,
            "referenced": sum(map(len, keep.values())),
            "over_bound": max_bytes is not None and kept_bytes > max_bytes}
