"""Checkpoints in and out of DCS: export a step as a Hugging Face directory, import a torch DCP or Hugging Face
checkpoint as a committed step (`dcs ckpt export|import`, docs/checkpoints.md "Export and import").

- `hf_export`: a committed step's tensors under a prefix (`model/`) become `model.safetensors` (or shards and
  `model.safetensors.index.json`) with the prefix stripped, read once and verified against the step's checksums.
- `foreign`: reading a Hugging Face directory or a DCP directory as untrusted input (bounded headers, a
  restricted unpickler for DCP's pickled metadata, names that stay inside the directory).
- `writer`: writing a state as a committed step without a worker, through the same ledger, layout, durable
  writer and manifest as a save.

Nothing here imports transformers: an export is plain safetensors files and JSON.
"""

from __future__ import annotations

from dcs_tasks.interop.foreign import ForeignCheckpointError

__all__ = ["ForeignCheckpointError"]
