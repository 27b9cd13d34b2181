"""How ``ballet-planner chat`` runs: one message and exit (``run_once``), or the
interactive loop (``ballet_chat.interactive``), over one ``ChatClient``. The top of the
chat client's modules: it imports the others, none imports it."""

from __future__ import annotations

import sys
from typing import TextIO

from ballet_chat.client import TITLE_CHARS, ChatClient, ChatError, ChatOptions, End
from ballet_chat.input import LineSource
from ballet_chat.interactive import Interactive
from ballet_chat.render import short
from ballet_common.grpc.channels import is_loopback, make_channel


async def run_once(client: ChatClient, text: str) -> int:
    """Send ``text``, show the turn, return 0 for COMPLETED or MAX_ROUNDS, else 1 (the
    refusal or the turn's end said once, on stderr: ``ChatClient.batch``)."""
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
    while not sent.done:
        event = await client.next_event()
        if event is End.REOPEN:
            await client.reopen()
        elif event is End.CLOSED:
            raise ChatError("the planner closed the stream before the turn ended")
    return 0 if sent.ok else 1


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
    if not is_loopback(options.address):
        # The client speaks plaintext gRPC, which the planner's own rules allow only on
        # this machine (docs/spec/authority.md); a tunnel is what reaches one elsewhere.
        raise ChatError(
            f"--address {options.address}: chat reaches a planner on this machine only "
            "(127.0.0.1:PORT, localhost:PORT or [::1]:PORT; it has no TLS); for one "
            "elsewhere, forward a local port to it, e.g. `ssh -N -L 50051:HOST:50051 "
            "SSH_HOST`, and give --address 127.0.0.1:50051"
        )
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
