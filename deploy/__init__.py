"""The application layer: `ClusterConfig` (config.py), the launcher (`pdserve serve`, launch.py) and
the command line (cli.py). It sits on top of everything: it may import the workers and the router;
nothing below it imports it (tests/test_layering.py)."""
