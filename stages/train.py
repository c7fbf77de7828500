"""DVC stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) on the verifier's hidden
states, seeded; dvclive writes metrics/train/. Run as DVC's command, this process becomes torchrun
(node 0 of train.nnodes, train.nproc_per_node workers: eagle3pipe.runtime.launch), and each
worker trains. See src/eagle3pipe/stages/train/run.py."""
from eagle3pipe.runtime import launch
from eagle3pipe.stages import runner

PATHS = ("draft_config", "verifier", "hidden", "vocab", "out", "metrics_dir")

if __name__ == "__main__":
    if launch.under_torchrun():  # a worker: trains
        from eagle3pipe.stages.train import run as train
        runner.main("train", train.run, paths=PATHS, estimate=True, doc=__doc__)
    else:  # the stage's command: replaced by torchrun, whose workers take the branch above
        runner.main("train", launch.node0, paths=PATHS, doc=__doc__)
