"""stages/train."""
