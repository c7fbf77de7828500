"""DVC stage `extract`: verifier hidden states (3 aux layers + pre-norm final) in speculators'
on-disk layout. See src/eagle3pipe/stages/extract.py."""
from eagle3pipe.stages import extract
from eagle3pipe.stages import runner as stage

if __name__ == "__main__":
    stage.main("extract", extract.run,
               paths=("verifier", "dataset", "capture", "out", "metrics"), doc=__doc__)
