"""Data on disk: tokenized samples, the per-sample content-addressed store, training batches and
evaluation prompts."""
