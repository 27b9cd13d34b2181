"""Retention as the process runs it: ``serve``'s background job and one
``ballet-planner purge`` (docs/retention.md; decisions 0250-0253).

The rules are the core's (``service/core/retention.py``) and the SQL the store's
(``service/adapters/store/retention.py``); this module builds them from the settings,
records what they did in the Prometheus metrics, and runs one pass or one erasure for
the command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from prometheus_client import push_to_gateway
from sqlalchemy.engine import make_url

from service.adapters.clock import SystemClock
from service.adapters.store import SqlSessionStore, make_engine, schema_status
from service.adapters.store.database import Database
from service.adapters.store.retention import SqlRetentionStore
from service.adapters.store.work import UnitsOfWork
from service.config import RetentionSettings, Settings
from service.core.errors import StoreUnavailable
from service.core.ports import Clock
from service.core.retention import (
    ErasureReport,
    PassOutcome,
    PassReport,
    PurgeBounds,
    Purger,
    PurgeReason,
    RetentionJob,
)
from service.server.metrics import Metrics, PurgeRunMetrics
from service.server.wiring import PlannerTurns

#: Seconds an erasure's cancelled turns get to end beyond the configured
#: ``planner.cancel_grace + planner.lease_s + planner.sweep_interval_s``: the cancel's
#: delivery (within 1 s) and the turn's last commit.
CANCEL_MARGIN_S = 2.0


class PrometheusPurgeObserver:
    """Records deletions and passes in the planner's ``Metrics`` (labels: reason,
    outcome; never an id)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def deleted(self, reason: PurgeReason, sessions: int, messages: int) -> None:
        """Count sessions and messages deleted for ``reason``."""
        self._metrics.retention_sessions_deleted.labels(reason.value).inc(sessions)
        self._metrics.retention_messages_deleted.labels(reason.value).inc(messages)

    def pass_ended(self, outcome: PassOutcome, at: datetime) -> None:
        """Count a pass; a completed one also sets the time of the last."""
        self._metrics.retention_passes.labels(outcome.value).inc()
        if outcome is PassOutcome.COMPLETED:
            self._metrics.retention_last_completed_pass.set(at.timestamp())


def purge_bounds(retention: RetentionSettings) -> PurgeBounds:
    """The batch bounds of ``[retention]``."""
    return PurgeBounds(
        max_sessions=retention.batch_sessions,
        max_events=retention.batch_events,
        pause_s=retention.batch_pause_s,
    )


def erasure_wait_s(settings: Settings) -> float:
    """Seconds an erasure waits for the human's cancelled turns to end: a cancelled
    turn stores its end within ``planner.cancel_grace`` (plus the cancel's delivery); a
    turn of a replica that died is closed by the sweeper once its lease lapses."""
    planner = settings.planner
    return planner.cancel_grace + planner.lease_s + planner.sweep_interval_s + CANCEL_MARGIN_S


def retention_job(
    settings: Settings,
    database: Database,
    turns: PlannerTurns,
    clock: Clock,
    metrics: Metrics,
) -> RetentionJob | None:
    """``serve``'s background job on ``database``, or None when
    ``retention.session_idle_days`` is 0 or ``retention.background`` is false. Deleted
    sessions end this replica's streams and leave its context cache (``turns``,
    ``database.sessions``); its units of work are the database's, whose close waits for
    them."""
    retention = settings.retention
    if not retention.session_idle_days or not retention.background:
        return None
    store = SqlRetentionStore(
        database.engine, settings.server.replica_id, units_of_work=database.units_of_work
    )
    if store.signals is not None:
        store.signals.watch(metrics.count_signal)

    def deleted(session_ids: Sequence[str]) -> None:
        database.sessions.forget_sessions(session_ids)
        turns.sessions_deleted(session_ids)

    observer = PrometheusPurgeObserver(metrics)
    purger = Purger(
        store,
        database.sessions,
        clock,
        purge_bounds(retention),
        on_deleted=deleted,
        observer=observer,
    )
    return RetentionJob(purger, retention.session_idle_days, retention.interval_s, clock, observer)


# --------------------------------------------------------------------------- purge


class PurgeError(Exception):
    """``ballet-planner purge`` cannot do its work; the message says why (exit 1)."""


@dataclass(frozen=True)
class PurgeRequest:
    """One run of ``ballet-planner purge``: an idle pass, or the erasure of
    ``human_id``; ``dry_run`` counts only."""

    human_id: str | None = None
    dry_run: bool = False


async def run_purge(
    settings: Settings, request: PurgeRequest, *, clock: Clock | None = None
) -> PassReport | ErasureReport:
    """Run one idle pass (``retention.session_idle_days``, at least 1) or one erasure on
    the configured database, as replica ``purge-<server.replica_id>`` (so every serving
    replica hears its deletions). Raises ``PurgeError`` when the database is missing,
    unreachable or its schema is behind this release."""
    url = settings.database.url
    if settings.database.is_sqlite:
        _check_sqlite_file(url)
    clock = clock or SystemClock()
    engine = make_engine(url, pool_size=2, max_overflow=1)
    replica = f"purge-{settings.server.replica_id}"
    try:
        status = await schema_status(engine)
        if status.behind:
            raise PurgeError(f"{status}: run `ballet-planner migrate` first")
        work = UnitsOfWork()
        purger = Purger(
            SqlRetentionStore(engine, replica, units_of_work=work),
            SqlSessionStore(engine, replica, units_of_work=work),
            clock,
            purge_bounds(settings.retention),
        )
        if request.human_id is not None:
            return await purger.erase(
                request.human_id, dry_run=request.dry_run, cancel_wait_s=erasure_wait_s(settings)
            )
        return await purger.purge_idle(
            settings.retention.session_idle_days, dry_run=request.dry_run
        )
    except StoreUnavailable as error:
        # Said once: the store's own message may already name the database.
        detail = str(error).removeprefix("the database is unreachable: ")
        detail = detail.removeprefix("the database is unavailable: ")
        raise PurgeError(f"the database is unreachable: {detail}") from error
    finally:
        await engine.dispose()


def _check_sqlite_file(url: str) -> None:
    # A purge never creates a database: a wrong path would otherwise "purge" an empty one.
    database = make_url(url).database
    if database and Path(database).parent.is_file():
        raise PurgeError(
            f"{Path(database).parent} is a file, not a folder: no SQLite database there"
        )
    if not database or not Path(database).is_file():
        raise PurgeError(f"no SQLite database at {database}: nothing to purge")


def push_purge_metrics(gateway: str, report: PassReport | ErasureReport, at: datetime) -> None:
    """Push what ``report`` deleted to the Prometheus Pushgateway at ``gateway`` (a URL
    or host:port), as ``PurgeRunMetrics`` under job ``ballet-planner-purge`` and the
    run's ``reason``; a dry run, or a pass skipped because another held the lock,
    pushes nothing (so a stale ``last_success`` shows). Raises ``OSError`` when the push
    fails."""
    if report.dry_run or (isinstance(report, PassReport) and report.skipped):
        return
    metrics = PurgeRunMetrics()
    metrics.sessions_deleted.set(report.sessions)
    metrics.messages_deleted.set(report.messages)
    metrics.last_success.set(at.timestamp())
    reason = PurgeReason.ERASURE if isinstance(report, ErasureReport) else PurgeReason.IDLE
    push_to_gateway(
        gateway,
        job=PurgeRunMetrics.JOB,
        registry=metrics.registry,
        grouping_key={"reason": reason.value},
        timeout=10,
    )


# --------------------------------------------------------------------------- reports

#: What an erasure leaves, said in the command's output and in docs/retention.md
#: (decision 0252).
ERASURE_KEEPS = (
    "what the planner wrote to projects acting for this human (changesets it proposed, "
    "knowledge entries it wrote, and those services' records of the calls) belongs to "
    "the projects and lives in the tracker and knowledge services: erase it there",
    "the planner's logs and traces name the human id (never message text) and are kept "
    "as your log and trace pipelines keep them",
)


def report_complete(report: PassReport | ErasureReport) -> bool:
    """False for an erasure that left sessions of the human (``purge`` exits 1)."""
    return not isinstance(report, ErasureReport) or report.complete


def report_lines(report: PassReport | ErasureReport, idle_days: int) -> list[str]:
    """What ``ballet-planner purge`` prints: one line for a pass; for an erasure, what
    was deleted, what is left and what the planner keeps (``ERASURE_KEEPS``)."""
    if isinstance(report, PassReport):
        if report.skipped:
            return [
                "retention: another planner is running a pass (it holds the retention "
                "lock); nothing done"
            ]
        found = f"{report.sessions} session(s) with {report.messages} message(s)"
        before = (
            f"last active before {report.idle_before.isoformat(timespec='seconds')} "
            f"({idle_days} days)"
        )
        if report.dry_run:
            return [f"retention (dry run): {found} {before} would be deleted; nothing was deleted"]
        return [f"retention: deleted {found} {before}, in {report.batches} batch(es)"]
    who = f"human {report.human_id!r}"
    found = (
        f"{report.sessions} session(s) with {report.messages} message(s) and "
        f"{report.stream_slots} open stream slot(s)"
    )
    turns = report.running_turns
    if report.dry_run:
        first = f", after cancelling {turns} running turn(s)" if turns else ""
        lines = [f"erasure of {who} (dry run): would delete {found}{first}; nothing was deleted"]
    else:
        first = f"; {turns} running turn(s) cancelled first" if turns else ""
        lines = [f"erasure of {who}: deleted {found}{first}"]
        if report.left:
            lines.append(
                f"incomplete: {report.left} session(s) of {who} are left: a turn in them "
                "did not end in time, or they were created meanwhile; run the command again"
            )
    lines.extend(f"kept: {kept}" for kept in ERASURE_KEEPS)
    return lines


def report_json(report: PassReport | ErasureReport) -> dict[str, object]:
    """``purge --json``'s object: ``kind`` (``idle`` or ``erasure``), the report's
    fields (times in ISO 8601), ``complete``, and for an erasure ``kept``."""
    erasure = isinstance(report, ErasureReport)
    outcome: dict[str, object] = {"kind": "erasure" if erasure else "idle"}
    for key, value in vars(report).items():
        outcome[key] = value.isoformat() if isinstance(value, datetime) else value
    outcome["complete"] = report_complete(report)
    if erasure:
        outcome["kept"] = list(ERASURE_KEEPS)
    return outcome
