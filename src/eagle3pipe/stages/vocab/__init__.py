"""stages/vocab."""
