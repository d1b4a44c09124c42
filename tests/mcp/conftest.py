"""The MCP tests' fixtures: a Service on the shared real engine (one per module) and its FastMCP server."""

from __future__ import annotations

import pytest

from agentfold.mcp.server import build_mcp
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service
from tests.helpers.api_helpers import MODEL_ID


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def service(smollm2_engine, tmp_path_factory):
    service = Service(Runtime(smollm2_engine, MODEL_ID), home=tmp_path_factory.mktemp("mcp-home"))
    yield service
    service.close()


@pytest.fixture(scope="module")
def mcp(service):
    return build_mcp(service)
