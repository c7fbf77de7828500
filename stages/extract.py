"""DVC stage `extract`: verifier hidden states (3 aux layers + pre-norm final) in speculators'
on-disk layout. See src/eagle3pipe/stages/extract/run.py."""
from eagle3pipe.stages import runner
from eagle3pipe.stages.extract import run as extract
if __name__ == "__main__":
    runner.main("extract", extract.run, paths=("verifier", "dataset", "capture", "out", "metrics"),
                estimate=True, doc=__doc__)
