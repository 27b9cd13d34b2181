"""The planner's configuration: one frozen ``Settings`` loaded once at start-up from
defaults, a TOML file and ``BALLET_PLANNER__*`` environment variables
(``settings``), and the typed loading of tables into frozen dataclasses (``loading``)."""

from service.config.settings import (
    DEFAULT_SUMMARY_INSTRUCTIONS as DEFAULT_SUMMARY_INSTRUCTIONS,
)
from service.config.settings import (
    DEVSTACK_ADDRESS as DEVSTACK_ADDRESS,
)
from service.config.settings import (
    ENV_PREFIX as ENV_PREFIX,
)
from service.config.settings import (
    ROUND_ANSWER_TOKENS as ROUND_ANSWER_TOKENS,
)
from service.config.settings import (
    SHUTDOWN_OVERHEAD_S as SHUTDOWN_OVERHEAD_S,
)
from service.config.settings import (
    AuthSettings as AuthSettings,
)
from service.config.settings import (
    ChannelSettings as ChannelSettings,
)
from service.config.settings import (
    ConfigError as ConfigError,
)
from service.config.settings import (
    DatabaseSettings as DatabaseSettings,
)
from service.config.settings import (
    DependenciesSettings as DependenciesSettings,
)
from service.config.settings import (
    LimitsSettings as LimitsSettings,
)
from service.config.settings import (
    LoggingSettings as LoggingSettings,
)
from service.config.settings import (
    PlannerSettings as PlannerSettings,
)
from service.config.settings import (
    RetentionSettings as RetentionSettings,
)
from service.config.settings import (
    ServerSettings as ServerSettings,
)
from service.config.settings import (
    Settings as Settings,
)
from service.config.settings import (
    channels as channels,
)
from service.config.settings import (
    check_context_budget as check_context_budget,
)
from service.config.settings import (
    is_loopback as is_loopback,
)
from service.config.settings import (
    iter_keys as iter_keys,
)
from service.config.settings import (
    load_settings as load_settings,
)
from service.config.settings import (
    split_address as split_address,
)
from service.config.settings import (
    validate as validate,
)
