"""DVC stage `dataset`: prompts + verifier-regenerated replies, tokenized, with loss masks.
See src/eagle3pipe/stages/dataset/run.py."""
from eagle3pipe.stages import runner
from eagle3pipe.stages.dataset import run as dataset
if __name__ == "__main__":
    runner.main("dataset", dataset.run, paths=("verifier", "out", "metrics"),
                estimate=True, doc=__doc__)
