"""The Redis ledger of one checkpoint step: the state machine that fences persist and commit tasks.

    PERSISTING --(last file durable)--> COMMITTING --(manifest + latest written)--> COMMITTED
         \\------(a file failed for good)---> FAILED <---(commit failed for good)---/

Hash `keys.ckpt_state(run, step)` fields: status, token (one per save attempt), nfiles, finished (files
whose persist task reached a final outcome), ok, reason, draft (ManifestDraft JSON), `claim:<file>` /
`commit_owner` (Celery task id allowed to write), `done:<file>` (outcome), `file:<file>` (FileEntry JSON).
Every transition is one Lua script checking the save token, so a stale task (older attempt) or a
duplicate delivery (other task id) can neither write a claimed file nor commit twice (nor end a commit
another task claimed), and nothing changes a COMMITTED step. A redelivery of the SAME task id (acks_late
after kill -9) may resume its own claim. A record holding what DCS never writes there (an unknown status, a
counter that is not a number, a file entry that does not parse) raises `CorruptLedger` naming the step and
the field, before any write; the fencing scripts that only compare the status refuse an unknown one (CLOSED).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError

from dcs_tasks.checkpoint.format.layout import FileEntry, ManifestDraft
from dcs_tasks.checkpoint.store.ledger import ledger_scripts as lua
from dcs_tasks.errors import CorruptLedger
from dcs_tasks.keys import Keys
from dcs_tasks.lua import LuaScript

log = logging.getLogger(__name__)

STATE_TTL_SECONDS = 7 * 24 * 3600
MAX_FLUSH_FAILURES = 1024  # flush failures recorded per run at most (the trainer reads them all at once)
MAX_FLUSH_REASON_CHARS = 2000


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
        return [self._keys.ckpt_state(run, step), self._keys.ckpt_inflight(run), self._keys.ckpt_ended(run, step)]

    def begin(
        self, run: str, step: int, token: str, nfiles: int, draft: ManifestDraft, abandoned_after: float
    ) -> Verdict:
        """Open a save attempt. BUSY while an earlier attempt is in flight, unless it is still PERSISTING
        `abandoned_after` seconds after it began: then it is taken over (its tasks see a stale token)."""
        before = f"{draft.created_at - abandoned_after:.6f}"
        args: list[str | int] = [token, nfiles, draft.model_dump_json(), f"{draft.created_at:.6f}", step, before]
        return Verdict(_s(self._run(lua.BEGIN, run, step, args)))

    def abandon(self, run: str, step: int, token: str, reason: str) -> Verdict:
        """Fail a PERSISTING attempt whose tasks were not all sent (so `finish_file` would never close it)."""
        args: list[str | int] = [token, reason, step, STATE_TTL_SECONDS]
        return Verdict(_s(self._run(lua.ABANDON, run, step, args)))

    def claim_file(self, run: str, step: int, token: str, name: str, task_id: str) -> Verdict:
        return Verdict(_s(self._run(lua.CLAIM_FILE, run, step, [token, name, task_id])))

    def finish_file(self, run: str, step: int, token: str, name: str, outcome: FileOutcome, value: str) -> FileFinish:
        """Record `name`'s final outcome (once: a second finish of it is DONE). CLOSED, changing nothing, for
        a file not recorded yet once the step is COMMITTING or COMMITTED (every file of it already is)."""
        args: list[str | int] = [token, name, outcome.value, value, step, STATE_TTL_SECONDS]
        verdict, finished, nfiles, status = self._run(lua.FINISH_FILE, run, step, args)
        return FileFinish(Verdict(_s(verdict)), int(finished), int(nfiles), _status(_s(status)))

    def file_open(self, run: str, step: int, token: str, name: str) -> bool:
        """Whether `name` of attempt `token` still waits for its outcome: the attempt is the step's, it is
        PERSISTING and nothing recorded `name` yet. While it does, the save's staging buffer is not released
        (that waits for every file's outcome), so bytes a writer read from it before asking are that save's."""
        key = self._keys.ckpt_state(run, step)
        token_now, status, done = self._client.hmget(key, ["token", "status", f"done:{name}"])
        return token_now is not None and _s(token_now) == token and _s(status) == "persisting" and done is None

    def claim_commit(self, run: str, step: int, token: str, task_id: str) -> Verdict:
        return Verdict(_s(self._run(lua.CLAIM_COMMIT, run, step, [token, task_id])))

    def finish_commit(
        self, run: str, step: int, token: str, status: StepStatus, reason: str = "", *, task_id: str
    ) -> Verdict:
        """End a COMMITTING step as COMMITTED or FAILED. CLAIMED, changing nothing, when another task id
        than `task_id` claimed the commit (`claim_commit`); a commit nobody claimed may still be failed."""
        if status not in (StepStatus.COMMITTED, StepStatus.FAILED):
            raise ValueError(f"a commit ends COMMITTED or FAILED, not {status.value}")
        args: list[str | int] = [token, status.value, reason, step, STATE_TTL_SECONDS, task_id]
        return Verdict(_s(self._run(lua.FINISH_COMMIT, run, step, args)))

    def read(self, run: str, step: int) -> StepState:
        """The step's record; raises CorruptLedger when its status, a count or a file entry does not parse."""
        key = self._keys.ckpt_state(run, step)
        raw: dict[Any, Any] = self._client.hgetall(key)
        data = {_s(k): _s(v) for k, v in raw.items()}
        if not data:
            return StepState(status=None)
        files = {}
        for name, value in data.items():
            if name.startswith("file:"):
                try:
                    files[name[5:]] = FileEntry.model_validate_json(value)
                except ValidationError as exc:
                    raise _corrupt(run, step, f"field {name} of {key} is not a file entry: {value[:64]!r}") from exc
        return StepState(
            status=_known_status(data.get("status", ""), run, step, key),
            token=data.get("token", ""),
            reason=data.get("reason", ""),
            nfiles=_count(data.get("nfiles", ""), "nfiles", run, step, key),
            finished=_count(data.get("finished", ""), "finished", run, step, key),
            files=files,
            draft=data.get("draft", ""),
        )

    def progress(self, run: str, step: int) -> tuple[StepStatus | None, int, int, str]:
        """(status, finished, nfiles, reason) in one round trip, for polling (CorruptLedger: see `read`)."""
        key = self._keys.ckpt_state(run, step)
        values = self._client.hmget(key, ["status", "finished", "nfiles", "reason"])
        status, finished, nfiles, reason = (_s(v) if v is not None else "" for v in values)
        counts = _count(finished, "finished", run, step, key), _count(nfiles, "nfiles", run, step, key)
        return _known_status(status, run, step, key), counts[0], counts[1], reason

    def nap(self, run: str, step: int, seconds: float) -> bool:
        """Sleep up to `seconds`, less when the step ends meanwhile (its scripts push a token on `ckpt_ended` when
        they make it COMMITTED or FAILED): True when a token woke it. The token is taken, so a waiter that finds
        the step ended puts it back (`pass_on_end`) for the step's other waiters; one that does not (a token left
        by an earlier attempt of the step, or not DCS's) has consumed it, so nothing makes waiters spin. A Redis
        that refuses the call (a server older than 6.0 takes no fractional timeout) or cannot be reached: a
        plain sleep, the poll after it says what happened."""
        seconds = max(seconds, 0.001)  # BLPOP's 0 blocks forever
        try:
            return self._client.blpop([self._keys.ckpt_ended(run, step)], timeout=seconds) is not None
        except redis.RedisError:
            time.sleep(seconds)
            return False

    def pass_on_end(self, run: str, step: int) -> None:
        """Put back the token `nap` took, the step found ended, for the step's other waiters (lua/ended.lua, as
        the scripts that end a step push it; it expires on its own). A Redis error is ignored: the others see
        the end at their next poll."""
        with contextlib.suppress(redis.RedisError):
            self._run(lua.PASS_ON_END, run, step, [])

    def record_flush_failure(self, run: str, step: int, reason: str, at: float) -> bool:
        """Record that memory-tier step `step` of `run` could not be copied to storage (the worker's flush gave up), so
        the trainer's next save() or close() learns of it. False, recording nothing, once the run holds
        MAX_FLUSH_FAILURES of them (old ones expire with the key)."""
        key = self._keys.ckpt_flush_failures(run)
        if int(self._client.hlen(key)) >= MAX_FLUSH_FAILURES:
            return False
        value = json.dumps({"at": at, "reason": reason[:MAX_FLUSH_REASON_CHARS]})
        pipe = self._client.pipeline()
        pipe.hset(key, str(step), value)
        pipe.expire(key, STATE_TTL_SECONDS)
        pipe.execute()
        return True

    def flush_failures(self, run: str, since: float) -> dict[int, str]:
        """Step -> reason of the flush failures of `run` recorded at or after `since` (unix time). Entries that do not
        parse (written by hand) are skipped."""
        found: dict[int, str] = {}
        for field_, value in self._client.hgetall(self._keys.ckpt_flush_failures(run)).items():
            name = _s(field_)
            try:
                entry = json.loads(_s(value))
                at, reason = float(entry["at"]), str(entry["reason"])[:MAX_FLUSH_REASON_CHARS]
            except (ValueError, TypeError, KeyError):
                continue
            if name.isascii() and name.isdigit() and at >= since:
                found[int(name)] = reason
        return found

    def in_flight_steps(self, run: str) -> set[int]:
        """The steps of `run` begun and not yet committed or failed. A member of the set that is no step number
        (written by hand) names no step directory, so it is logged and left out."""
        steps = set()
        for member in (_s(m) for m in self._client.zrange(self._keys.ckpt_inflight(run), 0, -1)):
            if member.isascii() and member.isdigit():
                steps.add(int(member))
            else:
                log.warning("%s holds %r, which is no step number: ignored", self._keys.ckpt_inflight(run), member[:64])
        return steps

    def _run(self, script: LuaScript, run: str, step: int, args: list[str | int]) -> Any:
        try:
            return script(self._client, self._k(run, step), args)
        except redis.ResponseError as exc:
            message = str(exc)
            if message.startswith(lua.CORRUPT_PREFIX):  # Redis appends " script: <sha>, on @user_script:<line>."
                detail = message.removeprefix(lua.CORRUPT_PREFIX).split(" script: ")[0].strip()
                raise _corrupt(run, step, detail) from exc
            raise


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value) if value is not None else ""


def _count(value: str, name: str, run: str, step: int, key: str) -> int:
    """A counter of the record (absent: 0); CorruptLedger when it is not a whole number."""
    if not value:
        return 0
    if not (value.isascii() and value.isdigit()):
        raise _corrupt(run, step, f"field {name} of {key} is not a number: {value[:64]!r}")
    return int(value)


def _known_status(value: str, run: str, step: int, key: str) -> StepStatus | None:
    """The record's status (absent: None); CorruptLedger when it is none of the four."""
    status = _status(value)
    if status is None and value:
        raise _corrupt(run, step, f"field status of {key} is no step status: {value[:64]!r}")
    return status


def _corrupt(run: str, step: int, detail: str) -> CorruptLedger:
    return CorruptLedger(f"the ledger record of step {step} of run {run!r} is corrupt: {detail}")


def _status(value: str) -> StepStatus | None:
    try:
        return StepStatus(value)
    except ValueError:
        return None


def file_entry_json(entry: FileEntry) -> str:
    return json.dumps(entry.model_dump(mode="json", exclude_none=True))  # plain files: the fields as before
