"""stages/export."""
