"""One project cache for the process: the session access checks and the turns' prompts
read a human's project through the same ``ProjectDirectory``, so one tracker call serves
both (``service/core/projects.py``)."""

from __future__ import annotations

import pytest

from service.core.errors import NotFound
from service.core.ports import Acting, SkillDocument
from service.core.projects import ProjectDirectory
from service.core.sessions import Caller, ProjectAccess
from service.core.tools import declarations
from service.core.turn.prompt import PromptSource
from tests.unit.fakes import FakeBackends, FakeClock
from tests.unit.session_fakes import FakeTracker

ALICE = Caller("alice", "acme", token="alice-token")
SKILL = SkillDocument("planning", "1.2.0", "# Plan\nSmall steps.")


class World:
    def __init__(self, *, skill: SkillDocument | None = None, cache_s: float = 60.0) -> None:
        self.backends = FakeBackends(skill=skill)
        self.clock = FakeClock()
        self.directory = ProjectDirectory(self.backends, self.clock, cache_s=cache_s)
        self.access = ProjectAccess(self.directory)
        self.prompts = PromptSource(self.directory, model="m", declarations=declarations())

    async def prompt(self, caller: Caller = ALICE, project_id: str = "demo") -> str:
        return (await self.prompts.prompt(caller.acting("s1"), project_id)).context


async def test_one_lookup_serves_the_access_check_and_the_prompt() -> None:
    world = World()
    checked = await world.access.check(ALICE, "demo", "s1")
    prompt = await world.prompts.prompt(ALICE.acting("s1"), "demo")
    assert world.backends.project_reads == 1
    assert prompt.project == checked


async def test_one_lookup_serves_the_prompt_then_the_access_check() -> None:
    world = World(skill=SKILL)
    await world.prompt()
    await world.prompt()
    await world.access.check(ALICE, "demo")
    assert (world.backends.project_reads, world.backends.skill_reads) == (1, 1)


async def test_answers_expire_on_the_injected_clock() -> None:
    world = World(skill=SKILL, cache_s=30.0)
    await world.prompt()
    world.clock.advance(29.0)
    await world.access.check(ALICE, "demo")
    assert world.backends.project_reads == 1
    world.clock.advance(2.0)
    await world.access.check(ALICE, "demo")
    await world.prompt()
    assert (world.backends.project_reads, world.backends.skill_reads) == (2, 2)


async def test_no_answer_is_kept_longer_than_sixty_seconds() -> None:
    world = World(cache_s=3600.0)
    await world.access.check(ALICE, "demo")
    world.clock.advance(61.0)
    await world.access.check(ALICE, "demo")
    assert world.backends.project_reads == 2


async def test_answers_are_kept_per_organization_and_human() -> None:
    world = World()
    await world.access.check(ALICE, "demo")
    await world.access.check(Caller("bob", "acme", token="bob-token"), "demo")
    other_org = Acting(human_id="alice", organization_id="globex", token="t", session_id="")
    await world.directory.project(other_org, "demo")
    assert world.backends.project_reads == 3


async def test_refusals_are_not_kept() -> None:
    tracker = FakeTracker()
    access = ProjectAccess(ProjectDirectory(tracker, FakeClock()))  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        await access.check(ALICE, "demo")
    tracker.allow("alice", "demo")
    await access.check(ALICE, "demo")  # the new permission works at once
    await access.check(ALICE, "demo")
    assert len(tracker.calls) == 2


async def test_a_zero_cache_asks_every_time() -> None:
    world = World(cache_s=0.0)
    await world.access.check(ALICE, "demo")
    await world.prompt()
    assert world.backends.project_reads == 2


async def test_the_rendered_prompt_is_kept_with_the_answers_it_derives_from() -> None:
    """Decision 0342: a prompt is rendered and estimated once per answer of the directory;
    a new answer (the entry expired and was read again) renders it again, and each human's
    entry has its own."""
    world = World(skill=SKILL, cache_s=30.0)
    acting = ALICE.acting("s1")
    first = await world.prompts.prompt(acting, "demo")
    assert await world.prompts.prompt(ALICE.acting("s2"), "demo") is first
    world.clock.advance(31.0)
    again = await world.prompts.prompt(acting, "demo")
    assert again is not first and again == first
    bob = await world.prompts.prompt(Caller("bob", "acme", token="bob-token").acting("s3"), "demo")
    assert bob is not again


async def test_kept_prompts_are_bounded() -> None:
    world = World()
    world.prompts = PromptSource(
        world.directory, model="m", declarations=declarations(), max_built=2
    )
    firsts = [await world.prompts.prompt(ALICE.acting("s"), p) for p in ("a", "b", "c")]
    assert await world.prompts.prompt(ALICE.acting("s"), "c") is firsts[2]
    assert await world.prompts.prompt(ALICE.acting("s"), "a") is not firsts[0]
