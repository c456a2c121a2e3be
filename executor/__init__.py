"""roseinfer.executor."""
