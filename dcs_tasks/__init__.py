"""DCS: asynchronous checkpoints and weight synchronisation for distributed training."""
