"""The state stage of checkpoints (2 of 6): a training state as named tensors plus a JSON structure, and where a
DTensor's local shard sits. A module imports only its own stage and earlier ones (docs/architecture.md, "Checkpoint
stages"); this file stays a docstring (a re-export would be an import edge)."""
