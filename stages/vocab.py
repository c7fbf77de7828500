"""DVC stage `vocab`: d2t/t2d for draft.draft_vocab_size from loss-masked training tokens.
See src/eagle3pipe/stages/vocab/run.py."""
from eagle3pipe.stages import runner
from eagle3pipe.stages.vocab import run as vocab
if __name__ == "__main__":
    runner.main("vocab", vocab.run, paths=("dataset", "verifier_config", "out"),
                doc=__doc__)
