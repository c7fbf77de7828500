"""GPU check: the micro pipeline with CUDA vLLM (every engine stage) and CUDA training, in a
temporary copy of the repository, no network. Prints what it measured; exits non-zero when a
stage fails. Meant for a 1-GPU machine whose image has CUDA torch and vllm (and, if present,
dvc, else the dvc.yaml commands run in order):

    python bench/gpu_check.py            # ~5-10 min on one H200-class GPU

The micro params (tests/micro/params.yaml) with: train.device cuda, vllm.enforce_eager false,
vllm.dtype bfloat16, vllm.kv_cache_memory_bytes null (sized by gpu_memory_utilization 0.5).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHANGES = {("train", "device"): "cuda", ("vllm", "enforce_eager"): False,
           ("vllm", "dtype"): "bfloat16", ("vllm", "kv_cache_memory_bytes"): None,
           ("vllm", "gpu_memory_utilization"): 0.5}


def load_yaml(path: Path):
    try:
        from ruamel.yaml import YAML
        return YAML(typ="safe").load(path.read_text())
    except ImportError:
        import yaml
        return yaml.safe_load(path.read_text())


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run this on a GPU machine")
        return 3
    work = Path(tempfile.mkdtemp(prefix="eagle3pipe-gpu-"))
    repo = work / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", "artifacts", ".dvc/cache",
                                                              ".git"))
    params = load_yaml(ROOT / "tests/micro/params.yaml")
    for (section, key), value in CHANGES.items():
        params[section][key] = value
    (repo / "params.yaml").write_text(json.dumps(params, indent=2))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "PYTHONHASHSEED": "0"}
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, in {repo}")
    stages = load_yaml(repo / "dvc.yaml")["stages"]
    times = {}
    for name, body in stages.items():
        cmd = body["cmd"].replace("${train.nproc_per_node}", "1")
        t0 = time.perf_counter()
        r = subprocess.run(cmd, shell=True, cwd=repo, env=env)
        times[name] = round(time.perf_counter() - t0, 1)
        print(f"gpu_check: {name}: exit {r.returncode} in {times[name]} s")
        if r.returncode:
            return r.returncode
    for f in ("extract.json", "smoke.json", "train/metrics.json"):
        print(f"gpu_check: metrics/{f}:", (repo / "metrics" / f).read_text())
    print("gpu_check: seconds per stage", json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
