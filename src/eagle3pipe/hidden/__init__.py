"""hidden."""
