"""stages/dataset."""
