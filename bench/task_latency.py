"""Task latency: enqueue -> task start on an idle `dcs worker`, and the full round trip (result read back).

Starts a private redis-server and one real worker, sends `--n` ping tasks one at a time to the node queue,
and reports p50/p99 of (task start - send time) and of the round trip. Writes a result file under
bench/results/task_latency/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, Run, start_redis, start_worker, stop
from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.config import DCSConfig


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    bench_run = Run("task_latency")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redis, redis_url = start_redis(Path(tmp))
        config = DCSConfig(redis_url=redis_url, node_name="benchhost", enable_metrics=False)
        worker = start_worker(config, Path(tmp) / "worker.log", concurrency=1)
        try:
            app = make_celery(config)
            # a result still pending when the benchmark is stopped (SIGTERM) is dropped at exit, after Redis: its
            # unsubscribe then retries the stopped Redis 20 times (Celery's default) before the process can end
            options = app.conf.result_backend_transport_options
            app.conf.result_backend_transport_options = {**options, "retry_policy": {"max_retries": 1}}
            queue = node_queue(config.host_name)
            app.send_task(TaskName.PING.value, queue=queue).get(timeout=30)  # warm-up
            to_start, round_trip = [], []
            for _ in range(args.n):
                sent = time.time()
                answer = app.send_task(TaskName.PING.value, queue=queue).get(timeout=30)
                round_trip.append(time.time() - sent)
                to_start.append(answer["started_at"] - sent)
        finally:
            stop(worker)
            stop(redis)
    result = {
        "n": args.n,
        "enqueue_to_start_ms": {
            "p50": percentile(to_start, 0.5) * 1e3,
            "p99": percentile(to_start, 0.99) * 1e3,
            "mean": statistics.mean(to_start) * 1e3,
        },
        "round_trip_ms": {"p50": percentile(round_trip, 0.5) * 1e3, "p99": percentile(round_trip, 0.99) * 1e3},
    }
    s, r = result["enqueue_to_start_ms"], result["round_trip_ms"]
    row = Row(
        what=f"task latency, idle worker, n={args.n}",
        ours=f"enqueue -> start p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms; round trip p50 {r['p50']:.1f} ms, "
        f"p99 {r['p99']:.1f} ms",
        ratio_text=f"p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms",
    )
    bench_run.record(result, [row], headline=f"enqueue -> start p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms")
    print(
        f"task latency: enqueue->start p50 {s['p50']:.2f} ms p99 {s['p99']:.2f} ms; "
        f"round trip p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms (n={args.n})"
    )


if __name__ == "__main__":
    main()
