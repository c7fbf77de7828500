"""DVC stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) on the verifier's hidden
states, seeded; dvclive writes metrics/train/. One process on one node trains in DVC's command
itself; for several (train.nproc_per_node, train.nnodes) this process becomes torchrun (node 0:
eagle3pipe.runtime.launch), and each of its workers trains. See
src/eagle3pipe/stages/train/run.py."""
from eagle3pipe.runtime import launch
from eagle3pipe.stages import runner

PATHS = ("draft_config", "verifier", "hidden", "vocab", "out", "metrics_dir")


def train_or_launch(params, paths):
    """Trains here when this process is a torchrun worker or the only training process;
    otherwise it is replaced by torchrun (never returns), whose workers come back here."""
    if not launch.under_torchrun() and launch.needs_torchrun(params.train):
        launch.node0(params, paths)
    from eagle3pipe.stages.train import run as train

    return train.run(params, paths)


if __name__ == "__main__":
    runner.main("train", train_or_launch, paths=PATHS, estimate=True, doc=__doc__)
