"""The router's workers: a client per worker, the set by role, health polls and failure handling."""
