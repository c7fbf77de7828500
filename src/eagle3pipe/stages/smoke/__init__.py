"""stages/smoke."""
