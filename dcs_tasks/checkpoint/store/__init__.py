"""The store stage of checkpoints (3 of 6): committed steps as bytes, one package per concern: `ledger/` (the Redis
step ledger, `latest`, listing steps, incremental references, retention), `reads/` (verified reads by where the bytes
are, and a step's manifest and files checked), `peers/` (the memory tier's peer transport), `tiers/` (the memory
tier's bookkeeping); `payloads` holds what the checkpoint tasks carry. A module imports only its own stage and
earlier ones (docs/architecture.md, "Checkpoint stages"); this file stays a docstring (a re-export would be an
import edge)."""
