"""Which processes read each setting: the "read by" column of `dcs config --markdown` (docs/configuration.md).

A setting takes effect only in the processes that read it: `DCS_MEMORY_TIER_BYTES` exported in a trainer's shell
after `dcs up` changes the trainer, not the running worker. "must match" marks the settings a trainer and its
host's worker both read and must share: a `Checkpointer` refuses to start when they differ
(`dcs_tasks.checkpoint.agreement`), and `dcs doctor` shows them. Processes: trainer (a `Checkpointer` or
`CheckpointEngineClient` in the training process), worker (`dcs worker`), coordinator (`dcs coordinator`),
receiver (`dcs receiver`, `dcs engine attach`).

`tests/unit/test_settings_readers.py` fails on a setting missing here: add a new setting's readers with it.
"""

from __future__ import annotations

ALL = "all"
T, W, C, R = "trainer", "worker", "coordinator", "receiver"
MATCH = "must match"

_COORDINATOR = (
    "coordinator_host coordinator_port max_body_bytes weight_meta_max_entries weight_meta_entry_max_bytes "
    "weight_meta_read_max_entries weight_meta_read_max_bytes metadata_max_depth metadata_max_bytes "
    "dead_node_retention_seconds unbeaten_node_retention_seconds node_identity_required redis_max_connections "
    "redis_pool_timeout_seconds coordinator_keep_alive_seconds coordinator_request_read_timeout_seconds "
    "coordinator_max_header_bytes role_mappings role_order"
)
_TRAINER = (
    "bucket_size_bytes ref_update_interval staging_buffers staging_policy save_failure_policy file_shard_bytes "
    "async_io pinned_memory incremental_saves keep_last keep_every memory_restore_verify storage_every_steps "
    "storage_every_seconds checkpoint_compression checkpoint_compression_level checkpoint_compression_min_saving "
    "trainer_metrics_port s3_read_concurrency"
)
_WORKER = (
    "comm_base_port comm_max_port incremental_full_every memory_keep_last memory_replicas failure_domain peer_host "
    "peer_port peer_advertise_host checkpoint_compression_threads persist_throttle_bytes_per_second max_redeliveries "
    "worker_stuck_stop_seconds metrics_port s3_concurrency peer_connections_per_source"
)
_TRAINER_RECEIVER = (
    "backend_type tensor_fusion_threshold sync_pause_gc comm_timeout_seconds advertise_address comm_ifname"
)
_RECEIVER = (
    "tcp_buffer_size tcp_nodelay receiver_max_update_bytes receiver_max_body_bytes "
    "receiver_request_read_timeout_seconds receiver_keep_alive_seconds"
)
_TRAINER_WORKER = (
    "replica_dir peer_timeout_seconds max_retries retry_delay_seconds retry_backoff_max_seconds "
    "task_soft_time_limit_seconds task_time_limit_seconds visibility_timeout_seconds enable_metrics metrics_host "
    "s3_region s3_addressing_style s3_part_bytes s3_max_attempts s3_connect_timeout_seconds s3_read_timeout_seconds "
    "s3_payload_signing "
    "runtime_dir host_trusted_uid peer_handshake_seconds peer_min_bytes_per_second peer_rate_window_seconds "
    "peer_max_manifest_bytes"
)
_TRAINER_WORKER_RECEIVER = (
    "coordinator_url request_timeout_seconds group_init_timeout_seconds group_init_timeout_max_seconds host_agent "
    "host_agent_socket"
)
_ALL = "auth_token redis_socket_timeout_seconds heartbeat_interval_seconds heartbeat_timeout_seconds"
_MATCH = "redis_url namespace node_name checkpoint_dir staging_dir memory_tier_bytes memory_dir s3_endpoint_url"

READ_BY: dict[str, str] = {
    **dict.fromkeys(_COORDINATOR.split(), C),
    **dict.fromkeys(_TRAINER.split(), T),
    **dict.fromkeys(_WORKER.split(), W),
    **dict.fromkeys(_TRAINER_RECEIVER.split(), f"{T}, {R}"),
    **dict.fromkeys(_RECEIVER.split(), R),
    **dict.fromkeys(_TRAINER_WORKER.split(), f"{T}, {W}"),
    **dict.fromkeys(_TRAINER_WORKER_RECEIVER.split(), f"{T}, {W}, {R}"),
    **dict.fromkeys(_ALL.split(), ALL),
    **dict.fromkeys(_MATCH.split(), f"{T}, {W} ({MATCH})"),
}
READ_BY["redis_url"] = READ_BY["namespace"] = f"{ALL} ({MATCH})"


def read_by(name: str) -> str:
    """The processes that read setting `name` ("?" for one not listed: a test fails on it)."""
    return READ_BY.get(name, "?")
