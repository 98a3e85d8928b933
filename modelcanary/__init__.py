"""The `modelcanary` command: the composition root, above `service` and `collectors` (see compose.py)."""
