"""stages/configs."""
