"""The save stage of checkpoints (4 of 6): the shared-memory staging buffers and the copy into them. A module imports
only its own stage and earlier ones (docs/architecture.md, "Checkpoint stages"); this file stays a docstring (a re-
export would be an import edge)."""
