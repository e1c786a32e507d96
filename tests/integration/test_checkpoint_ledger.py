"""The step ledger (`dcs_tasks.checkpoint.store.ledger.stepledger.StepLedger`) driven directly against a real
redis-server: the fenced state machine of one checkpoint step (PERSISTING -> COMMITTING -> COMMITTED, or FAILED), as the
trainer (begin, abandon, progress, read) and the persist/commit workers (claims and finishes) use it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from dcs_tasks.checkpoint.format.layout import FileEntry, ManifestDraft
from dcs_tasks.checkpoint.store.ledger.stepledger import (
    STATE_TTL_SECONDS,
    FileOutcome,
    StepLedger,
    StepState,
    StepStatus,
    Verdict,
    file_entry_json,
)
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CorruptLedger
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client

pytestmark = pytest.mark.integration

RUN = "ledger-run"
TOKEN = "a" * 32
OLD_TOKEN = "0" * 32
AGE = 60.0  # abandoned_after of every begin here, unless a test says otherwise


@pytest.fixture
def client(dcs_config: DCSConfig) -> Iterator[redis.Redis]:
    c = sync_client(dcs_config)
    yield c
    c.close()


@pytest.fixture
def keys(dcs_config: DCSConfig) -> Keys:
    return Keys(dcs_config.redis.namespace)


@pytest.fixture
def book(client: redis.Redis, keys: Keys) -> StepLedger:
    return StepLedger(client, keys)


def draft(step: int, created_at: float | None = None, run: str = RUN) -> ManifestDraft:
    return ManifestDraft(
        run=run,
        step=step,
        tensors={},
        structure={"kind": "dict"},
        metadata={"note": f"step {step}"},
        created_at=time.time() if created_at is None else created_at,
    )


def entry(name: str, size: int = 16) -> FileEntry:
    return FileEntry(name=name, size=size, checksum=f"sum-of-{name}")


def begin(book: StepLedger, step: int, names: list[str], token: str = TOKEN, run: str = RUN) -> None:
    assert book.begin(run, step, token, len(names), draft(step, run=run), AGE) is Verdict.WRITE


def persist_all(book: StepLedger, step: int, names: list[str], token: str = TOKEN, run: str = RUN) -> None:
    """What the persist tasks do for every file: claim, then record it; the last one starts the commit."""
    for i, name in enumerate(names):
        assert book.claim_file(run, step, token, name, f"persist-{name}") is Verdict.WRITE
        result = book.finish_file(run, step, token, name, FileOutcome.OK, file_entry_json(entry(name)))
        assert result.verdict is (Verdict.COMMIT if i == len(names) - 1 else Verdict.OK)


def commit(book: StepLedger, step: int, token: str = TOKEN, run: str = RUN) -> None:
    assert book.claim_commit(run, step, token, "commit-1") is Verdict.WRITE
    assert book.finish_commit(run, step, token, StepStatus.COMMITTED, task_id="commit-1") is Verdict.OK


def raw(client: redis.Redis, keys: Keys, step: int, run: str = RUN) -> dict[str, str]:
    """The step's hash as Redis holds it, to check that a refused call changed nothing."""
    return dict(client.hgetall(keys.ckpt_state(run, step)))


def ttl(client: redis.Redis, keys: Keys, step: int, run: str = RUN) -> int:
    return int(client.ttl(keys.ckpt_state(run, step)))


# --- begin, read, progress --------------------------------------------------------------------------------


def test_an_unknown_step_reads_as_no_status(book: StepLedger) -> None:
    assert book.read(RUN, 9) == StepState(status=None)
    assert book.progress(RUN, 9) == (None, 0, 0, "")
    assert book.in_flight_steps(RUN) == set()


def test_begin_opens_a_persisting_step_with_its_file_count_and_draft(book: StepLedger) -> None:
    opened = draft(7)
    assert book.begin(RUN, 7, TOKEN, 3, opened, AGE) is Verdict.WRITE
    state = book.read(RUN, 7)
    assert (state.status, state.token, state.nfiles, state.finished, state.reason) == (
        StepStatus.PERSISTING,
        TOKEN,
        3,
        0,
        "",
    )
    assert state.files == {}
    assert state.manifest_draft() == opened
    assert book.progress(RUN, 7) == (StepStatus.PERSISTING, 0, 3, "")
    assert book.in_flight_steps(RUN) == {7}
    assert book.in_flight_steps("another-run") == set()


def test_begin_is_busy_while_an_attempt_is_in_flight_and_takes_over_an_abandoned_one(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    started = time.time()
    assert book.begin(RUN, 1, OLD_TOKEN, 2, draft(1, started), AGE) is Verdict.WRITE
    assert book.claim_file(RUN, 1, OLD_TOKEN, "a", "old-task") is Verdict.WRITE
    assert book.finish_file(RUN, 1, OLD_TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a"))).finished == 1
    before = raw(client, keys, 1)

    # a second attempt while the first could still be alive: refused, the first one untouched
    assert book.begin(RUN, 1, TOKEN, 5, draft(1, started + AGE - 1), AGE) is Verdict.BUSY
    assert raw(client, keys, 1) == before

    # once the first is older than `abandoned_after` it is taken over: a fresh record under the new token
    assert book.begin(RUN, 1, TOKEN, 5, draft(1, started + AGE + 1), AGE) is Verdict.WRITE
    state = book.read(RUN, 1)
    assert (state.status, state.token, state.nfiles, state.finished, state.files) == (
        StepStatus.PERSISTING,
        TOKEN,
        5,
        0,
        {},
    )
    assert book.in_flight_steps(RUN) == {1}
    # the old attempt's tasks are stale now; its claims are gone, so the new tasks may write the same files
    assert book.claim_file(RUN, 1, OLD_TOKEN, "b", "old-task") is Verdict.STALE
    assert book.finish_file(RUN, 1, OLD_TOKEN, "b", FileOutcome.OK, "{}").verdict is Verdict.STALE
    assert book.abandon(RUN, 1, OLD_TOKEN, "old trainer") is Verdict.STALE
    assert book.claim_file(RUN, 1, TOKEN, "a", "new-task") is Verdict.WRITE
    assert book.progress(RUN, 1) == (StepStatus.PERSISTING, 0, 5, "")


def test_begin_is_busy_while_committing_whatever_its_age_and_refuses_a_committed_step(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 2, ["a"])
    persist_all(book, 2, ["a"])
    far_later = time.time() + 10 * AGE
    before = raw(client, keys, 2)
    assert book.begin(RUN, 2, "b" * 32, 1, draft(2, far_later), AGE) is Verdict.BUSY  # a commit may be writing
    assert raw(client, keys, 2) == before

    commit(book, 2)
    before = raw(client, keys, 2)
    assert book.begin(RUN, 2, "b" * 32, 1, draft(2, far_later), AGE) is Verdict.COMMITTED
    assert raw(client, keys, 2) == before
    assert book.in_flight_steps(RUN) == set()


def test_begin_after_a_failed_attempt_starts_afresh_without_the_failed_ones_expiry(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 3, ["a", "b"], token=OLD_TOKEN)
    assert book.abandon(RUN, 3, OLD_TOKEN, "broker unreachable") is Verdict.OK
    assert 0 < ttl(client, keys, 3) <= STATE_TTL_SECONDS

    assert book.begin(RUN, 3, TOKEN, 1, draft(3), AGE) is Verdict.WRITE
    assert book.progress(RUN, 3) == (StepStatus.PERSISTING, 0, 1, "")  # the old reason is gone
    assert ttl(client, keys, 3) == -1  # an attempt in flight never expires under its tasks
    assert book.in_flight_steps(RUN) == {3}
    persist_all(book, 3, ["a"])
    commit(book, 3)
    assert book.progress(RUN, 3) == (StepStatus.COMMITTED, 1, 1, "")


# --- persist: claim_file / finish_file --------------------------------------------------------------------


def test_claim_file_is_idempotent_for_its_task_and_refused_to_another(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 4, ["a", "b"])
    assert book.claim_file(RUN, 4, TOKEN, "a", "task-1") is Verdict.WRITE
    assert book.claim_file(RUN, 4, TOKEN, "a", "task-1") is Verdict.WRITE  # redelivery (acks_late) resumes
    before = raw(client, keys, 4)
    assert book.claim_file(RUN, 4, TOKEN, "a", "task-2") is Verdict.CLAIMED  # a duplicate delivery
    assert raw(client, keys, 4) == before
    assert book.claim_file(RUN, 4, TOKEN, "b", "task-2") is Verdict.WRITE  # claims are per file

    book.finish_file(RUN, 4, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a")))
    assert book.claim_file(RUN, 4, TOKEN, "a", "task-1") is Verdict.DONE  # recorded: nothing to write again
    assert book.claim_file(RUN, 4, TOKEN, "a", "task-2") is Verdict.DONE


def test_the_last_ok_file_moves_the_step_to_committing_exactly_once(book: StepLedger) -> None:
    begin(book, 5, ["a", "b"])
    first = book.finish_file(RUN, 5, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a", 10)))
    assert (first.verdict, first.finished, first.nfiles, first.status, first.all_finished) == (
        Verdict.OK,
        1,
        2,
        StepStatus.PERSISTING,
        False,
    )
    again = book.finish_file(RUN, 5, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a", 99)))
    assert (again.verdict, again.finished, again.status) == (Verdict.DONE, 1, StepStatus.PERSISTING)  # not twice

    last = book.finish_file(RUN, 5, TOKEN, "b", FileOutcome.OK, file_entry_json(entry("b", 20)))
    assert (last.verdict, last.finished, last.nfiles, last.status, last.all_finished) == (
        Verdict.COMMIT,
        2,
        2,
        StepStatus.COMMITTING,
        True,
    )
    redelivered = book.finish_file(RUN, 5, TOKEN, "b", FileOutcome.OK, file_entry_json(entry("b", 20)))
    assert (redelivered.verdict, redelivered.status) == (Verdict.DONE, StepStatus.COMMITTING)  # one commit task

    state = book.read(RUN, 5)
    assert state.files == {"a": entry("a", 10), "b": entry("b", 20)}  # the first record of "a" stands
    assert (state.status, state.finished, state.nfiles) == (StepStatus.COMMITTING, 2, 2)
    assert book.in_flight_steps(RUN) == {5}  # still in flight until the commit ends


def test_a_failed_file_fails_the_step_and_later_files_only_count(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 6, ["a", "b", "c"])
    assert book.finish_file(RUN, 6, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a"))).verdict is Verdict.OK
    failed = book.finish_file(RUN, 6, TOKEN, "b", FileOutcome.FAILED, "persisting b failed: disk full")
    assert (failed.verdict, failed.finished, failed.status, failed.all_finished) == (
        Verdict.OK,
        2,
        StepStatus.FAILED,
        False,
    )
    assert book.progress(RUN, 6) == (StepStatus.FAILED, 2, 3, "persisting b failed: disk full")
    assert book.in_flight_steps(RUN) == set()
    assert 0 < ttl(client, keys, 6) <= STATE_TTL_SECONDS

    # the third task finds the step closed, writes nothing and counts its file: then every task has finished
    assert book.claim_file(RUN, 6, TOKEN, "c", "task-c") is Verdict.CLOSED
    skipped = book.finish_file(RUN, 6, TOKEN, "c", FileOutcome.SKIPPED, "step no longer persisting")
    assert (skipped.verdict, skipped.finished, skipped.status, skipped.all_finished) == (
        Verdict.OK,
        3,
        StepStatus.FAILED,
        True,
    )
    assert book.progress(RUN, 6) == (StepStatus.FAILED, 3, 3, "persisting b failed: disk full")  # first reason
    assert book.claim_commit(RUN, 6, TOKEN, "commit-1") is Verdict.CLOSED
    assert book.finish_commit(RUN, 6, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.CLOSED
    assert book.progress(RUN, 6)[0] is StepStatus.FAILED


def test_a_stale_token_is_refused_by_every_transition_and_changes_nothing(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 8, ["a"])
    assert book.claim_file(RUN, 8, TOKEN, "a", "task-1") is Verdict.WRITE
    before = raw(client, keys, 8)
    assert book.claim_file(RUN, 8, OLD_TOKEN, "a", "task-1") is Verdict.STALE
    assert book.claim_file(RUN, 8, OLD_TOKEN, "b", "task-2") is Verdict.STALE
    stale = book.finish_file(RUN, 8, OLD_TOKEN, "a", FileOutcome.FAILED, "old attempt")
    assert (stale.verdict, stale.finished, stale.nfiles, stale.status, stale.all_finished) == (
        Verdict.STALE,
        0,
        0,
        None,
        False,
    )
    assert book.abandon(RUN, 8, OLD_TOKEN, "old attempt") is Verdict.STALE
    assert raw(client, keys, 8) == before

    persist_all_from = book.finish_file(RUN, 8, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a")))
    assert persist_all_from.verdict is Verdict.COMMIT
    before = raw(client, keys, 8)
    assert book.claim_commit(RUN, 8, OLD_TOKEN, "commit-1") is Verdict.STALE
    assert book.finish_commit(RUN, 8, OLD_TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.STALE
    assert book.finish_commit(RUN, 8, OLD_TOKEN, StepStatus.FAILED, "old attempt", task_id="commit-1") is Verdict.STALE
    assert raw(client, keys, 8) == before
    assert book.progress(RUN, 8)[0] is StepStatus.COMMITTING


def test_every_transition_on_an_unknown_or_expired_step_is_stale_and_creates_nothing(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    assert book.claim_file(RUN, 11, TOKEN, "a", "task-1") is Verdict.STALE
    assert book.finish_file(RUN, 11, TOKEN, "a", FileOutcome.OK, "{}").verdict is Verdict.STALE
    assert book.claim_commit(RUN, 11, TOKEN, "commit-1") is Verdict.STALE
    assert book.finish_commit(RUN, 11, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.STALE
    assert book.abandon(RUN, 11, TOKEN, "gone") is Verdict.STALE
    assert not client.exists(keys.ckpt_state(RUN, 11))
    assert book.in_flight_steps(RUN) == set()


# --- commit: claim_commit / finish_commit -----------------------------------------------------------------


def test_claim_commit_waits_for_every_file(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 12, ["a", "b"])
    book.finish_file(RUN, 12, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a")))
    before = raw(client, keys, 12)
    assert book.claim_commit(RUN, 12, TOKEN, "commit-1") is Verdict.CLOSED
    assert book.finish_commit(RUN, 12, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.CLOSED
    assert raw(client, keys, 12) == before


def test_the_commit_is_fenced_by_the_task_that_claimed_it(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 13, ["a"])
    persist_all(book, 13, ["a"])
    assert book.claim_commit(RUN, 13, TOKEN, "commit-1") is Verdict.WRITE
    assert book.claim_commit(RUN, 13, TOKEN, "commit-1") is Verdict.WRITE  # its own redelivery resumes
    before = raw(client, keys, 13)
    assert book.claim_commit(RUN, 13, TOKEN, "commit-2") is Verdict.CLAIMED  # a second commit task
    assert raw(client, keys, 13) == before

    assert book.finish_commit(RUN, 13, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.OK
    assert book.progress(RUN, 13) == (StepStatus.COMMITTED, 1, 1, "")
    assert book.in_flight_steps(RUN) == set()
    assert 0 < ttl(client, keys, 13) <= STATE_TTL_SECONDS
    assert book.read(RUN, 13).files == {"a": entry("a")}  # what the commit builds the manifest from


def test_a_commit_claimed_by_one_task_cannot_be_ended_by_another(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    """A second commit task (sent again by a redelivered persist) that fails for good must not fail the step
    while the task that claimed the commit is writing its manifest: that one's COMMITTED would be refused and
    the trainer told FAILED about a step whose manifest and `latest` are on disk."""
    begin(book, 18, ["a"])
    persist_all(book, 18, ["a"])
    assert book.claim_commit(RUN, 18, TOKEN, "commit-1") is Verdict.WRITE
    assert book.claim_commit(RUN, 18, TOKEN, "commit-2") is Verdict.CLAIMED
    before = raw(client, keys, 18)
    gave_up = book.finish_commit(RUN, 18, TOKEN, StepStatus.FAILED, "commit failed: redis timeout", task_id="commit-2")
    assert gave_up is Verdict.CLAIMED
    assert book.finish_commit(RUN, 18, TOKEN, StepStatus.COMMITTED, task_id="commit-2") is Verdict.CLAIMED
    assert raw(client, keys, 18) == before
    assert book.in_flight_steps(RUN) == {18}
    assert book.finish_commit(RUN, 18, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.OK
    assert book.progress(RUN, 18) == (StepStatus.COMMITTED, 1, 1, "")


def test_a_commit_nobody_claimed_can_still_be_failed(book: StepLedger) -> None:
    """A commit task that fails for good before its claim (Redis unreachable) still fails the step, so the
    trainer gets the reason instead of a step left COMMITTING; a later commit task then finds it closed."""
    begin(book, 19, ["a"])
    persist_all(book, 19, ["a"])
    assert book.finish_commit(RUN, 19, TOKEN, StepStatus.FAILED, "commit failed: timeout", task_id="c-2") is Verdict.OK
    assert book.progress(RUN, 19) == (StepStatus.FAILED, 1, 1, "commit failed: timeout")
    assert book.claim_commit(RUN, 19, TOKEN, "commit-1") is Verdict.CLOSED


@pytest.mark.parametrize("status", [StepStatus.PERSISTING, StepStatus.COMMITTING])
def test_finish_commit_ends_a_commit_only_as_committed_or_failed(
    book: StepLedger, client: redis.Redis, keys: Keys, status: StepStatus
) -> None:
    begin(book, 20, ["a"])
    persist_all(book, 20, ["a"])
    assert book.claim_commit(RUN, 20, TOKEN, "commit-1") is Verdict.WRITE
    before = raw(client, keys, 20)
    with pytest.raises(ValueError, match=f"not {status.value}"):
        book.finish_commit(RUN, 20, TOKEN, status, task_id="commit-1")
    assert raw(client, keys, 20) == before
    assert book.in_flight_steps(RUN) == {20}


def test_a_file_finished_after_every_file_is_recorded_changes_nothing(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    """Once COMMITTING every file of the attempt is recorded, so a finish for a file not among them (a stray
    or forged payload with the token) is CLOSED: it adds no entry to the manifest being written, and nothing
    changes a COMMITTED step."""
    begin(book, 21, ["a"])
    persist_all(book, 21, ["a"])
    for ended in (False, True):
        if ended:
            commit(book, 21)
        before = raw(client, keys, 21)
        stray = book.finish_file(RUN, 21, TOKEN, "stray", FileOutcome.OK, file_entry_json(entry("stray")))
        assert (stray.verdict, stray.finished, stray.nfiles) == (Verdict.CLOSED, 1, 1)
        assert stray.status is (StepStatus.COMMITTED if ended else StepStatus.COMMITTING)
        failed = book.finish_file(RUN, 21, TOKEN, "stray", FileOutcome.FAILED, "late failure")
        assert failed.verdict is Verdict.CLOSED
        assert raw(client, keys, 21) == before
        assert set(book.read(RUN, 21).files) == {"a"}


def test_a_committed_step_refuses_every_further_transition(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 14, ["a"])
    persist_all(book, 14, ["a"])
    commit(book, 14)
    before = raw(client, keys, 14)
    assert book.claim_commit(RUN, 14, TOKEN, "commit-1") is Verdict.DONE
    assert book.claim_commit(RUN, 14, TOKEN, "commit-2") is Verdict.DONE
    assert book.finish_commit(RUN, 14, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.CLOSED
    assert book.finish_commit(RUN, 14, TOKEN, StepStatus.FAILED, "too late", task_id="commit-1") is Verdict.CLOSED
    assert book.abandon(RUN, 14, TOKEN, "too late") is Verdict.CLOSED
    assert book.claim_file(RUN, 14, TOKEN, "a", "persist-a") is Verdict.DONE
    assert book.claim_file(RUN, 14, TOKEN, "other", "persist-other") is Verdict.CLOSED
    redelivered = book.finish_file(RUN, 14, TOKEN, "a", FileOutcome.FAILED, "late failure")
    assert (redelivered.verdict, redelivered.status) == (Verdict.DONE, StepStatus.COMMITTED)
    assert raw(client, keys, 14) == before
    assert book.progress(RUN, 14) == (StepStatus.COMMITTED, 1, 1, "")


def test_a_failed_commit_fails_the_step_with_its_reason(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 15, ["a"])
    persist_all(book, 15, ["a"])
    assert book.claim_commit(RUN, 15, TOKEN, "commit-1") is Verdict.WRITE
    assert (
        book.finish_commit(RUN, 15, TOKEN, StepStatus.FAILED, "commit failed: file a has 3 bytes", task_id="commit-1")
        is Verdict.OK
    )
    assert book.progress(RUN, 15) == (StepStatus.FAILED, 1, 1, "commit failed: file a has 3 bytes")
    assert book.in_flight_steps(RUN) == set()
    assert 0 < ttl(client, keys, 15) <= STATE_TTL_SECONDS
    assert book.claim_commit(RUN, 15, TOKEN, "commit-1") is Verdict.CLOSED
    assert book.finish_commit(RUN, 15, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.CLOSED
    assert book.progress(RUN, 15)[0] is StepStatus.FAILED


# --- abandon ----------------------------------------------------------------------------------------------


def test_abandon_fails_a_persisting_step_once_and_only_with_its_token(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 16, ["a", "b"])
    assert book.claim_file(RUN, 16, TOKEN, "a", "task-a") is Verdict.WRITE
    assert book.abandon(RUN, 16, OLD_TOKEN, "not mine") is Verdict.STALE
    assert book.progress(RUN, 16)[0] is StepStatus.PERSISTING
    assert book.abandon(RUN, 16, TOKEN, "could not enqueue persist tasks (1/2 sent)") is Verdict.OK
    assert book.progress(RUN, 16) == (StepStatus.FAILED, 0, 2, "could not enqueue persist tasks (1/2 sent)")
    assert book.in_flight_steps(RUN) == set()
    assert 0 < ttl(client, keys, 16) <= STATE_TTL_SECONDS
    assert book.abandon(RUN, 16, TOKEN, "again") is Verdict.CLOSED
    assert book.progress(RUN, 16)[3] == "could not enqueue persist tasks (1/2 sent)"
    assert book.claim_file(RUN, 16, TOKEN, "a", "task-a") is Verdict.CLOSED  # even its own claim stops
    assert book.claim_file(RUN, 16, TOKEN, "b", "task-b") is Verdict.CLOSED


def test_abandon_leaves_a_committing_step_to_its_commit(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 17, ["a"])
    persist_all(book, 17, ["a"])
    before = raw(client, keys, 17)
    assert book.abandon(RUN, 17, TOKEN, "too late") is Verdict.CLOSED
    assert raw(client, keys, 17) == before
    assert book.in_flight_steps(RUN) == {17}


# --- in_flight_steps --------------------------------------------------------------------------------------


def test_in_flight_steps_lists_the_open_steps_of_one_run(book: StepLedger) -> None:
    for step in (1, 2, 3, 4):
        begin(book, step, ["a"])
    begin(book, 1, ["a"], run="other-run")
    persist_all(book, 1, ["a"])
    commit(book, 1)  # committed: out
    assert book.abandon(RUN, 2, TOKEN, "gone") is Verdict.OK  # failed: out
    persist_all(book, 3, ["a"])  # committing: still in
    assert book.in_flight_steps(RUN) == {3, 4}
    assert book.in_flight_steps("other-run") == {1}


# --- hostile or corrupt records ---------------------------------------------------------------------------


def corrupt(client: redis.Redis, keys: Keys, step: int, field: str, value: str = "garbage") -> None:
    client.hset(keys.ckpt_state(RUN, step), field, value)


def a_healthy_neighbour_commits(book: StepLedger, step: int) -> None:
    """Another step of the same run goes through the whole state machine while the corrupt one sits there."""
    begin(book, step, ["a", "b"])
    persist_all(book, step, ["a", "b"])
    commit(book, step)
    assert book.read(RUN, step).files == {"a": entry("a"), "b": entry("b")}
    assert book.progress(RUN, step) == (StepStatus.COMMITTED, 2, 2, "")


@pytest.mark.parametrize("field", ["nfiles", "finished", "ok"])
def test_a_garbage_counter_is_refused_before_finish_file_writes_anything(
    book: StepLedger, client: redis.Redis, keys: Keys, field: str
) -> None:
    begin(book, 30, ["a", "b"])
    book.finish_file(RUN, 30, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a")))
    corrupt(client, keys, 30, field, "12abc")
    before = raw(client, keys, 30)
    for name in ("a", "b"):  # a recorded file and a new one alike: no half-counted file is left behind
        with pytest.raises(CorruptLedger, match=rf"step 30 of run '{RUN}' is corrupt: field {field} of \S+ is not"):
            book.finish_file(RUN, 30, TOKEN, name, FileOutcome.OK, file_entry_json(entry(name)))
    assert raw(client, keys, 30) == before
    a_healthy_neighbour_commits(book, 31)
    assert book.in_flight_steps(RUN) == {30}


@pytest.mark.parametrize("field", ["nfiles", "finished"])
def test_read_and_progress_name_a_garbage_count(book: StepLedger, client: redis.Redis, keys: Keys, field: str) -> None:
    begin(book, 32, ["a"])
    corrupt(client, keys, 32, field, "-1")
    expected = rf"step 32 of run '{RUN}' is corrupt: field {field} of {keys.ckpt_state(RUN, 32)} is not a number: '-1'"
    with pytest.raises(CorruptLedger, match=expected):
        book.read(RUN, 32)
    with pytest.raises(CorruptLedger, match=expected):
        book.progress(RUN, 32)
    a_healthy_neighbour_commits(book, 33)


def test_a_garbage_file_entry_fails_the_read_of_its_step_only(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 34, ["a", "b"])
    book.finish_file(RUN, 34, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a")))
    corrupt(client, keys, 34, "file:a", '{"name": "a"}')
    with pytest.raises(
        CorruptLedger, match=f"step 34 of run '{RUN}' is corrupt: field file:a of .* is not a file entry"
    ):
        book.read(RUN, 34)
    assert book.progress(RUN, 34) == (StepStatus.PERSISTING, 1, 2, "")  # polling reads no file entry
    a_healthy_neighbour_commits(book, 35)


def test_an_unknown_status_gives_a_clear_error_or_a_refusal_never_a_transition(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    begin(book, 36, ["a"])
    corrupt(client, keys, 36, "status", "committed-ish")
    before = raw(client, keys, 36)
    message = f"step 36 of run '{RUN}' is corrupt: field status of .* is no step status: .?committed-ish"
    for read in (book.read, book.progress):
        with pytest.raises(CorruptLedger, match=message):
            read(RUN, 36)
    with pytest.raises(CorruptLedger, match=message):  # not taken over: it may have been a committed step
        book.begin(RUN, 36, "b" * 32, 1, draft(36, time.time() + 10 * AGE), AGE)
    with pytest.raises(CorruptLedger, match=message):
        book.finish_file(RUN, 36, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a")))
    assert book.claim_file(RUN, 36, TOKEN, "a", "task-a") is Verdict.CLOSED
    assert book.claim_commit(RUN, 36, TOKEN, "commit-1") is Verdict.CLOSED
    assert book.finish_commit(RUN, 36, TOKEN, StepStatus.COMMITTED, task_id="commit-1") is Verdict.CLOSED
    assert book.abandon(RUN, 36, TOKEN, "gone") is Verdict.CLOSED
    assert raw(client, keys, 36) == before
    a_healthy_neighbour_commits(book, 37)


def test_a_garbage_start_time_makes_begin_refuse_clearly(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 38, ["a"])
    corrupt(client, keys, 38, "started", "yesterday")
    before = raw(client, keys, 38)
    with pytest.raises(CorruptLedger, match=f"step 38 of run '{RUN}' is corrupt: field started of .* not a number"):
        book.begin(RUN, 38, "b" * 32, 1, draft(38), AGE)
    assert raw(client, keys, 38) == before
    persist_all(book, 38, ["a"])  # the attempt in flight is not harmed: it still commits
    commit(book, 38)
    a_healthy_neighbour_commits(book, 39)


def test_a_garbage_token_makes_every_task_stale(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 40, ["a"])
    corrupt(client, keys, 40, "token", "forged")
    before = raw(client, keys, 40)
    assert book.claim_file(RUN, 40, TOKEN, "a", "task-a") is Verdict.STALE
    assert book.finish_file(RUN, 40, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a"))).verdict is Verdict.STALE
    assert book.claim_commit(RUN, 40, TOKEN, "commit-1") is Verdict.STALE
    assert book.abandon(RUN, 40, TOKEN, "gone") is Verdict.STALE
    assert raw(client, keys, 40) == before
    a_healthy_neighbour_commits(book, 41)


def test_a_garbage_member_of_the_in_flight_set_is_left_out(book: StepLedger, client: redis.Redis, keys: Keys) -> None:
    begin(book, 42, ["a"])
    client.zadd(keys.ckpt_inflight(RUN), {"not-a-step": 1.0, "-3": 2.0})
    assert book.in_flight_steps(RUN) == {42}


def test_a_file_is_open_only_while_its_attempt_persists_and_nothing_recorded_it(book: StepLedger) -> None:
    """`file_open`: what a writer asks just before renaming its copy into place (workers/persist.py)."""
    assert not book.file_open(RUN, 70, TOKEN, "a")  # unknown step
    begin(book, 70, ["a", "b"])
    assert book.file_open(RUN, 70, TOKEN, "a") and book.file_open(RUN, 70, TOKEN, "b")
    assert not book.file_open(RUN, 70, OLD_TOKEN, "a")  # another attempt's writer
    book.claim_file(RUN, 70, TOKEN, "a", "persist-a")
    assert book.file_open(RUN, 70, TOKEN, "a")  # claimed, still being written
    book.finish_file(RUN, 70, TOKEN, "a", FileOutcome.OK, file_entry_json(entry("a")))
    assert not book.file_open(RUN, 70, TOKEN, "a") and book.file_open(RUN, 70, TOKEN, "b")
    book.finish_file(RUN, 70, TOKEN, "b", FileOutcome.FAILED, "disk full")
    assert not book.file_open(RUN, 70, TOKEN, "b")  # recorded (as failed), and the step failed
    begin(book, 71, ["a"])
    persist_all(book, 71, ["a"])  # COMMITTING
    assert not book.file_open(RUN, 71, TOKEN, "a")


# --- the end token: waiters woken as a step ends ------------------------------------------------------------


def _nap_in_thread(book: StepLedger, step: int, seconds: float) -> tuple[threading.Thread, list[tuple[bool, float]]]:
    """`book.nap` in a thread of its own; the list gets (woken, seconds it took)."""
    out: list[tuple[bool, float]] = []

    def nap() -> None:
        began = time.monotonic()
        woken = book.nap(RUN, step, seconds)
        out.append((woken, time.monotonic() - began))

    thread = threading.Thread(target=nap, daemon=True)
    thread.start()
    time.sleep(0.2)  # blocked on the token by now
    return thread, out


@pytest.mark.parametrize("end", ["committed", "file-failed", "commit-failed", "abandoned"])
def test_every_end_of_a_step_wakes_its_waiter_at_once_and_the_token_passes_on(
    book: StepLedger, client: redis.Redis, keys: Keys, end: str
) -> None:
    """Whichever script ends the step pushes the end token: a waiter blocked for 30 s wakes within a second;
    a waiter that found the step ended puts it back for the next (`pass_on_end`), which then wakes at once;
    the token expires on its own."""
    begin(book, 40, ["a"])
    thread, out = _nap_in_thread(book, 40, 30.0)
    if end == "abandoned":
        assert book.abandon(RUN, 40, TOKEN, "not sent") is Verdict.OK
    elif end == "file-failed":
        assert book.finish_file(RUN, 40, TOKEN, "a", FileOutcome.FAILED, "disk full").status is StepStatus.FAILED
    else:
        persist_all(book, 40, ["a"])
        assert book.claim_commit(RUN, 40, TOKEN, "commit-1") is Verdict.WRITE
        status = StepStatus.COMMITTED if end == "committed" else StepStatus.FAILED
        assert book.finish_commit(RUN, 40, TOKEN, status, task_id="commit-1") is Verdict.OK
    thread.join(10)
    assert out and out[0][0] and out[0][1] < 1.0, out
    assert book.progress(RUN, 40)[0] in (StepStatus.COMMITTED, StepStatus.FAILED)
    book.pass_on_end(RUN, 40)
    began = time.monotonic()
    assert book.nap(RUN, 40, 30.0) and time.monotonic() - began < 1.0  # the next waiter: at once
    assert 0 < int(client.ttl(keys.ckpt_ended(RUN, 40))) <= 60 or not client.exists(keys.ckpt_ended(RUN, 40))


def test_a_nap_without_an_end_sleeps_its_time_and_a_stray_token_is_consumed(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    """No end: the nap lasts its time. A token nobody ended the step for (an earlier attempt's, or written by
    hand) wakes one nap, is consumed, and the next nap sleeps again: nothing spins. A new attempt removes an
    earlier attempt's token."""
    begin(book, 41, ["a"])
    began = time.monotonic()
    assert not book.nap(RUN, 41, 0.3)
    assert 0.25 <= time.monotonic() - began < 2.0
    client.rpush(keys.ckpt_ended(RUN, 41), "junk")
    assert book.nap(RUN, 41, 5.0)
    began = time.monotonic()
    assert not book.nap(RUN, 41, 0.3) and time.monotonic() - began >= 0.25
    client.rpush(keys.ckpt_ended(RUN, 42), 1)  # step 42's attempt that failed left its token
    begin(book, 42, ["a"])
    assert not client.exists(keys.ckpt_ended(RUN, 42))


def test_an_end_token_key_of_another_type_costs_the_wake_up_never_the_commit(
    book: StepLedger, client: redis.Redis, keys: Keys
) -> None:
    """A hash where the end token goes (not DCS's): the step still commits, and a nap is a plain sleep."""
    begin(book, 43, ["a"])
    client.hset(keys.ckpt_ended(RUN, 43), "x", "y")
    persist_all(book, 43, ["a"])
    commit(book, 43)
    assert book.progress(RUN, 43)[0] is StepStatus.COMMITTED
    began = time.monotonic()
    assert not book.nap(RUN, 43, 0.2) and time.monotonic() - began >= 0.15
