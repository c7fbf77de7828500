"""vLLM, the engine every verifier stage runs: engine settings and start-up (engine), the
hidden-state connector (connector), the checkpoint's tensor names checked against vLLM's class
before any compute (preflight, verifier_names), the engine-less load check of an export
(load_check) and its forward pass against speculators' (forward_check), vLLM's own chat
rendering without an engine (rendering) and the serving recipe (serving)."""
