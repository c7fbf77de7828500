"""stages/verifier."""
