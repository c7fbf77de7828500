"""What each stage will run, hold and write, estimated before any compute (figures, size, the
per-stage estimates in stages) and the stage runner's check of it (check). Refuse-only: an
estimate logs a line or refuses a run before any compute and never changes an output byte, so
no stage's code deps list this package (eagle3pipe.tools.deps.REFUSE_ONLY); only the stage
runner and the tools import it."""
