"""Checkpoint tasks (persist, commit, retention)."""
