"""The verifier stage: the embedded verifier built, or an existing checkpoint fingerprinted."""
