"""vLLM, the engine every verifier stage runs: engine settings and start-up (engine), hidden-state
capture (capture, connector), the engine-less load check (load_check), the verifier's tensor names
checked against vLLM's class (verifier_names) and timed passes (speed)."""
