"""Shared test helpers, imported by the test modules as `from helpers import ...` (pytest puts
tests/ on sys.path: pyproject.toml's [tool.pytest.ini_options] pythonpath). No test module
imports another: what two of them share lives here. Modules here import one another relatively
(`from .micro import ROOT`), so that the package also imports as `tests.helpers` (the benchmark).

- micro: the repository root and the micro pipeline's settings (tests/micro/params.yaml, the
  micro embedded verifier's shape, its vLLM engine settings).
- pipeline: the real pipeline with real DVC in a temporary git repository (also the benchmark's
  harness: bench/pipeline_bench.py imports it as `tests.helpers.pipeline`).
- checkpoints: tiny random verifier checkpoints of each model family vLLM serves with EAGLE-3.
- drafts: real EAGLE-3 draft checkpoints in both layouts.
- training: the train stage's inputs for the micro verifier (draft config, hidden states, vocab
  map), for the train and export tests.
- sparse: Hugging Face-shaped checkpoints of many GiB that take no disk (sparse files).
- malformed: every malformed input the suite hands the pipeline, by kind (the tests'
  parametrized cases and docs/inputs.md's rows).
"""
