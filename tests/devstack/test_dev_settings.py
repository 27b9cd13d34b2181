"""``ballet-planner dev``'s settings (devstack/dev.py; README.md): the
file and the environment apply, dev overrides only the data directory, the planner's
address, the database and the dependency addresses; with ``--provider openai``,
``BALLET_OPENAI_MODEL`` becomes ``planner.model``."""

from __future__ import annotations

from pathlib import Path

import pytest
from ballet.llm.v1 import gateway_pb2

from ballet_common.addresses import split_host_port
from devstack.demo.project import GLOBEX_PROJECT_ID
from devstack.dev import OPENAI_MODEL_VARIABLE, DevOptions, dev_settings
from devstack.gateway import openai_provider
from devstack.store.access import describe_users
from service.config import ConfigError, channels, load_settings


def test_the_environment_applies_and_dev_points_every_dependency_at_the_devstack() -> None:
    environ = {
        "BALLET_PLANNER__PLANNER__MAX_ROUNDS": "3",
        "BALLET_PLANNER__PLANNER__COMPACT_AT_TOKENS": "2000",
        "BALLET_PLANNER__DEPENDENCIES__TRACKER__ADDRESS": "tracker.example:443",
        "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:6000",
    }
    settings = dev_settings(
        DevOptions(data_dir=Path("state"), devstack_address="127.0.0.1:7000"), environ
    )
    assert (settings.planner.max_rounds, settings.planner.compact_at_tokens) == (3, 2000)
    assert settings.server.address == "127.0.0.1:6000"
    assert settings.data_dir == Path("state")
    assert settings.database.url.endswith("/state/planner.db")
    assert {channel.address for _, channel in channels(settings.dependencies)} == {"127.0.0.1:7000"}


def test_command_line_options_win_over_the_environment() -> None:
    environ = {
        "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:6000",
        "BALLET_PLANNER__DATA_DIR": "elsewhere",
    }
    options = DevOptions(
        data_dir=Path("state"),
        address="127.0.0.1:0",
        database_url="postgresql+psycopg://localhost/dev",
    )
    settings = dev_settings(options, environ)
    assert settings.server.address == "127.0.0.1:0"
    assert settings.data_dir == Path("state")
    assert settings.database.url == "postgresql+psycopg://localhost/dev"


def test_the_openai_model_becomes_the_planners_model() -> None:
    assert OPENAI_MODEL_VARIABLE == openai_provider.ENV_MODEL
    environ = {OPENAI_MODEL_VARIABLE: "qwen2.5:7b"}
    assert dev_settings(DevOptions(provider="openai"), environ).planner.model == "qwen2.5:7b"
    default = dev_settings(DevOptions(provider="openai"), {}).planner.model
    assert default == load_settings(None, {}).planner.model


def test_the_scripted_model_is_asked_for_by_its_name() -> None:
    # The model line of the chat names what answers, not the planner's default model.
    environ = {OPENAI_MODEL_VARIABLE: "qwen2.5:7b"}
    assert dev_settings(DevOptions(provider="scripted"), environ).planner.model == "scripted demo"
    scenario = DevOptions(scenario=Path("rules.json"))
    assert dev_settings(scenario, {}).planner.model == "scripted (rules.json)"


def test_the_project_is_demo_without_a_tracker_file() -> None:
    assert DevOptions(project_id="beads").project == "demo"
    assert DevOptions(tracker_file=Path("x.jsonl"), project_id="beads").project == "beads"


async def test_the_scripted_provider_names_itself_as_the_model_that_answered(
    tmp_path: Path,
) -> None:
    """With ``serve`` and a devstack of its own the planner asks for its configured model
    (``gpt-4o-mini`` by default); the scripted provider says on each finish that it
    answered (``Finish.model``), as a real server names its model, so the chat shows
    ``(answered by scripted demo)`` rather than the configured name alone."""
    from devstack.gateway.base import FinishChunk
    from devstack.model import make_provider

    request = gateway_pb2.GenerateRequest(
        model="gpt-4o-mini",
        purpose=gateway_pb2.PURPOSE_TURN,
        messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, text="hello")],
    )
    demo, _ = make_provider("scripted")
    chunks = [chunk async for chunk in demo.generate(request)]
    assert isinstance(chunks[-1], FinishChunk) and chunks[-1].model == "scripted demo"
    scenario = tmp_path / "mine.json"
    scenario.write_text('{"rules": [{"reply": {"text": "Hi."}}]}')
    mine, _ = make_provider("scripted", scenario)
    chunks = [chunk async for chunk in mine.generate(request)]
    assert isinstance(chunks[-1], FinishChunk) and chunks[-1].model == "scripted (mine.json)"


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:99999", "foo", "localhost:abc"])
def test_a_devstack_address_that_is_not_host_port_is_refused_by_its_flag(address: str) -> None:
    # Checked before anything binds or dials it: not "is not a loopback address" for a
    # missing port, nor a port beyond 65535 wrapped by the bind.
    with pytest.raises(ConfigError, match=r"^--devstack-address: expected host:port"):
        dev_settings(DevOptions(devstack_address=address), {})


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:50051", ("::1", 50051))],
)
def test_host_port_is_read_once_for_every_binder(address: str, expected: tuple[str, int]) -> None:
    assert split_host_port(address) == expected


def test_the_banner_names_the_project_of_an_organization_it_does_not_chat_about() -> None:
    # Found by a new-user trial: carol's organization was listed, her project nowhere.
    lines = describe_users({"globex": GLOBEX_PROJECT_ID})
    assert lines[0].startswith("organization acme: alice (all five permissions)")
    assert lines[1] == "organization globex, project globex-ops: carol (all five permissions)"
