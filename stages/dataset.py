"""DVC stage `dataset`: prompts + verifier-regenerated replies, tokenized, with loss masks.
See src/eagle3pipe/dataset.py."""
from eagle3pipe import dataset, stage

if __name__ == "__main__":
    stage.main("dataset", dataset.run, paths=("verifier", "out", "metrics"), doc=__doc__)
