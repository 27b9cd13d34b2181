"""Identity from the settings: who may call the planner, how the planner proves itself,
and the keys of its page tokens. Built once at start-up by the composition root.

- ``token_verifier``: Core's human issuer and the service-token issuer, each with its own
  ``iss`` values and keys (docs/spec/authority.md and docs/decisions/0150-service-principals.md).
- ``service_credentials``: one credential per dependency audience (``service.server.credentials``;
  docs/decisions/0153-one-credential-per-audience.md).
- ``page_token_keys``: the HMAC keys of page tokens (``service.server.page_keys``;
  docs/decisions/0152-authenticated-page-tokens.md).

Each raises ``ConfigError`` naming the key when what it names cannot be used.
"""

from __future__ import annotations

from ballet_common.tokens import (
    DEV_ISSUER,
    DEV_SERVICE_ISSUER,
    DEV_SERVICE_KID,
    PLANNER_AUDIENCE,
    Issuer,
    KeySet,
    TokenVerifier,
    dev_secret,
    dev_service_key,
)
from service.config import ConfigError, Settings, channels
from service.server.credentials import ServiceCredentials
from service.server.page_keys import PageTokenKeys


def token_verifier(settings: Settings) -> TokenVerifier:
    """The verifier of PlannerService calls (audience ``ballet-planner``).

    Dev mode (no ``auth.jwks_path``): humans signed with the dev secret of ``data_dir``
    (generated if absent), services with the key derived from it; the ``iss`` values are
    the dev ones unless ``auth.issuers``/``auth.service_issuers`` name others.
    Production: ``auth.jwks_path`` for ``auth.issuers``, and, when
    ``auth.service_issuers`` is set, ``auth.service_jwks_path`` (default: the same file)
    for them; without service issuers no service principal is accepted.
    """
    auth = settings.auth
    services: Issuer | None = None
    if auth.jwks_path is None:
        secret = dev_secret(settings.data_dir)
        humans = Issuer(auth.issuers or (DEV_ISSUER,), KeySet.dev(secret))
        services = Issuer(
            auth.service_issuers or (DEV_SERVICE_ISSUER,),
            KeySet.dev(dev_service_key(secret), DEV_SERVICE_KID),
            service=True,
        )
    else:
        service_jwks = auth.service_jwks_path or auth.jwks_path
        for key, path in (("jwks_path", auth.jwks_path), ("service_jwks_path", service_jwks)):
            if not path.is_file():
                raise ConfigError(f"auth.{key}: {path} is not a readable file")
        humans = Issuer(auth.issuers, KeySet(jwks_path=auth.jwks_path))
        if auth.service_issuers:
            services = Issuer(auth.service_issuers, KeySet(jwks_path=service_jwks), service=True)
    issuers = [humans] if services is None else [humans, services]
    return TokenVerifier(issuers, audience=PLANNER_AUDIENCE, leeway_s=auth.leeway_s)


def service_credentials(settings: Settings) -> ServiceCredentials:
    """The planner's credential for each dependency: its
    ``dependencies.<name>.service_token_file``, else (dev mode) minted from the dev
    secret, else (production, checked by ``config.validate``) the channel's client
    certificate."""
    files = {name: channel.service_token_file for name, channel in channels(settings.dependencies)}
    for name, path in files.items():
        if path is not None and not path.is_file():
            raise ConfigError(f"dependencies.{name}.service_token_file: {path} is not a file")
    secret = dev_secret(settings.data_dir) if settings.dev_mode else None
    try:
        return ServiceCredentials.build(files, secret)
    except (OSError, ValueError) as error:
        raise ConfigError(f"dependencies: a service_token_file cannot be used: {error}") from error


def page_token_keys(settings: Settings) -> PageTokenKeys:
    """``auth.page_token_key_file``, or in dev mode the key generated in ``data_dir``."""
    path = settings.auth.page_token_key_file
    try:
        if path is None:
            return PageTokenKeys.dev(settings.data_dir)
        return PageTokenKeys.load(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"auth.page_token_key_file: {error}") from error
