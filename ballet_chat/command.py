"""``ballet-planner chat``: the command line of the terminal client (its options, the dev
token it mints with ``--user``, its exit codes). Registered on the ``ballet-planner``
command through the entry point group ``ballet_planner.commands``; cheap to import (what
the chat needs is imported when it runs)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from ballet_common import datadir, devusers

#: Where the planner listens by default (its ``server.address``).
DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_chat(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``chat`` on ``ballet-planner``'s subcommands (the entry point of group
    ``ballet_planner.commands``)."""
    parser = commands.add_parser(
        "chat",
        help="chat with the planner in the terminal",
        description="The terminal client of the Chat RPC. Interactive by default (/help; "
        "/interrupt TEXT, /cancel, /new, /sessions, /open ROW or ID, /history, /quit); with "
        "--message, send one "
        "message, print the turn and exit 0 when it ended COMPLETED or MAX_ROUNDS (1 "
        "otherwise; 130 after Ctrl-C, saying whether the turn was cancelled).",
    )
    parser.add_argument(
        "--address",
        help=f"planner host:port (default: $BALLET_PLANNER__SERVER__ADDRESS or {DEFAULT_ADDRESS})",
    )
    parser.add_argument("--project", default="demo", help="project of a new session (demo)")
    parser.add_argument("--session", help="resume this session instead")
    parser.add_argument("--user", help="mint a dev token for this user from the data dir")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="where the dev secret is (default: $BALLET_PLANNER__DATA_DIR or ./.ballet-dev)",
    )
    parser.add_argument("--org", default="acme", help="organization of --user (default acme)")
    parser.add_argument("--token", help="a bearer token (JWT) instead of --user")
    parser.add_argument("--message", help="send this message, print the turn, exit")
    parser.add_argument(
        "--json", action="store_true", help="print each ChatResponse as one line of JSON"
    )
    parser.set_defaults(handler=chat)


def chat(args: argparse.Namespace) -> int:
    """Run ``ballet-planner chat``; returns the exit code (0 as ``run_chat`` says, 1 when
    the planner cannot be reached or refuses, 2 for a usage problem)."""
    from ballet_chat.client import ChatError, ChatOptions
    from ballet_chat.render import terminal_safe
    from ballet_chat.run import address_problem, run_chat
    from ballet_common.tokens import (
        DEFAULT_DEV_TOKEN_TTL_S,
        DevSecretError,
        dev_secret,
        mint_dev_token,
    )

    # The arguments first: nothing is read for a command that cannot run.
    if args.message is not None and not args.message.strip():
        print("ballet-planner chat: --message is empty", file=sys.stderr)
        return 2
    if args.session is not None and not args.session.strip():
        # Not a new session in disguise: whoever typed --session meant one.
        print("ballet-planner chat: --session is empty (give a session id)", file=sys.stderr)
        return 2
    if args.token and args.user:
        print(
            "ballet-planner chat: give --user NAME (a dev token minted here) or --token JWT, "
            "not both",
            file=sys.stderr,
        )
        return 2
    address = args.address or os.environ.get("BALLET_PLANNER__SERVER__ADDRESS") or DEFAULT_ADDRESS
    problem = address_problem(address)
    if problem:
        print(f"ballet-planner chat: {problem}", file=sys.stderr)
        return 2
    mint = None
    if args.token:
        token = args.token
    elif args.user:
        data_dir = datadir.chosen(args.data_dir)
        try:
            # Never create a secret here: a new one would sign tokens nobody accepts.
            secret = dev_secret(data_dir, create=False)
        except FileNotFoundError:
            print(
                f"ballet-planner chat: no dev secret in {data_dir.absolute()}: start "
                "`ballet-planner dev` first, or give the data directory it uses (--data-dir "
                "DIR: the `data` line of its banner), or --token",
                file=sys.stderr,
            )
            return 2
        except DevSecretError as error:
            print(f"ballet-planner chat: {error}", file=sys.stderr)
            return 2
        except OSError as error:
            unusable = datadir.unusable(data_dir, error, "read the dev secret", datadir.WITH_OPTION)
            print(f"ballet-planner chat: {unusable}", file=sys.stderr)
            return 2
        user, org = args.user, args.org
        users = devusers.read(data_dir)
        mismatch = devusers.mismatch(users, user, org) if users is not None else ""
        if mismatch:
            print(f"ballet-planner chat: {mismatch}", file=sys.stderr)
            return 2

        def mint() -> str:
            return mint_dev_token(secret, user, organization_id=org, ttl_s=DEFAULT_DEV_TOKEN_TTL_S)

        token = mint()
    else:
        print("ballet-planner chat: give --user NAME (dev) or --token JWT", file=sys.stderr)
        return 2
    options = ChatOptions(
        address=address,
        token=token,
        project_id=args.project,
        session_id=args.session or "",
        message=args.message,
        as_json=args.json,
        mint=mint,
    )
    try:
        return asyncio.run(run_chat(options))
    except ChatError as error:
        print(f"ballet-planner chat: {terminal_safe(str(error))}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, without a traceback at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
