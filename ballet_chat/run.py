"""How ``ballet-planner chat`` runs: one message and exit (``run_once``), or the
interactive loop (``ballet_chat.interactive``), over one ``ChatClient``. The top of the
chat client's modules: it imports the others, none imports it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import TextIO

from ballet.planner.v1 import resources_pb2

from ballet_chat.client import TITLE_CHARS, ChatClient, ChatError, ChatOptions, End, Sent
from ballet_chat.input import LineSource
from ballet_chat.interactive import Interactive
from ballet_chat.render import describe_turn_end, short
from ballet_common.addresses import is_loopback
from ballet_common.grpc.channels import make_channel


async def run_once(client: ChatClient, text: str) -> int:
    """Send ``text``, show the turn, return 0 for COMPLETED or MAX_ROUNDS, else 1 (the
    refusal or the turn's end said once, on stderr: ``ChatClient.batch``).

    Ctrl-C cancels the turn on the planner and waits for its end; a second one leaves
    once the planner has answered the cancel, waiting at most ``CANCEL_SEND_S``. Either
    way the chat says on stderr whether the turn was cancelled or may still run there,
    and returns 130 (docs/decisions/0321-ctrl-c-in-the-chat.md)."""
    client.batch = True
    assert client.session is not None
    # One line on stderr (stdout keeps the transcript): how to go on with the session.
    session_id = client.session.session_id
    print(
        f"ballet-planner chat: session {session_id} (continue it with --session {session_id})",
        file=client.err,
        flush=True,
    )
    sent = await client.send(text)
    loop = asyncio.get_running_loop()
    interrupts: list[asyncio.Task[str]] = []
    leave = asyncio.Event()

    def interrupt() -> None:
        if interrupts:
            leave.set()
            return
        print(
            "ballet-planner chat: interrupted: cancelling the turn (Ctrl-C again leaves at once)",
            file=client.err,
            flush=True,
        )
        interrupts.append(loop.create_task(client.request_cancel()))

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, interrupt)
    following = loop.create_task(_follow(client, sent))
    leaving = loop.create_task(leave.wait())
    try:
        done, _ = await asyncio.wait({following, leaving}, return_when=asyncio.FIRST_COMPLETED)
        if following in done:
            following.result()
        else:
            # A second Ctrl-C leaves at once, but not before the first one's cancel is on
            # its way (both can land in one pass of the loop, before it was written).
            await _cancel_sent(client, interrupts[0], following)
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
        for task in (following, leaving):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if interrupts:
        print(
            f"ballet-planner chat: interrupted: {_interrupted(sent)}; see the session with "
            f"--session {session_id}",
            file=client.err,
            flush=True,
        )
        return INTERRUPTED
    return 0 if sent.ok else 1


#: The exit code after Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


#: The longest a second Ctrl-C waits for the planner to answer the first one's cancel
#: (seconds): a message still being accepted names its turn within milliseconds, and the
#: unary ``CancelTurn`` answers once the planner has the cancel.
CANCEL_SEND_S = 2.0


async def _cancel_sent(
    client: ChatClient, cancelling: asyncio.Task[str], following: asyncio.Task[None]
) -> None:
    """Wait, at most ``CANCEL_SEND_S``, until the planner has the cancel that
    ``cancelling`` asked for: its turn is known at once for a running turn, or, for a
    message still being accepted, once ``following`` has read the turn it started; then
    the unary ``CancelTurn`` says the planner has it (the stream's own cancel may still
    be unread when the stream closes)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CANCEL_SEND_S):
            await asyncio.wait({cancelling})
            while client.cancel_requested and not following.done():
                await asyncio.wait({following}, timeout=0.05)
            await client.cancel_acknowledged()


def _interrupted(sent: Sent) -> str:
    """What became of the turn of ``sent`` after Ctrl-C, for the user."""
    if sent.refused:
        return "the message was refused"
    if sent.ended is None:
        return "the turn may still run on the planner (its cancel was not confirmed)"
    if sent.ended.reason == resources_pb2.TURN_END_REASON_CANCELLED:
        return "the turn was cancelled"
    return f"the turn had ended before the cancel {describe_turn_end(sent.ended)}"


async def _follow(client: ChatClient, sent: Sent) -> None:
    while not sent.done:
        event = await client.next_event()
        if event is End.REOPEN:
            await client.reopen()
        elif event is End.CLOSED:
            raise ChatError("the planner closed the stream before the turn ended")


def address_problem(address: str) -> str:
    """Why ``--address ADDRESS`` cannot be the planner's (one line, naming the flag), or
    ``""`` when it can: a ``HOST:PORT`` on this machine (decision 0167)."""
    if "://" in address:
        return (
            f"--address {address}: give HOST:PORT without a scheme, e.g. 127.0.0.1:50051 "
            "(the chat speaks gRPC, not HTTP)"
        )
    if not _has_port(address):
        return f"--address {address}: expected the planner's HOST:PORT, e.g. 127.0.0.1:50051"
    if not is_loopback(address):
        # The client speaks plaintext gRPC, which the planner's own rules allow only on
        # this machine (docs/spec/authority.md); a tunnel is what reaches one elsewhere.
        return (
            f"--address {address}: chat reaches a planner on this machine only "
            "(127.0.0.1:PORT, localhost:PORT or [::1]:PORT; it has no TLS); for one "
            "elsewhere, forward a local port to it, e.g. `ssh -N -L 50051:HOST:50051 "
            "SSH_HOST`, and give --address 127.0.0.1:50051"
        )
    return ""


def _has_port(address: str) -> bool:
    """Whether ``address`` ends in a port (1-65535), or is a Unix socket."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) <= 65535


async def run_chat(
    options: ChatOptions,
    *,
    lines: LineSource | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the chat; returns the exit code (see the module docstring). Raises
    ``ChatError`` when the planner cannot be reached, refuses the token, or the project
    or session does not exist."""
    client = ChatClient(options, out or sys.stdout, err or sys.stderr)
    problem = address_problem(options.address)
    if problem:
        raise ChatError(problem)
    client.channel = make_channel(options.address, tls=None, insecure=False)
    try:
        if options.session_id:
            await client.resume(options.session_id)
        elif options.message is not None:
            await client.open(title=short(options.message, TITLE_CHARS))
        else:
            # Interactive: the session is created with the first message; learn now
            # whether the planner is there and takes the token.
            await client.check()
        if options.message is not None:
            return await run_once(client, options.message)
        return await Interactive(client, lines).run()
    finally:
        await client.close()
