"""A client that gave up is logged below ERROR (decision 0313): grpc.aio's
"ExecuteBatchError raised in core by servicer method", which it logs at ERROR when a
unary RPC's answer cannot be sent because its caller left, goes to DEBUG."""

from __future__ import annotations

import logging

import pytest

from service.server.logs import CLIENT_GONE_PREFIX, GRPC_CORE_LOGGER, quiet_clients_gone


def test_a_client_gone_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    quiet_clients_gone()
    quiet_clients_gone()  # once is enough; twice adds nothing
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    with caplog.at_level(logging.INFO):
        try:
            raise RuntimeError("Failed grpc_call_start_batch")
        except RuntimeError:
            logger.exception(f"{CLIENT_GONE_PREFIX} [/ballet.planner.v1.PlannerService/GetSession]")
        logger.error("Unexpected [ValueError] raised by servicer method [/x]")
    assert [(r.levelname, r.getMessage()[:10]) for r in caplog.records] == [
        ("ERROR", "Unexpected")
    ]
    with caplog.at_level(logging.DEBUG, logger=GRPC_CORE_LOGGER):
        caplog.clear()
        logger.error(f"{CLIENT_GONE_PREFIX} [/x]")
    assert [r.levelname for r in caplog.records] == ["DEBUG"]
