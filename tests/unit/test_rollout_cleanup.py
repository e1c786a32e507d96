"""After a failed update, which engines the cleanup calls again: one whose call timed out or could not connect is
skipped (each call would wait out the cleanup timeout: a cut cable cost 8 + 10 s), one that answered is ended."""

from __future__ import annotations

from dcs_tasks.engine_http import ConnectError, ProtocolError, ReadTimeout
from dcs_tasks.errors import WeightSyncError
from dcs_tasks.sync.rollout import _got_no_connection_or_answer


def _raised_from(cause: BaseException | None) -> WeightSyncError:
    try:
        try:
            if cause is not None:
                raise cause
            raise WeightSyncError("rollout_1 refused /update_weights_from_distributed: bad name", "rollout_1")
        except (ReadTimeout, ConnectError, ProtocolError) as exc:
            raise WeightSyncError(f"rollout engine rollout_1 failed: {exc!r}", "rollout_1") from exc
    except WeightSyncError as exc:
        return exc


def test_a_timed_out_or_unconnectable_member_is_not_called_again() -> None:
    assert _got_no_connection_or_answer(_raised_from(ReadTimeout("no whole answer within 8s")))
    assert _got_no_connection_or_answer(_raised_from(ConnectError("connection refused")))
    wrapped = WeightSyncError("update v3 failed", "rollout_1")
    wrapped.__cause__ = _raised_from(ReadTimeout("no whole answer"))
    assert _got_no_connection_or_answer(wrapped)  # through the sender's wrapping


def test_a_member_that_answered_or_closed_the_connection_is_ended() -> None:
    assert not _got_no_connection_or_answer(_raised_from(None))  # it answered with a refusal
    assert not _got_no_connection_or_answer(_raised_from(ProtocolError("closed before a whole answer")))
