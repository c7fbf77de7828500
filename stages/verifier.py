"""DVC stage `verifier`: build the embedded verifier (verifier.path: null) or fingerprint an
existing Hugging Face checkpoint (verifier.path: DIR). See src/eagle3pipe/stages/verifier/run.py."""
from eagle3pipe.stages import runner
from eagle3pipe.stages.verifier import run as verifier
if __name__ == "__main__":
    runner.main("verifier", verifier.run, paths=("out", "metrics"),
                estimate=True, doc=__doc__)
