"""DVC stage `export`: the trained draft in both formats vLLM loads, each contract-checked.
See src/eagle3pipe/stages/export/run.py."""
from eagle3pipe.stages import runner
from eagle3pipe.stages.export import run as export
if __name__ == "__main__":
    runner.main("export", export.run, paths=("checkpoint", "speculators_config", "vllm_config", "verifier", "out"),
                estimate=True, doc=__doc__)
