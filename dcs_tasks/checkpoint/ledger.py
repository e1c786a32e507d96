"""The Redis ledger of one checkpoint step: the state machine that fences persist and commit tasks.

    PERSISTING --(last file durable)--> COMMITTING --(manifest + latest written)--> COMMITTED
         \\------(a file failed for good)---> FAILED <---(commit failed for good)---/

Hash `keys.ckpt_state(run, step)` fields: status, token (one per save attempt), nfiles, finished (files
whose persist task reached a final outcome), ok, reason, draft (ManifestDraft JSON), `claim:<file>` /
`commit_owner` (Celery task id allowed to write), `done:<file>` (outcome), `file:<file>` (FileEntry JSON).
Every transition is one Lua script checking the save token, so a stale task (older attempt) or a
duplicate delivery (other task id) can neither write a claimed file nor commit twice (nor end a commit
another task claimed), and nothing changes a COMMITTED step. A redelivery of the SAME task id (acks_late
after kill -9) may resume its own claim.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

import redis

from dcs_tasks.checkpoint import ledger_scripts as lua
from dcs_tasks.checkpoint.format import FileEntry, ManifestDraft
from dcs_tasks.keys import Keys

STATE_TTL_SECONDS = 7 * 24 * 3600


class StepStatus(str, enum.Enum):
    PERSISTING = "persisting"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"


class FileOutcome(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


class Verdict(str, enum.Enum):
    """Answers of the fencing scripts."""

    WRITE = "write"  # go ahead
    COMMIT = "commit"  # this call moved the step to COMMITTING: send the commit task
    OK = "ok"
    DONE = "done"  # already done by someone: nothing to do
    CLAIMED = "claimed"  # another task id owns it
    CLOSED = "closed"  # the step is no longer in the state this call needs
    STALE = "stale"  # the task belongs to another save attempt (or the state expired)
    BUSY = "busy"  # begin(): the step is still in flight
    COMMITTED = "committed"  # begin(): the step is already committed


@dataclass(frozen=True)
class FileFinish:
    """Result of `finish_file`: the verdict and whether every persist task of the step has finished."""

    verdict: Verdict
    finished: int
    nfiles: int
    status: StepStatus | None

    @property
    def all_finished(self) -> bool:
        return self.nfiles > 0 and self.finished >= self.nfiles


@dataclass(frozen=True)
class StepState:
    """A snapshot of the ledger hash of one step (`status=None`: unknown or expired)."""

    status: StepStatus | None
    token: str = ""
    reason: str = ""
    nfiles: int = 0
    finished: int = 0
    files: dict[str, FileEntry] = field(default_factory=dict)
    draft: str = ""

    def manifest_draft(self) -> ManifestDraft:
        return ManifestDraft.model_validate_json(self.draft)


class StepLedger:
    """Fenced transitions of checkpoint steps; shared by the trainer (begin, read) and workers (the rest)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._keys = keys

    def _k(self, run: str, step: int) -> list[str]:
        return [self._keys.ckpt_state(run, step), self._keys.ckpt_inflight(run)]

    def begin(
        self, run: str, step: int, token: str, nfiles: int, draft: ManifestDraft, abandoned_after: float
    ) -> Verdict:
        """Open a save attempt. BUSY while an earlier attempt is in flight, unless it is still PERSISTING
        `abandoned_after` seconds after it began: then it is taken over (its tasks see a stale token)."""
        before = f"{draft.created_at - abandoned_after:.6f}"
        args: list[str | int] = [token, nfiles, draft.model_dump_json(), f"{draft.created_at:.6f}", step, before]
        return Verdict(_s(lua.BEGIN(self._client, self._k(run, step), args)))

    def abandon(self, run: str, step: int, token: str, reason: str) -> Verdict:
        """Fail a PERSISTING attempt whose tasks were not all sent (so `finish_file` would never close it)."""
        args: list[str | int] = [token, reason, step, STATE_TTL_SECONDS]
        return Verdict(_s(lua.ABANDON(self._client, self._k(run, step), args)))

    def claim_file(self, run: str, step: int, token: str, name: str, task_id: str) -> Verdict:
        return Verdict(_s(lua.CLAIM_FILE(self._client, self._k(run, step), [token, name, task_id])))

    def finish_file(self, run: str, step: int, token: str, name: str, outcome: FileOutcome, value: str) -> FileFinish:
        """Record `name`'s final outcome (once: a second finish of it is DONE). CLOSED, changing nothing, for
        a file not recorded yet once the step is COMMITTING or COMMITTED (every file of it already is)."""
        args: list[str | int] = [token, name, outcome.value, value, step, STATE_TTL_SECONDS]
        verdict, finished, nfiles, status = lua.FINISH_FILE(self._client, self._k(run, step), args)
        return FileFinish(Verdict(_s(verdict)), int(finished), int(nfiles), _status(_s(status)))

    def claim_commit(self, run: str, step: int, token: str, task_id: str) -> Verdict:
        return Verdict(_s(lua.CLAIM_COMMIT(self._client, self._k(run, step), [token, task_id])))

    def finish_commit(
        self, run: str, step: int, token: str, status: StepStatus, reason: str = "", *, task_id: str
    ) -> Verdict:
        """End a COMMITTING step as COMMITTED or FAILED. CLAIMED, changing nothing, when another task id
        than `task_id` claimed the commit (`claim_commit`); a commit nobody claimed may still be failed."""
        if status not in (StepStatus.COMMITTED, StepStatus.FAILED):
            raise ValueError(f"a commit ends COMMITTED or FAILED, not {status.value}")
        args: list[str | int] = [token, status.value, reason, step, STATE_TTL_SECONDS, task_id]
        return Verdict(_s(lua.FINISH_COMMIT(self._client, self._k(run, step), args)))

    def read(self, run: str, step: int) -> StepState:
        raw: dict[Any, Any] = self._client.hgetall(self._keys.ckpt_state(run, step))
        data = {_s(k): _s(v) for k, v in raw.items()}
        if not data:
            return StepState(status=None)
        files = {k[5:]: FileEntry.model_validate_json(v) for k, v in data.items() if k.startswith("file:")}
        return StepState(
            status=_status(data.get("status", "")),
            token=data.get("token", ""),
            reason=data.get("reason", ""),
            nfiles=int(data.get("nfiles", 0)),
            finished=int(data.get("finished", 0)),
            files=files,
            draft=data.get("draft", ""),
        )

    def progress(self, run: str, step: int) -> tuple[StepStatus | None, int, int, str]:
        """(status, finished, nfiles, reason) in one round trip, for polling."""
        values = self._client.hmget(self._keys.ckpt_state(run, step), ["status", "finished", "nfiles", "reason"])
        status, finished, nfiles, reason = (_s(v) if v is not None else "" for v in values)
        return _status(status), int(finished or 0), int(nfiles or 0), reason

    def in_flight_steps(self, run: str) -> set[int]:
        return {int(_s(s)) for s in self._client.zrange(self._keys.ckpt_inflight(run), 0, -1)}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value) if value is not None else ""


def _status(value: str) -> StepStatus | None:
    try:
        return StepStatus(value)
    except ValueError:
        return None


def file_entry_json(entry: FileEntry) -> str:
    return json.dumps(entry.model_dump(mode="json", exclude_none=True))  # plain files: the fields as before
