"""An answer the human saw is kept (decisions 0311 and 0315): the database goes silent
(DROP rules, both replicas cut) while the answer streams, and stays silent well past the
end of the answer and the unit deadline. Nobody else ends the turn (the lease is long),
so once the hole heals the owner stores the answer it streamed and the turn ends
``COMPLETED``: every delta the client saw is in the transcript.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from ballet.planner.v1 import resources_pb2 as res

from tests.faults.rigs import silent_rig
from tests.replicas.support import END, ChatStream

pytestmark = pytest.mark.postgres

TEXT = "Here is the plan, one short piece at a time, for you."
SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human"},
            "reply": {"text": TEXT, "chunk_chars": 4, "delay_ms": 100},
        }
    ]
}
#: Far longer than the answer (about 1.4 s) and the unit deadline (3 s).
HOLE_S = 12.0


async def test_an_answer_streamed_in_a_hole_is_in_the_transcript_after_it(
    tmp_path: Path,
) -> None:
    # No takeover during the hole: the turn is still this replica's when it heals.
    async with silent_rig(
        tmp_path, SCENARIO, planner={"lease_s": 120.0, "sweep_interval_s": 1.0}
    ) as (r, net):
        session_id = await r.a.create_session(r.alice, "create-kept")
        stream = await ChatStream.opened_on(r.a, r.alice, session_id)
        turn_id = await stream.accepted("tell me", "m1")
        await stream.wait_kind("text_delta")
        net.silence()
        opened = time.monotonic()
        # The whole answer reaches the client through the hole.
        await stream.wait_for(
            lambda got: (
                "".join(x.response.text_delta.text for x in got if x.kind == "text_delta") == TEXT
            ),
            timeout_s=10,
        )
        await asyncio.sleep(max(0.0, HOLE_S - (time.monotonic() - opened)))
        net.heal()
        ended = await stream.turn_ended(turn_id, timeout_s=15)
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        messages = await r.a.messages(r.alice, session_id)
        answers = [m.text for m in messages if m.kind == res.MESSAGE_KIND_ASSISTANT]
        assert answers == [TEXT]
        await stream.close()
