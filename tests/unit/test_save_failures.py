"""How a failed save's reason is classified and shown to the trainer (`dcs_tasks.checkpoint.failures`): the reasons
are the ones the worker writes into the ledger (`workers/ckpt_tasks.py`: "persisting <file> failed: <Type>: ...",
"commit failed: ...", "persist task refused: ...") and the trainer's own (a broker it could not reach)."""

from __future__ import annotations

import pytest
from kombu.exceptions import OperationalError

from dcs_tasks.checkpoint.failures import ClosedSteps, error_type_of, failure_of, saved_failed
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, SaveFailed, StorageUnavailable


@pytest.mark.parametrize(
    ("reason", "error_type", "transient"),
    [
        (
            "persisting model-00001.safetensors failed: UntrustedPath: step directory '/a/b' is not where",
            "UntrustedPath",
            False,
        ),
        (
            "persisting f failed: StorageAccessDenied: PUT s3://b/k: SignatureDoesNotMatch ...",
            "StorageAccessDenied",
            False,
        ),
        ("persisting f failed: OSError: [Errno 28] No space left on device", "OSError", False),
        (
            "commit failed: StorageUnavailable: PUT s3://b/k/manifest.json: EndpointConnectionError: ...",
            "StorageUnavailable",
            True,
        ),
        (
            "persist task refused: InvalidTaskPayload: dcs.ckpt.persist payload refused: ...",
            "InvalidTaskPayload",
            False,
        ),
        (
            "persisting f failed: RedeliveryLimitExceeded: task ... was delivered 4 times",
            "RedeliveryLimitExceeded",
            False,
        ),
        ("something nobody formatted", "", False),
    ],
)
def test_the_workers_reasons_are_classified_by_the_error_type_they_name(
    reason: str, error_type: str, transient: bool
) -> None:
    failure = failure_of(DCSConfig(), "exp", 3, reason)
    assert (failure.error_type, failure.transient) == (error_type, transient)


def test_a_broker_the_trainer_could_not_reach_is_an_outage_and_its_cause_chain_decides() -> None:
    try:
        try:
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        except OperationalError as exc:
            raise CheckpointFailed("could not enqueue persist tasks of step 3 (0/1 sent): Error 111") from exc
    except CheckpointFailed as exc:
        assert error_type_of(str(exc), exc) == "OperationalError"
    assert error_type_of("x", StorageUnavailable("HEAD s3://b/k: timed out")) == "StorageUnavailable"


def test_reasons_are_scrubbed_of_secrets_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-0123456789")
    config = DCSConfig(redis_url="redis://:hunter2-password@127.0.0.1:6379/0", auth_token="tok-abcdef-123456")
    reason = (
        "commit failed: StorageAccessDenied: s3cr3t-value-0123456789 tok-abcdef-123456 "
        "redis://:hunter2-password@127.0.0.1:6379/0 " + "x" * 5000
    )
    failure = failure_of(config, "exp", 1, reason)
    for secret in ("s3cr3t-value-0123456789", "tok-abcdef-123456", "hunter2-password"):
        assert secret not in failure.reason
    assert len(failure.reason) <= 2003 and failure.error_type == "StorageAccessDenied"


def test_save_failed_names_every_step_and_is_a_checkpoint_failed() -> None:
    failures = [failure_of(DCSConfig(), "exp", s, f"persisting f failed: UntrustedPath: no {s}") for s in (0, 100)]
    error = saved_failed(failures)
    assert isinstance(error, SaveFailed) and isinstance(error, CheckpointFailed)
    assert (error.step, error.error_type, error.steps) == (0, "UntrustedPath", (0, 100))
    assert "step 0 of run 'exp': persisting f failed: UntrustedPath: no 0" in str(error)
    assert "step 100 of run 'exp'" in str(error)


def test_closed_steps_is_still_the_tuple_of_unfinished_steps() -> None:
    failure = failure_of(DCSConfig(), "exp", 5, "commit failed: StorageUnavailable: down")
    closed = ClosedSteps((7,), [failure])
    assert closed.failed == (5,) and not closed.ok and closed.unfinished == (7,)
    assert ClosedSteps(()).ok and tuple(closed) == (7,)
    assert closed == (7,) and ClosedSteps(()) == ()  # what close() returned before, compared as then
