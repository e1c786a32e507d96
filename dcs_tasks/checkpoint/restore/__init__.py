"""The restore stage of checkpoints (5 of 6): reading steps back into tensors: manifest checks, reads, resharding,
DTensors, the planner. A module imports only its own stage and earlier ones (docs/architecture.md, "Checkpoint
stages"); this file stays a docstring (a re-export would be an import edge)."""
