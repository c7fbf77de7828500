"""DVC stage `export`: the trained draft in both formats vLLM loads, each contract-checked.
See src/eagle3pipe/stages/export.py."""
from eagle3pipe.stages import export
from eagle3pipe.stages import runner as stage

if __name__ == "__main__":
    stage.main("export", export.run,
               paths=("checkpoint", "speculators_config", "vllm_config", "verifier", "out"),
               doc=__doc__)
