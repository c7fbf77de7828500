"""DVC stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) on the verifier's hidden
states, seeded; dvclive writes metrics/train/. See src/eagle3pipe/stages/train.py."""
from eagle3pipe.stages import runner, train

if __name__ == "__main__":
    runner.main("train", train.run, paths=("draft_config", "verifier", "hidden", "vocab", "out"),
                estimate=train.estimate, doc=__doc__)
