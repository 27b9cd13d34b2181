"""The devstack's LLM gateway checks the planner's credential like a production gateway: only a
token of the service-token issuer for the gateway's audience alone, whose subject is the planner,
gets a model call; everything else is refused before the provider is asked, and the refusal is not
metered."""

from __future__ import annotations

import grpc
import pytest

from ballet_common.tokens import (
    GATEWAY_AUDIENCE,
    PLANNER_SERVICE_SUBJECT,
    TRACKER_AUDIENCE,
    mint_dev_service_token,
    mint_dev_token,
)
from devstack.gateway import ScriptedProvider
from tests.devstack.gateway_support import PLANNER_METADATA, SECRET, StartGateway, human, request


def credential(token: str) -> tuple[tuple[str, str], ...]:
    return (("x-ballet-service-authorization", f"Bearer {token}"),)


def service(subject: str = PLANNER_SERVICE_SUBJECT, *audiences: str, secret: bytes = SECRET) -> str:
    return mint_dev_service_token(secret, subject, audiences=audiences or (GATEWAY_AUDIENCE,))


REFUSED = {
    "none": ((), grpc.StatusCode.UNAUTHENTICATED, "SERVICE_CREDENTIAL_MISSING"),
    "another dependency's (the tracker's)": (
        credential(service(PLANNER_SERVICE_SUBJECT, TRACKER_AUDIENCE)),
        grpc.StatusCode.UNAUTHENTICATED,
        "SERVICE_CREDENTIAL_INVALID",
    ),
    "one for several audiences": (
        credential(service(PLANNER_SERVICE_SUBJECT, GATEWAY_AUDIENCE, TRACKER_AUDIENCE)),
        grpc.StatusCode.UNAUTHENTICATED,
        "SERVICE_CREDENTIAL_INVALID",
    ),
    "a human's token naming the planner": (
        credential(
            mint_dev_token(SECRET, PLANNER_SERVICE_SUBJECT, audiences=(GATEWAY_AUDIENCE,))
        ),
        grpc.StatusCode.UNAUTHENTICATED,
        "SERVICE_CREDENTIAL_INVALID",
    ),
    "signed with another key": (
        credential(service(secret=b"not-the-gateway-trust-0123456789abcdef")),
        grpc.StatusCode.UNAUTHENTICATED,
        "SERVICE_CREDENTIAL_INVALID",
    ),
    "another service's": (
        credential(service("service:reports")),
        grpc.StatusCode.PERMISSION_DENIED,
        "PLANNER_REQUIRED",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_only_the_planners_gateway_credential_gets_a_model_call(
    start_gateway: StartGateway, case: str
) -> None:
    provider = ScriptedProvider({"rules": [{"reply": {"text": "hello"}}]})
    gateway = await start_gateway(provider)
    metadata, code, reason = REFUSED[case]
    failure = await gateway.fail(request(human("hi")), metadata=metadata)
    assert (failure.code, failure.error_info.reason) == (code, reason)
    assert failure.error_info.domain == "llm.ballet"
    assert failure.responses == []
    assert gateway.servicer.ledger.records == []
    answer = await gateway.generate(request(human("hi")), metadata=PLANNER_METADATA)
    assert answer.text == "hello"
    assert len(gateway.servicer.ledger.records) == 1
