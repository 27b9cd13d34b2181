"""The model behind the devstack's LLM gateway, chosen on the command line (README.md and
devstack/gateway/scripted.py).

Both ``ballet-planner dev`` and the standalone ``python -m devstack`` take
``--provider scripted|openai`` and ``--scenario FILE``; ``make_provider`` turns them into
a ``Provider`` and a one-line description for the banner. Nothing here imports the
planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from devstack.gateway import Provider, ScenarioError
from devstack.gateway.scripted import Scenario, ScriptedProvider, demo_scenario_path

ProviderName = Literal["scripted", "openai"]
PROVIDERS: tuple[ProviderName, ...] = ("scripted", "openai")
#: The variable naming the openai provider's default model
#: (devstack/gateway/openai_provider.py); ``dev`` makes it ``planner.model`` too.
OPENAI_MODEL_VARIABLE = "BALLET_OPENAI_MODEL"
PROVIDER_HELP = (
    "the model: scripted (default) or openai (BALLET_OPENAI_BASE_URL, "
    "BALLET_OPENAI_API_KEY, BALLET_OPENAI_MODEL)"
)
SCENARIO_HELP = "scripted scenario JSON (default: the built-in demo)"


class ProviderSetupError(ValueError):
    """The provider cannot be made; the message names the option or variable."""


#: The model name the planner names for its turns when the built-in demo scenario answers.
SCRIPTED_DEMO_MODEL = "scripted demo"


def scripted_model_name(scenario: Path | None) -> str:
    """The model name of the scripted provider: ``scripted demo`` for the built-in
    scenario, ``scripted (FILE)`` for ``--scenario FILE``. ``dev`` asks the gateway for
    it, so the planner's turns (and the chat's model line) name what answers."""
    return SCRIPTED_DEMO_MODEL if scenario is None else f"scripted ({scenario.name})"


def make_provider(
    provider: ProviderName,
    scenario: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Provider, str]:
    """The model provider and a one-line description of it.

    - ``scripted``: over ``scenario`` (re-read when it changes), or the built-in demo
      scenario (loaded once: it never changes, and a reinstall of the package while the
      devstack runs would otherwise fail every call on the vanished file);
    - ``openai``: from the ``BALLET_OPENAI_*`` variables of ``environ`` (default: the
      process's); the SDK is imported only then (it takes most of a second).

    Raises ``ProviderSetupError`` for a scenario file that is missing or invalid, a
    scenario given with ``openai``, and ``openai`` settings that are missing or invalid
    (naming the variable).
    """
    if provider == "openai":
        if scenario is not None:
            raise ProviderSetupError("--scenario is for --provider scripted")
        from devstack.gateway.openai_provider import ConfigError as OpenAIConfigError
        from devstack.gateway.openai_provider import OpenAIConfig, OpenAIProvider

        try:
            config = OpenAIConfig.from_env(environ)
        except OpenAIConfigError as error:
            raise ProviderSetupError(f"--provider openai: {error}") from error
        model = config.model or "the planner's planner.model"
        return OpenAIProvider.from_config(config), f"openai at {config.base_url} ({model})"
    try:
        if scenario is not None:
            scripted = ScriptedProvider.from_file(scenario, name=scripted_model_name(scenario))
            return scripted, f"scripted, scenario {scenario} (re-read when it changes)"
        demo = ScriptedProvider(Scenario.load(demo_scenario_path()), name=scripted_model_name(None))
        return demo, "scripted, the built-in demo scenario (--provider openai for a real model)"
    except ScenarioError as error:
        raise ProviderSetupError(f"--scenario: {error}") from error
