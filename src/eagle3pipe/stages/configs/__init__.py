"""The configs stage: every derived config under configs/ (run.render_files, run.render_into)."""
