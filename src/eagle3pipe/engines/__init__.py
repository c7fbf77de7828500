"""vLLM, the engine every verifier stage runs: engine settings and start-up (engine), hidden-state
capture (capture, connector), the engine-less load check (load_check) and timed passes (speed)."""
