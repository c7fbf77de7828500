"""DVC stage `dataset`: prompts + verifier-regenerated replies, tokenized, with loss masks.
See src/eagle3pipe/stages/dataset.py."""
from eagle3pipe.stages import dataset
from eagle3pipe.stages import runner as stage

if __name__ == "__main__":
    stage.main("dataset", dataset.run, paths=("verifier", "out", "metrics"), doc=__doc__)
