"""The extract stage: the verifier's hidden states through vLLM, checked, in speculators' layout."""
