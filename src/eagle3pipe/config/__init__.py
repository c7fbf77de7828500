"""params.yaml: the typed schema, the loader whose errors name file, line and key, and the
per-stage view that refuses keys dvc.yaml does not declare."""
