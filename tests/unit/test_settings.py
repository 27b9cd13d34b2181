"""Configuration: defaults, the TOML file, environment overrides, errors naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from service.config import (
    ConfigError,
    Settings,
    is_loopback,
    iter_keys,
    load_settings,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def load(
    env: dict[str, str] | None = None, toml: str | None = None, tmp: Path | None = None
) -> Settings:
    path = None
    if toml is not None:
        assert tmp is not None
        path = tmp / "planner.toml"
        path.write_text(toml)
    return load_settings(path, env or {})


def error_of(
    env: dict[str, str] | None = None, toml: str | None = None, tmp: Path | None = None
) -> str:
    with pytest.raises(ConfigError) as caught:
        load(env, toml, tmp)
    return str(caught.value)


def test_defaults_work_for_dev() -> None:
    settings = load()
    assert settings.dev_mode
    assert settings.server.address == "127.0.0.1:50051"
    assert settings.server.metrics_address == "127.0.0.1:9464"
    assert settings.data_dir == Path(".ballet-dev")
    assert settings.database.url.startswith("sqlite+aiosqlite:///")
    assert settings.database.url.endswith("/.ballet-dev/planner.db")
    assert settings.server.replica_id and " " not in settings.server.replica_id
    assert settings.dependencies.tracker.address == "127.0.0.1:50052"
    assert (
        settings.dependencies.gateway.max_message_bytes
        > settings.dependencies.tracker.max_message_bytes
    )
    assert settings.limits.message_max_bytes == 32 * 1024
    assert (settings.limits.turns_per_human, settings.limits.streams_per_human) == (4, 16)
    assert settings.planner.max_replay_events == 1000
    assert settings.planner.max_writes_per_turn == 5
    assert settings.planner.cancel_grace == 5.0
    assert settings.planner.turn_timeout == 600.0
    assert (settings.planner.tool_concurrency, settings.planner.max_tool_calls_per_answer) == (
        4,
        16,
    )
    assert settings.server.max_receive_message_bytes == 16 * 1024 * 1024
    assert (settings.server.keepalive_time_s, settings.server.keepalive_timeout_s) == (60, 20)
    assert (settings.server.min_ping_interval_s, settings.server.max_ping_strikes) == (5, 2)
    assert not settings.logging.content_enabled
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.planner.max_rounds = 3  # type: ignore[misc]


def test_two_replicas_get_different_ids() -> None:
    assert load().server.replica_id != load().server.replica_id


def test_environment_overrides_every_level(tmp_path: Path) -> None:
    settings = load(
        {
            "BALLET_PLANNER__PLANNER__MAX_ROUNDS": "3",
            "ballet_planner__server__insecure": "true",
            "BALLET_PLANNER__SERVER__GRACE_S": "7.5",
            "BALLET_PLANNER__DEPENDENCIES__TRACKER__ADDRESS": "tracker.internal:443",
            "BALLET_PLANNER__DEPENDENCIES__TRACKER__TLS": "yes",
            "BALLET_PLANNER__AUTH__ISSUERS": "core-a, core-b",
            "BALLET_PLANNER__DATA_DIR": str(tmp_path),
            "BALLET_PLANNER__DATABASE__URL": "postgresql+psycopg://db/planner",
            "UNRELATED": "ignored",
        }
    )
    assert settings.planner.max_rounds == 3
    assert settings.server.insecure is True
    assert settings.server.grace_s == 7.5
    assert settings.dependencies.tracker.address == "tracker.internal:443"
    assert settings.dependencies.tracker.uses_tls
    assert settings.auth.issuers == ("core-a", "core-b")
    assert settings.data_dir == tmp_path
    assert settings.database.url == "postgresql+psycopg://db/planner"
    assert not settings.database.is_sqlite


def test_the_file_and_the_environment_combine(tmp_path: Path) -> None:
    toml = """
data_dir = "state"
[planner]
max_rounds = 4
model = "my-model"
[dependencies.gateway]
address = "127.0.0.1:6000"
[logging]
level = "DEBUG"
log_content = true
"""
    settings = load({"BALLET_PLANNER__PLANNER__MAX_ROUNDS": "2"}, toml, tmp_path)
    assert settings.planner.max_rounds == 2  # the environment wins
    assert settings.planner.model == "my-model"
    assert settings.dependencies.gateway.address == "127.0.0.1:6000"
    assert settings.data_dir == Path("state")
    assert settings.logging.content_enabled


PARTIAL_OVERRIDES = [
    ("dependencies.gateway.address", "127.0.0.1:7001"),
    ("dependencies.tracker.address", "127.0.0.1:7002"),
    ("dependencies.model_idle_s", 30.0),
    ("planner.max_rounds", 3),
    ("server.grace_s", 9.0),
    ("limits.turns_per_human", 2),
    ("database.pool_size", 3),
    ("auth.leeway_s", 10.0),
    ("logging.level", "DEBUG"),
]
#: Keys resolved at load time rather than defaulted.
RESOLVED = {"server.replica_id", "database.url"}


@pytest.mark.parametrize("source", ["environment", "file"])
@pytest.mark.parametrize(("dotted", "value"), PARTIAL_OVERRIDES)
def test_a_partial_override_of_a_table_keeps_its_other_keys(
    source: str, dotted: str, value: object, tmp_path: Path
) -> None:
    """Every table, nested ones included, starts from its own defaults: setting one key
    of ``[dependencies.gateway]`` once reset the gateway channel's 32 MiB limit to the
    4 MiB of a plain channel."""
    *tables, key = dotted.split(".")
    if source == "environment":
        variable = "BALLET_PLANNER__" + "__".join(part.upper() for part in dotted.split("."))
        settings = load({variable: str(value)}, None, tmp_path)
    else:
        literal = f'"{value}"' if isinstance(value, str) else str(value)
        settings = load({}, f"[{'.'.join(tables)}]\n{key} = {literal}\n", tmp_path)
    expected = Settings()
    for dotted_key, _field in iter_keys():
        if dotted_key in RESOLVED:
            continue
        got: object = settings
        want: object = expected
        for part in dotted_key.split("."):
            got, want = getattr(got, part), getattr(want, part)
        assert got == (value if dotted_key == dotted else want), dotted_key
    assert settings.dependencies.gateway.max_message_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BALLET_PLANNER__PLANNER__MAX_ROUNDS": "0"}, "planner.max_rounds: must be >= 1, got 0"),
        (
            {"BALLET_PLANNER__PLANNER__MAX_ROUNDS": "many"},
            "planner.max_rounds: expected an integer",
        ),
        ({"BALLET_PLANNER__PLANNER__MAX_ROUNDZ": "3"}, "planner.max_roundz: unknown key"),
        ({"BALLET_PLANNER__PLANNERS__MAX_ROUNDS": "3"}, "planners.max_rounds: unknown key"),
        ({"BALLET_PLANNER__PLANNER": "3"}, "planner: is a table"),
        ({"BALLET_PLANNER__SERVER__INSECURE": "maybe"}, "server.insecure: expected true or false"),
        ({"BALLET_PLANNER__AUTH__LEEWAY_S": "61"}, "auth.leeway_s: must be <= 60, got 61"),
        (
            {"BALLET_PLANNER__AUTH__PROJECT_CHECK_CACHE_S": "120"},
            "auth.project_check_cache_s: must be <= 60",
        ),
        ({"BALLET_PLANNER__LOGGING__LEVEL": "LOUD"}, "logging.level: must be one of"),
        ({"BALLET_PLANNER__SERVER__ADDRESS": "nowhere"}, "server.address: expected host:port"),
        (
            {"BALLET_PLANNER__SERVER__REPLICA_ID": "a b"},
            "server.replica_id: must not contain spaces",
        ),
        (
            {"BALLET_PLANNER__PLANNER__MAX_ROUNDS": "100"},
            "planner.compact_at_tokens: 64000 plus planner.max_rounds (100)",
        ),
        ({"BALLET_PLANNER__PLANNER__COMPACT_AT_TOKENS": "127000"}, "planner.compact_at_tokens:"),
        (
            {"BALLET_PLANNER__PLANNER__SWEEP_INTERVAL_S": "30"},
            "planner.sweep_interval_s: must be at most",
        ),
        (
            {"BALLET_PLANNER__DEPENDENCIES__MODEL_FIRST_DELTA_S": "900"},
            "dependencies.model_first_delta_s:",
        ),
        (
            {"BALLET_PLANNER__SERVER__TLS_CERT": "cert.pem"},
            "server.tls_key: tls_cert and tls_key go together",
        ),
        ({"BALLET_PLANNER__DEPENDENCIES__SKILLS__TLS_KEY": "k.pem"}, "dependencies.skills.tls_key"),
        (
            {"BALLET_PLANNER__SERVER__TLS_REQUIRE_CLIENT_CERT": "1"},
            "server.tls_require_client_cert: needs",
        ),
    ],
)
def test_errors_name_the_key(env: dict[str, str], message: str) -> None:
    assert message in error_of(env)


def test_file_errors_name_the_key(tmp_path: Path) -> None:
    assert "planner.max_rounds: must be >= 1, got 0" in error_of(
        toml="[planner]\nmax_rounds = 0\n", tmp=tmp_path
    )
    assert "planner.colour: unknown key" in error_of(toml="[planner]\ncolour = 1\n", tmp=tmp_path)
    assert "bogus: unknown key" in error_of(toml="[bogus]\nx = 1\n", tmp=tmp_path)
    assert "server.grace_s: expected a finite number" in error_of(
        toml='[server]\ngrace_s = "soon"\n', tmp=tmp_path
    )
    assert "auth.issuers: expected a list" in error_of(toml='[auth]\nissuers = "x"\n', tmp=tmp_path)
    assert "planner: must be a table" in error_of(toml="planner = 3\n", tmp=tmp_path)
    assert "not valid TOML" in error_of(toml="[planner\n", tmp=tmp_path)
    (tmp_path / "latin1.toml").write_bytes(b'[planner]\nmodel = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"latin1\.toml: not UTF-8 text \(line 2\)"):
        load_settings(tmp_path / "latin1.toml", {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.toml", {})


def test_dev_mode_refuses_a_non_loopback_address() -> None:
    message = error_of({"BALLET_PLANNER__SERVER__ADDRESS": "0.0.0.0:50051"})
    assert message.startswith("server.address: dev mode")


def test_production_needs_tls_or_insecure_off_loopback(tmp_path: Path) -> None:
    production = {
        "BALLET_PLANNER__AUTH__JWKS_PATH": str(tmp_path / "jwks.json"),
        "BALLET_PLANNER__AUTH__ISSUERS": "ballet-core",
        "BALLET_PLANNER__AUTH__PAGE_TOKEN_KEY_FILE": str(tmp_path / "page-keys"),
        "BALLET_PLANNER__SERVER__ADDRESS": "0.0.0.0:50051",
    }
    for name in ("TRACKER", "SKILLS", "KNOWLEDGE", "GATEWAY"):
        key = f"BALLET_PLANNER__DEPENDENCIES__{name}__SERVICE_TOKEN_FILE"
        production[key] = str(tmp_path / f"{name.lower()}-token")
    assert "server.address: plaintext" in error_of(production)
    settings = load({**production, "BALLET_PLANNER__SERVER__INSECURE": "true"})
    assert not settings.dev_mode
    tls = {
        **production,
        "BALLET_PLANNER__SERVER__TLS_CERT": "c.pem",
        "BALLET_PLANNER__SERVER__TLS_KEY": "k.pem",
    }
    assert load(tls).server.tls_cert == Path("c.pem")
    insecure = {**production, "BALLET_PLANNER__SERVER__INSECURE": "1"}
    no_issuers = {**insecure, "BALLET_PLANNER__AUTH__ISSUERS": ""}
    assert error_of(no_issuers).startswith("auth.issuers: required")
    no_page_keys = {**insecure, "BALLET_PLANNER__AUTH__PAGE_TOKEN_KEY_FILE": ""}
    assert error_of(no_page_keys).startswith("auth.page_token_key_file: required")
    # One credential per dependency: each needs its own token file or client certificate.
    no_credential = {
        **insecure,
        "BALLET_PLANNER__DEPENDENCIES__GATEWAY__SERVICE_TOKEN_FILE": "",
    }
    assert error_of(no_credential).startswith(
        "dependencies.gateway.service_token_file: required"
    )
    with_certificate = {
        **no_credential,
        "BALLET_PLANNER__DEPENDENCIES__GATEWAY__TLS_CERT": "c.pem",
        "BALLET_PLANNER__DEPENDENCIES__GATEWAY__TLS_KEY": "k.pem",
    }
    assert load(with_certificate).dependencies.gateway.service_token_file is None


def test_service_issuers_never_overlap_human_issuers() -> None:
    same = {
        "BALLET_PLANNER__AUTH__ISSUERS": "core, core-services",
        "BALLET_PLANNER__AUTH__SERVICE_ISSUERS": "core-services",
    }
    message = error_of(same)
    assert message.startswith("auth.service_issuers: must differ") and "core-services" in message
    lonely = {"BALLET_PLANNER__AUTH__SERVICE_JWKS_PATH": "services.json"}
    assert error_of(lonely).startswith("auth.service_issuers: required")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.9.9", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("planner.internal", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_every_key_is_documented() -> None:
    text = DOCS.read_text()
    channels = ("tracker", "skills", "knowledge", "gateway")

    def documented_as(key: str) -> str:
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "dependencies" and parts[1] in channels:
            parts[1] = "<name>"
        return ".".join(parts)

    missing = [key for key, _ in iter_keys() if f"`{documented_as(key)}`" not in text]
    assert missing == []


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_number_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^planner\.turn_timeout: expected a finite number"):
        load_settings(None, {"BALLET_PLANNER__PLANNER__TURN_TIMEOUT": value})


@pytest.mark.parametrize(
    "url", ["mysql://host/db", "sqlite:////tmp/planner.db", "postgresql://host/db"]
)
def test_a_database_url_of_another_engine_or_driver_is_refused(url: str) -> None:
    # A plain sqlite:// or postgresql:// names a driver the engine does not take: one
    # line at start, not a traceback from the engine.
    with pytest.raises(ConfigError, match=r"^database\.url: expected a PostgreSQL"):
        load_settings(None, {"BALLET_PLANNER__DATABASE__URL": url})


def test_a_grace_period_that_cannot_hold_the_writes_grace_is_refused() -> None:
    """docs/spec/operations.md and docs/spec/turn-loop.md together (decision 0181): a shutdown gives
    started writes their
    ``planner.cancel_grace`` and still stores every turn's end, so ``server.grace_s``
    must leave room for both; the error names both keys."""
    message = error_of(
        {"BALLET_PLANNER__SERVER__GRACE_S": "6", "BALLET_PLANNER__PLANNER__CANCEL_GRACE": "5"}
    )
    assert message.startswith("server.grace_s: must be at least planner.cancel_grace (5) + 2 s")
    assert "got 6" in message
    settings = load(
        {"BALLET_PLANNER__SERVER__GRACE_S": "3", "BALLET_PLANNER__PLANNER__CANCEL_GRACE": "1"}
    )
    assert (settings.server.grace_s, settings.planner.cancel_grace) == (3.0, 1.0)
