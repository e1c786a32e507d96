"""The format stage of checkpoints (1 of 6): what a step is on disk: names, layout and manifest model, zstd file form,
durable writes, checks. A module imports only its own stage and earlier ones (docs/architecture.md, "Checkpoint
stages"); this file stays a docstring (a re-export would be an import edge)."""
