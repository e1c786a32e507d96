"""Durable writes of checkpoint files (store stage: no torch): a file written to a temp name with large (O_DIRECT
where the file system allows) writes, fsynced, renamed, its directory fsynced, and file locks (`durable`); a file
written zstd-compressed the same way (`zwrite`). This file stays a docstring (a re-export would be an import
edge)."""
