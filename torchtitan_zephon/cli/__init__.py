"""The `zephon` command."""
