"""The train stage: speculators' Eagle3DraftModel trained by run (setup, step, evaluate, fit) on
batches, with model, checkpoint (resume) and metrics (dvclive)."""
