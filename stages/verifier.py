"""DVC stage `verifier`: build the embedded verifier (verifier.path: null) or fingerprint an
existing Hugging Face checkpoint (verifier.path: DIR). See src/eagle3pipe/stages/verifier.py."""
from eagle3pipe.stages import runner as stage
from eagle3pipe.stages import verifier as verifier_stage

if __name__ == "__main__":
    stage.main("verifier", verifier_stage.run, paths=("out", "metrics"), doc=__doc__)
