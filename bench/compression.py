"""Per-file zstd compression of checkpoints: ratio, throughput, and whether it pays on this disk.

State (built in code, nothing downloaded): a Llama from a `LlamaConfig` (`--hidden`, `--layers`, vocab
32000, untied head) trained `--steps` AdamW steps in fp32 on random tokens; then
  weights   the model's state dict cast to bf16 (what is served or exported)
  adam      the optimizer's exp_avg and exp_avg_sq (fp32), as a mixed-precision trainer keeps them, but not
            those of the input embedding (after a few steps on random tokens most of its rows are still 0)
  ints      int64 token ids (uniform in the vocabulary: real text is skewed and compresses better) and int32
            per-token document indices (`--int-mb` MiB together)
Part 1 (`codec`, one worker file per category, in this process): each category's first `--file-mb` MiB is
staged in tmpfs and persisted by the worker's own writer (`zwrite.write_region`: probe, streaming
hash + zstd, temp, fsync, rename) at each `--levels` level with `--threads` zstd threads, and plain
(`stream_region`, O_DIRECT); then read back verified by restore's reader (`fileread.read_many`, page cache
evicted first). Throughputs count the uncompressed bytes.
Part 2 (`end_to_end`, a private redis-server and a real `dcs worker` with `--workers` processes): the whole
state saved with and without compression (at `--level`) (median of `--repeats` saves to the durable commit, after a
warm-up) and restored (median of `--repeats`, page cache evicted before each, bit-exact checked).
Writes a result file under bench/results/compression/ and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Run, start_redis, start_worker, stop
from bench.save import drop_cache
from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.compression import CompressionSpec
from dcs_tasks.checkpoint.store.reads import fileread
from dcs_tasks.checkpoint.store.writes.zwrite import write_region
from dcs_tasks.config import CheckpointCompression, DCSConfig

MiB = 1 << 20


def build_state(hidden: int, layers: int, steps: int, int_mb: int) -> dict[str, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    weights = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    names = dict(model.named_parameters())
    adam: dict[str, torch.Tensor] = {}
    for name, param in names.items():
        if "embed_tokens" in name:  # after a few steps on random tokens most rows are still exactly 0: flattering
            continue
        state = opt.state[param]
        adam[f"{name}.exp_avg"], adam[f"{name}.exp_avg_sq"] = state["exp_avg"], state["exp_avg_sq"]
    count = int_mb * MiB // 12
    tokens = torch.randint(0, config.vocab_size, (count,), dtype=torch.int64)
    docs = torch.cumsum((torch.rand(count) < 1 / 700).to(torch.int32), 0, dtype=torch.int32)  # ~700-token docs
    return {"weights": weights, "adam": adam, "ints": {"tokens": tokens, "doc_index": docs}}


def flat_bytes(tensors: dict[str, torch.Tensor], limit: int) -> bytes:
    out, size = [], 0
    for t in tensors.values():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append(raw[: limit - size])
        size += len(out[-1])
        if size >= limit:
            break
    return b"".join(out)


def timed(fn: Callable[[], Any], cpu: list[float] | None = None) -> tuple[float, Any]:
    """(wall seconds, result); appends the CPU seconds of this process (all threads) to `cpu` when given."""
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    if cpu is not None:
        cpu.append(time.process_time() - cpu_start)
    return time.perf_counter() - start, result


def codec(category: str, data: bytes, root: Path, levels: list[int], threads: int, repeats: int) -> dict[str, Any]:
    """One worker file of `data`: plain and at each level, written durably then read back cold."""
    shm = Path(tempfile.mkdtemp(prefix="dcs-bench-z-", dir="/dev/shm"))
    staged = shm / "stage"
    staged.write_bytes(data)
    out: dict[str, Any] = {"bytes": len(data)}
    try:
        for level in [None, *levels]:
            spec = None if level is None else CompressionSpec(level=level, min_saving=0.0)
            writes: list[float] = []
            reads: list[float] = []
            write_cpu: list[float] = []
            read_cpu: list[float] = []
            for i in range(repeats):
                final = root / f"{category}-{level}-{i}.safetensors"
                write = partial(write_region, staged, 0, len(data), final, "b", spec, threads)
                seconds, entry = timed(write, write_cpu)
                writes.append(seconds)
                path = entry.stored_path(root)
                drop_cache(root)  # only this file is there
                seconds, maps = timed(partial(fileread.read_many, [(path, entry)], verify=True), read_cpu)
                assert maps[0][: len(data)] == data
                reads.append(seconds)
                del maps
                path.unlink()
            key = "plain" if level is None else f"zstd{level}"
            out[key] = {
                "ratio": len(data) / entry.disk_size,
                "write_MBps": len(data) / statistics.median(writes) / 1e6,
                "read_MBps": len(data) / statistics.median(reads) / 1e6,
                "write_MB_per_cpu_s": len(data) / statistics.median(write_cpu) / 1e6,
                "read_MB_per_cpu_s": len(data) / statistics.median(read_cpu) / 1e6,
            }
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return out


def end_to_end(
    state: dict[str, Any], root: Path, workers: int, repeats: int, level: int, threads: int
) -> dict[str, Any]:
    (root / "redis").mkdir(parents=True, exist_ok=True)
    redis, redis_url = start_redis(root / "redis")
    results: dict[str, Any] = {}
    try:
        for mode in (CheckpointCompression.NONE, CheckpointCompression.ZSTD):
            config = DCSConfig(
                redis_url=redis_url,
                node_name="benchhost",
                checkpoint_dir=root / mode.value,
                staging_dir=Path(tempfile.mkdtemp(prefix="dcs-bench-", dir="/dev/shm")),
                enable_metrics=False,
                checkpoint_compression=mode,
                checkpoint_compression_level=level,
                checkpoint_compression_threads=threads,
            )
            worker = start_worker(config, root / f"worker-{mode.value}.log", concurrency=workers)
            try:
                results[mode.value] = _save_and_restore(config, state, repeats)
            finally:
                stop(worker)
                shutil.rmtree(config.host.staging_dir, ignore_errors=True)
    finally:
        stop(redis)
    return results


def _save_and_restore(config: DCSConfig, state: dict[str, Any], repeats: int) -> dict[str, Any]:
    durable, stalls = [], []
    run = f"bench-{config.checkpoint.compression.value}"
    with Checkpointer(run, config) as ckpt:
        ckpt.reserve(state)
        for step in range(repeats + 1):
            start = time.perf_counter()
            pending = ckpt.save(state, step=step)
            pending.wait(timeout=900)
            if step:  # step 0 is the warm-up
                durable.append(time.perf_counter() - start)
                stalls.append(pending.stall_seconds)
        step_dir = Path(config.checkpoint.dir) / run / f"step-{repeats:09d}"
        restores = []
        for _ in range(repeats):
            drop_cache(step_dir)
            seconds, restored = timed(lambda: ckpt.restore(step=repeats))
            restores.append(seconds)
        for part, tensors in state.items():
            assert all(torch.equal(restored.state[part][k], t) for k, t in tensors.items()), part
        manifest = json.loads((step_dir / "manifest.json").read_text())
    total = sum(f["size"] for f in manifest["files"])
    stored = sum(f.get("stored_size") or f["size"] for f in manifest["files"])
    return {
        "bytes": total,
        "stored_bytes": stored,
        "compressed_files": sum(1 for f in manifest["files"] if f.get("compression")),
        "files": len(manifest["files"]),
        "stall_s": statistics.median(stalls),
        "durable_s": statistics.median(durable),
        "restore_s": statistics.median(restores),
    }


def main() -> None:
    bench_run = Run("compression")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps before saving")
    parser.add_argument("--int-mb", type=int, default=96)
    parser.add_argument("--file-mb", type=int, default=256, help="bytes of each category in the codec part")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--level", type=int, default=1, help="zstd level of the end-to-end part")
    parser.add_argument("--threads", type=int, default=1, help="zstd threads per file (the worker setting)")
    parser.add_argument("--parts", nargs="+", default=["codec", "end_to_end"], choices=["codec", "end_to_end"])
    parser.add_argument("--workers", type=int, default=2, help="`dcs worker` processes (files in parallel)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir)")
    args = parser.parse_args()
    state = build_state(args.hidden, args.layers, args.steps, args.int_mb)
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-compression-", dir=args.dir))
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "codec": {}}
    results["load_average_at_start"] = os.getloadavg()
    try:
        for category, tensors in state.items() if "codec" in args.parts else ():
            data = flat_bytes(tensors, args.file_mb * MiB)
            results["codec"][category] = codec(category, data, root, args.levels, args.threads, args.repeats)
            report_codec(category, results["codec"][category])
        if "end_to_end" in args.parts:
            results["end_to_end"] = end_to_end(state, root, args.workers, args.repeats, args.level, args.threads)
            report_end_to_end(results["end_to_end"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bench_run.record(results)


def report_codec(category: str, r: dict[str, Any]) -> None:
    cells = [
        f"{k}: x{v['ratio']:.2f} write {v['write_MBps']:.0f} MB/s ({v['write_MB_per_cpu_s']:.0f}/cpu-s) "
        f"read {v['read_MBps']:.0f} MB/s ({v['read_MB_per_cpu_s']:.0f}/cpu-s)"
        for k, v in r.items()
        if k != "bytes"
    ]
    print(f"{category:8s} {r['bytes'] / MiB:6.0f} MiB  " + " | ".join(cells), flush=True)


def report_end_to_end(r: dict[str, Any]) -> None:
    for mode, v in r.items():
        print(
            f"end-to-end {mode:5s}: {v['bytes'] / MiB:.0f} MiB -> {v['stored_bytes'] / MiB:.0f} MiB on disk "
            f"({v['compressed_files']}/{v['files']} files compressed), stall {v['stall_s'] * 1e3:.0f} ms, "
            f"durable {v['durable_s']:.2f} s, restore {v['restore_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
