"""DVC stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) on the verifier's hidden
states, seeded; dvclive writes metrics/train/. See src/eagle3pipe/stages/train.py."""
from eagle3pipe.stages import runner as stage
from eagle3pipe.stages import train

if __name__ == "__main__":
    stage.main("train", train.run,
               paths=("draft_config", "verifier", "hidden", "vocab", "out"), doc=__doc__)
