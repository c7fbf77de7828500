"""The verifier's hidden states, one owner: the capture spec and capture.json (spec), store keys
(keys), vLLM's capture (capture), checks on captured states (checks), the transformers oracle
(oracle), and hidden states on demand while training (online, on_demand)."""
