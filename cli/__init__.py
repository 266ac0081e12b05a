"""The `ftune` command line."""
