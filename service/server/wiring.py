"""The turn side of the planner as the composition root builds it (``service.server.root``):
the fan-out hub, the cross-replica notifier, the gateway client, the tool runner, the
``TurnService`` and the ``Chat``/``SendMessage``/``CancelTurn`` RPCs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.adapters.bus import NullNotifier, PgNotifier
from service.adapters.gateway import GrpcModelGateway, RetryPolicy
from service.adapters.store.engine import SocketBounds
from service.config import Settings
from service.config.settings import DatabaseSettings
from service.core.chat import ChatLimits, ChatService
from service.core.errors import Unavailable
from service.core.fanout import Hub
from service.core.ports import (
    Clock,
    Notifier,
    RunningLimits,
    SessionStore,
    StreamStore,
    ToolBackends,
    Tracer,
)
from service.core.projects import ProjectDirectory
from service.core.sessions import SessionRules
from service.core.streams import StreamRegistry
from service.core.tools import ToolRunner, declarations
from service.core.tracing import NULL_TRACER
from service.core.turn import TurnDependencies, TurnService, TurnSettings
from service.server.credentials import ServiceCredentials
from service.server.metrics import Metrics
from service.server.observer import PrometheusTurnObserver
from service.transport.auth import Authenticator


@dataclass(frozen=True)
class Wiring:
    """Everything the turn machinery is built from; owned by the composition root."""

    settings: Settings
    store: SessionStore
    backends: ToolBackends
    gateway_channel: Any
    #: The planner's credential per dependency audience (``service.server.credentials``).
    service_credentials: ServiceCredentials
    authenticator: Authenticator
    rules: SessionRules
    clock: Clock
    metrics: Metrics
    #: Open Chat streams across replicas (docs/spec/operations.md); None: this process's count only.
    streams: StreamStore | None = None
    #: Spans of turns, rounds, model and tool calls; NULL_TRACER: off.
    tracer: Tracer = NULL_TRACER
    #: The process's one project cache (``project_directory``), also behind ``rules``.
    projects: ProjectDirectory | None = None


def project_directory(settings: Settings, backends: ToolBackends, clock: Clock) -> ProjectDirectory:
    """The process's one project cache: the session access checks and the turns' prompts
    read projects and skills through it, reused ``auth.project_check_cache_s`` seconds,
    each backend call within ``dependencies.project_lookup_s``."""
    return ProjectDirectory(
        backends,
        clock,
        cache_s=settings.auth.project_check_cache_s,
        timeout_s=settings.dependencies.project_lookup_s,
    )


def build_turns(wiring: Wiring) -> PlannerTurns:
    """Build the turn side: the fan-out hub, the cross-replica notifier (PostgreSQL
    LISTEN/NOTIFY on the sessions streamed here, healed by sequence; nothing on SQLite,
    a single process), the gateway client, the tool
    runner, the ``TurnService`` and the Chat/SendMessage/CancelTurn RPCs."""
    settings = wiring.settings
    planner, limits, deps = settings.planner, settings.limits, settings.dependencies
    store = wiring.store
    hub = Hub(
        store.events_after,
        max_events=limits.stream_queue_events,
        max_bytes=limits.stream_queue_bytes,
        client_message_max_bytes=limits.client_message_max_bytes,
        heartbeat_s=planner.stream_heartbeat_s,
    )
    # The gateway gets the credential for its audience alone.
    gateway = GrpcModelGateway(
        wiring.gateway_channel,
        metadata=wiring.service_credentials["gateway"].metadata,
        max_answer_bytes=deps.gateway.max_message_bytes,
        max_request_bytes=deps.gateway.max_message_bytes,
        retry=RetryPolicy(window_s=deps.model_retry_window_s),
    )
    tools = ToolRunner(
        wiring.backends,
        max_result_bytes=planner.tool_result_max_bytes,
        timeout_s=deps.tool_call_s,
    )
    turns = TurnService(
        TurnDependencies(
            store=store,
            gateway=gateway,
            backends=wiring.backends,
            hub=hub,
            clock=wiring.clock,
            settings=TurnSettings(
                model=planner.model,
                max_rounds=planner.max_rounds,
                compact_at_tokens=planner.compact_at_tokens,
                compaction_input_max_tokens=planner.compaction_input_max_tokens,
                summary_instructions=planner.summary_instructions,
                turn_timeout_s=planner.turn_timeout,
                cancel_grace_s=planner.cancel_grace,
                max_writes_per_turn=planner.max_writes_per_turn,
                max_tool_calls_per_answer=planner.max_tool_calls_per_answer,
                model_context_tokens=planner.model_context_tokens,
                max_output_tokens=planner.max_output_tokens,
                compaction_max_output_tokens=planner.compaction_max_output_tokens,
                turn_max_model_requests=planner.turn_max_model_requests,
                turn_max_tool_calls=planner.turn_max_tool_calls,
                turn_max_tokens=planner.turn_max_tokens,
                tool_concurrency=planner.tool_concurrency,
                tool_arguments_max_bytes=planner.tool_arguments_max_bytes,
                tool_arguments_cut_bytes=planner.tool_result_max_bytes,
                dependency_timeout_s=deps.project_lookup_s,
                model_first_delta_s=deps.model_first_delta_s,
                model_idle_s=deps.model_idle_s,
                model_total_s=deps.model_total_s,
                lease_s=planner.lease_s,
                sweep_interval_s=planner.sweep_interval_s,
                prompt_cache_s=settings.auth.project_check_cache_s,
                conversation_cache_bytes=settings.database.context_cache_bytes,
                message_max_bytes=limits.message_max_bytes,
                max_queued=planner.max_queued_messages,
                running_limits=RunningLimits(
                    per_human=limits.turns_per_human, per_project=limits.turns_per_project
                ),
            ),
            replica_id=settings.server.replica_id,
            tools=tools,
            declarations=declarations(),
            observer=PrometheusTurnObserver(wiring.metrics),
            tracer=wiring.tracer,
            projects=wiring.projects,
        )
    )
    metrics = wiring.metrics
    metrics.running_turns.set_function(lambda: turns.running)
    registry = (
        StreamRegistry(
            wiring.streams,
            wiring.clock,
            settings.server.replica_id,
            per_human=limits.streams_per_human,
            lease_s=planner.lease_s,
            sweep_interval_s=planner.sweep_interval_s,
        )
        if wiring.streams is not None
        else None
    )
    chat = ChatService(
        rules=wiring.rules,
        turns=turns,
        hub=hub,
        store=store,
        clock=wiring.clock,
        limits=ChatLimits(
            open_timeout_s=limits.open_timeout_s,
            max_replay_events=planner.max_replay_events,
            streams_per_human=limits.streams_per_human,
            client_message_max_bytes=limits.client_message_max_bytes,
        ),
        on_stream_change=metrics.open_streams.inc,
        streams=registry,
    )
    url = settings.database.url
    notifier: Notifier = NullNotifier()
    if url.startswith("postgresql"):
        listener = PgNotifier(
            url,
            settings.server.replica_id,
            heal_interval_s=planner.heal_interval_s,
            connect_timeout_s=settings.database.connect_timeout_s,
            bounds=socket_bounds(settings.database),
        )
        listener.watch(metrics.count_notification)
        notifier = listener
    # A replica listens to a session's notifications only while a stream here follows it.
    hub.on_follow(notifier.follow, notifier.unfollow)
    return PlannerTurns(turns, hub, notifier, chat, registry)


def socket_bounds(database: DatabaseSettings) -> SocketBounds:
    """The socket-level bounds of every PostgreSQL connection of ``database`` (its
    ``tcp_user_timeout_s`` and ``keepalives_*`` keys, decision 0310)."""
    return SocketBounds(
        tcp_user_timeout_s=database.tcp_user_timeout_s,
        keepalives_idle_s=database.keepalives_idle_s,
        keepalives_interval_s=database.keepalives_interval_s,
        keepalives_count=database.keepalives_count,
    )


@dataclass
class PlannerTurns:
    """The turn side as the composition root runs it: the RPCs ``PlannerService``
    delegates to, and the lifecycle (start: recover this replica's turns, lease renewal,
    the sweeper, fan-out; stop: stop accepting turns, let running ones end within the
    grace period, close the rest ``INTERRUPTED``)."""

    turns: TurnService
    hub: Hub
    notifier: Notifier
    #: ``Chat``, ``SendMessage`` and ``CancelTurn`` as the servicer calls them.
    chat: ChatService
    streams: StreamRegistry | None = None

    def sessions_deleted(self, session_ids: Sequence[str]) -> None:
        """Sessions were deleted by this process's retention job: stop their turns here
        and end the streams attached here with ``NOT_FOUND``, as after ``DeleteSession``
        (other replicas hear the store's notification)."""
        for session_id in session_ids:
            self.chat.session_deleted(session_id)

    async def start(self) -> None:
        """Start the notifier (other replicas' events and cancels), then the turns."""
        await self.notifier.start(
            self.hub.on_remote_events, self.turns.on_remote_cancel, self.hub.resync
        )
        await self.turns.start()
        if self.streams is not None:
            await self.streams.start()

    async def stop(self, grace_s: float) -> None:
        """Stop the turns within ``grace_s`` (``TurnService.stop``) and end every stream
        ``UNAVAILABLE``/``SHUTTING_DOWN``: at once for a stream whose session has no turn
        running here, after its turn's end for the others. Then the stream registry and
        the notifier stop (decision 0181)."""
        ending = Unavailable(
            "the planner is shutting down; reopen with after_sequence", reason="SHUTTING_DOWN"
        )
        self.hub.close_idle(ending, self.turns.running_sessions)
        await self.turns.stop(grace_s)
        self.hub.close_all(ending)
        if self.streams is not None:
            await self.streams.stop()
        await self.notifier.stop()

    async def hurry(self, grace_s: float) -> None:
        """Hurry a ``stop`` in progress to end within ``grace_s`` (a second stop signal;
        decision 0185): the turns' stop is called again with that period
        (``TurnService.stop`` skips ahead to stopping and closing the turns), and the stop
        in progress then ends the streams and stops the rest."""
        await self.turns.stop(grace_s)
