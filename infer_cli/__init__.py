"""infer_cli."""
