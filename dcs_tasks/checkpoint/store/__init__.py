"""The store stage of checkpoints (3 of 6): committed steps as bytes: listing, verified reads, the ledger, incremental
refs, retention, tiers. A module imports only its own stage and earlier ones (docs/architecture.md, "Checkpoint
stages"); this file stays a docstring (a re-export would be an import edge)."""
