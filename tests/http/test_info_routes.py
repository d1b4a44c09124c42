"""/v1/models lists each model once, its other names in `aliases`; any name is still described.

Served by the real uvicorn test server (tests.helpers.api_helpers) with the real SmolLM2 runtime,
read with the official `openai` and `anthropic` clients as coding assistants read them.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.helpers.api_helpers import MODEL_ID, api_server  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def client(api_server):  # noqa: F811
    return openai.OpenAI(base_url=api_server.v1, api_key="unused", max_retries=0)


def test_models_lists_the_model_once_with_its_aliases(api_server, client):  # noqa: F811
    listing = client.models.list()
    assert [m.id for m in listing.data] == [MODEL_ID]
    assert listing.data[0].model_extra["aliases"] == ["smollm2"]
    assert listing.data[0].model_extra["context_length"] == api_server.runtime.context_length
    raw = httpx.get(api_server.url + "/v1/models").json()
    assert raw["first_id"] == raw["last_id"] == MODEL_ID
    cards = {card["slug"]: card for card in raw["models"]}  # Codex: every name keeps a card, one is listed
    assert cards[MODEL_ID]["visibility"] == "list" and cards["smollm2"]["visibility"] == "hide"
    for name in ("smollm2", "claude-sonnet-4-5"):  # still any name is described (assistants send their own)
        model = client.models.retrieve(name)
        assert model.id == name and model.model_extra["display_name"] == MODEL_ID


def test_anthropic_client_sees_one_model(api_server):  # noqa: F811
    claude = anthropic.Anthropic(base_url=api_server.url, api_key="unused", max_retries=0)
    page = claude.models.list()
    assert [m.id for m in page.data] == [MODEL_ID] and page.data[0].display_name == MODEL_ID
