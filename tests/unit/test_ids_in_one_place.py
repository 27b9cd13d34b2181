"""Every id the planner mints comes from ``service/core/ids.py``: nothing else under
``service/`` draws random ids (``uuid``, ``secrets.token_*``) or builds a kind's prefix
(``turn_``, ``msg_``, ...) by hand, so the formats stay the two that module documents.

Random bytes that are not ids are named below with what they are.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import service
from service.core import ids

SERVICE = Path(service.__file__).parent
IDS_MODULE = Path(ids.__file__)
#: Random values that are not ids of the planner's records, and why they are drawn there.
NOT_IDS = {
    SERVICE / "server" / "page_keys.py": "the page-token signing key (key material)",
    SERVICE / "config" / "settings.py": "the default replica name's suffix "
    "(configuration imports nothing of the core)",
}
KIND_PREFIX = re.compile(r"(turn|ses|session|msg|call|gen|stream|chat)[_-]")


def hand_minted(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every id drawn or prefixed outside ``ids.py`` in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, "import uuid") for a in node.names if a.name == "uuid"]
        elif isinstance(node, ast.ImportFrom) and node.module == "uuid":
            found.append((node.lineno, "from uuid import ..."))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "secrets"
            and node.attr.startswith("token_")
        ):
            found.append((node.lineno, f"secrets.{node.attr}"))
        elif isinstance(node, ast.JoinedStr) and len(node.values) > 1:
            head, rest = node.values[0], node.values[1]
            if (
                isinstance(head, ast.Constant)
                and KIND_PREFIX.fullmatch(str(head.value))
                and isinstance(rest, ast.FormattedValue)
            ):
                found.append((node.lineno, f"an id prefix built by hand: {ast.unparse(node)}"))
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Add)
            and isinstance(node.left, ast.Constant)
            and KIND_PREFIX.fullmatch(str(node.left.value))
        ):
            found.append((node.lineno, f"an id prefix built by hand: {ast.unparse(node)}"))
    return found


def test_ids_are_minted_only_in_the_ids_module() -> None:
    found = [
        f"{path.relative_to(SERVICE.parent)}:{line}: {what}"
        for path in sorted(SERVICE.rglob("*.py"))
        if path != IDS_MODULE
        for line, what in hand_minted(path.read_text())
        if not (path in NOT_IDS and what.startswith("secrets."))
    ]
    assert found == [], "mint ids with service/core/ids.py instead:\n" + "\n".join(found)


def test_the_exceptions_still_draw_their_random_values() -> None:
    # An entry that no longer draws anything is stale: drop it.
    for path in NOT_IDS:
        assert any(what.startswith("secrets.") for _, what in hand_minted(path.read_text()))


def test_the_check_sees_each_kind_of_hand_minting() -> None:
    source = (
        "import uuid\nfrom uuid import uuid4\nimport secrets\n"
        "a = secrets.token_hex(8)\nb = f'turn_{a}'\nc = 'chat-' + a\nd = f'turn_id={a}'\n"
    )
    assert sorted(line for line, _ in hand_minted(source)) == [1, 2, 4, 5, 6]


def test_the_formats() -> None:
    assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", ids.new_session_id())
    for mint, kind in [
        (ids.new_turn_id, "turn"),
        (ids.new_message_id, "msg"),
        (ids.new_call_id, "call"),
        (ids.new_model_request_id, "gen"),
        (ids.new_stream_id, "stream"),
        (ids.new_chat_request_id, "chat"),
    ]:
        assert re.fullmatch(kind + r"_[0-9a-f]{32}", mint())
    assert ids.new_turn_id() != ids.new_turn_id()
