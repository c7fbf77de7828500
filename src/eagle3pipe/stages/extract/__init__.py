"""stages/extract."""
