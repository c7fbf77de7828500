"""DVC stage `smoke`: real vLLM loads the verifier with each exported EAGLE-3 draft format,
generates greedily (lossless vs non-speculative), and records acceptance beside vLLM's ngram
baseline, and the draft's acceptance on the eval split beside the trainer's estimate.
See src/eagle3pipe/stages/smoke/run.py."""
from eagle3pipe.stages import runner
from eagle3pipe.stages.smoke import run as smoke
if __name__ == "__main__":
    runner.main("smoke", smoke.run,
                paths=("export", "verifier", "dataset", "train_metrics", "metrics", "plots"),
                estimate=True, doc=__doc__)
