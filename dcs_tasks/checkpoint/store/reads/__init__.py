"""Verified reads of checkpoint files (store stage: no torch), by where the bytes are: files on a file system
(`fileread`: chunked O_DIRECT or buffered `preadv` in a few threads, hashed in order), compressed files (`zread`),
objects in an object store (`objread`: parallel ranged GETs), and the destinations they all land in (`landing`).
Every reader checks each file's size and checksum. This file stays a docstring (a re-export would be an import
edge)."""
