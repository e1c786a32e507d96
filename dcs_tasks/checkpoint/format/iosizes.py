"""The checkpoint I/O constants in one place: chunk sizes of each path, O_DIRECT and its alignment.

The three chunk sizes differ on purpose (one per path, kept as they were): the modules that use
them keep their short names (`durable.CHUNK_BYTES`, ...) bound to these, which tests may patch per module.
"""

from __future__ import annotations

import os

WRITE_CHUNK_BYTES = 16 * 1024 * 1024  # durable: one write + hash step of a durable file
READ_CHUNK_BYTES = 32 * 1024 * 1024  # fileread: one read of a verified restore
READ_THREADS = 4  # fileread and zread: threads of one verified restore's reads
COPY_CHUNK_BYTES = 64 * 1024 * 1024  # copier: one memmove of a parallel staging copy
DIRECT_ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the logical block size
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (buffered I/O then)
O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
