"""The `dcs` command line."""
