"""Every RPC of the planner maps to HTTP (AIP-127; decision 0302), so Core can put a
gRPC-JSON transcoder in front of it.

The annotations are read from the generated descriptors, as a transcoder reads them:
each RPC has exactly one ``google.api.http`` rule under ``/api/v1/planner``; its path
variables name fields of the request (a dotted path into a message for UpdateSession);
the paths follow the resources (``sessions/{session_id}``,
``.../turns/{turn_id}``, ``.../messages``), custom methods are ``:verb`` suffixes
(AIP-136); a body is ``*`` or a field of the request, and reads have none.
"""

from __future__ import annotations

import re

import pytest
from ballet.planner.v1 import planner_service_pb2
from google.api import annotations_pb2, http_pb2
from google.protobuf.descriptor import Descriptor, MethodDescriptor

SERVICE = planner_service_pb2.DESCRIPTOR.services_by_name["PlannerService"]
PREFIX = "/api/v1/planner"
#: A collection, then a resource id variable, alternating (AIP-122), then an optional
#: custom verb (AIP-136).
PATH = re.compile(
    r"^/api/v1/planner(:[a-z][A-Za-z]*|(/sessions(/\{[a-z_.]+\}(/(messages|turns(/\{[a-z_]+\})?))?)?)"
    r"(:[a-z][A-Za-z]*)?)$"
)
VERBS = ("get", "put", "post", "delete", "patch")


def rule(method: MethodDescriptor) -> http_pb2.HttpRule:
    options = method.GetOptions()
    assert options.HasExtension(annotations_pb2.http), f"{method.name} has no HTTP rule"
    found: http_pb2.HttpRule = options.Extensions[annotations_pb2.http]
    return found


def verb_and_path(found: http_pb2.HttpRule) -> tuple[str, str]:
    verb = found.WhichOneof("pattern")
    assert verb in VERBS
    path: str = getattr(found, verb)
    return verb, path


def field_path_exists(message: Descriptor, dotted: str) -> bool:
    for part in dotted.split("."):
        field = message.fields_by_name.get(part)
        if field is None:
            return False
        if field.message_type is not None:
            message = field.message_type
    return True


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_every_rpc_has_one_http_rule_whose_path_follows_the_resources(
    method: MethodDescriptor,
) -> None:
    found = rule(method)
    verb, path = verb_and_path(found)
    assert not found.additional_bindings
    assert path.startswith(PREFIX), path
    assert PATH.match(path), f"{method.name}: {path} does not follow the resource names"
    for variable in re.findall(r"\{([^}]+)\}", path):
        assert field_path_exists(method.input_type, variable), f"{method.name}: {variable}"
    if verb in ("get", "delete"):
        assert not found.body, f"{method.name}: a {verb} has no body"
    elif found.body != "*":
        assert found.body in method.input_type.fields_by_name


def test_the_session_read_is_the_seeds_address() -> None:
    verb, path = verb_and_path(rule(SERVICE.methods_by_name["GetSession"]))
    assert (verb, path) == ("get", "/api/v1/planner/sessions/{session_id}")


def test_standard_methods_use_their_standard_verbs() -> None:
    verbs = {m.name: verb_and_path(rule(m))[0] for m in SERVICE.methods}
    assert verbs["CreateSession"] == "post" and verbs["ListSessions"] == "get"
    assert verbs["UpdateSession"] == "patch" and verbs["DeleteSession"] == "delete"
    assert verbs["GetTurn"] == "get" and verbs["ListMessages"] == "get"
    paths = {m.name: verb_and_path(rule(m))[1] for m in SERVICE.methods}
    assert paths["CancelTurn"].endswith("/turns/{turn_id}:cancel")
    assert paths["SendMessage"].endswith("/sessions/{session_id}:sendMessage")
