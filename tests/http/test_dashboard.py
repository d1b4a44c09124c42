"""`/dashboard` against a real server after real turns: the page's data URL resolves (as a browser
resolves it) to JSON with every field the page reads, and, in headless Chromium, the page renders
one row per turn served with no console error."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from urllib.parse import urljoin

import httpx
import openai
import pytest

from agentfold.http.app import build_app
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service
from tests.helpers.api_helpers import MODEL_ID, ServerThread

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0")


@pytest.fixture(scope="module")
def dashboard(smollm2_engine, tmp_path_factory):
    """A served stack after two turns of one session and one without a session header."""
    service = Service(Runtime(smollm2_engine, MODEL_ID, aliases=("smollm2",)), home=tmp_path_factory.mktemp("home"))
    server = ServerThread(build_app(service)).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    first = [{"role": "user", "content": "Name a colour."}]
    for messages, session in ((first, "s-dash"), ([*first, {"role": "assistant", "content": "Blue."},
                                                   {"role": "user", "content": "Another one?"}], "s-dash"),
                              ([{"role": "user", "content": "Say hi."}], None)):
        client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6,
                                       extra_headers={"X-Session-Id": session} if session else None)
    service.telemetry.flush()
    yield service, server
    server.stop()
    service.close()


def data_url(page_url: str, page: str) -> str:
    """The JSON URL the page fetches, resolved against the page's own URL as a browser does."""
    paths = re.findall(r"""["']([^"'\s]*\.json)["']""", page)
    assert len(set(paths)) == 1, paths
    return urljoin(page_url, paths[0])


def test_the_page_data_url_resolves_to_what_the_page_reads(dashboard, smollm2_engine):
    service, server = dashboard
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "http://" not in page.text and "https://" not in page.text
    response = httpx.get(data_url(server.url + "/dashboard", page.text))
    assert response.status_code == 200, response.text
    data = response.json()
    rows = service.telemetry.list_turns(limit=200)
    assert [t["turn_id"] for t in data["turns"]] == [r["turn_id"] for r in reversed(rows)] and len(rows) == 3
    for name in set(re.findall(r"\bt\.(\w+)", page.text)):  # every turn field the page reads is there
        assert all(name in turn for turn in data["turns"]), name
    for name in set(re.findall(r"\bm\.(\w+)", page.text)):
        assert name in data["summary"], name
    server_state = data["server"]
    assert server_state["model"] == MODEL_ID and server_state["exactness"] == smollm2_engine.exactness.describe()
    assert server_state["drafting"] == {"enabled": smollm2_engine.exactness.drafting and smollm2_engine.drafter is not None,
                                        "method": smollm2_engine.drafter.name, "max_width": smollm2_engine.exactness.max_width}
    sessions = {s["session_id"]: s for s in data["sessions"]["recent"]}
    assert data["sessions"]["count"] == len({r["session_id"] for r in rows if r["session_id"]}) == len(sessions)
    assert sessions["s-dash"]["turns"] == 2 and sessions["s-dash"]["cached_tokens"] > 0


class _Rows(HTMLParser):
    """The `data-turn-id` of every `tr.turn`, and the text inside each element with an id."""

    VOID = {"meta", "br", "link", "img", "input", "hr", "col", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.turn_ids: list[str] = []
        self.text: dict[str, str] = {}
        self._open: list[tuple[str, str | None]] = []  # (tag, id) of the elements we are inside

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr" and found.get("class") == "turn":
            self.turn_ids.append(found.get("data-turn-id") or "")
        if tag not in self.VOID:
            self._open.append((tag, found.get("id")))
            if found.get("id"):
                self.text.setdefault(found["id"], "")

    def handle_endtag(self, tag: str) -> None:
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data: str) -> None:
        for _, name in self._open:
            if name:
                self.text[name] += data


def render(url: str) -> tuple[str, str]:
    """(the DOM after the page's scripts ran, Chromium's stderr with the console messages)."""
    with tempfile.TemporaryDirectory(prefix="agentfold-chromium-") as profile:
        done = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=4000",
                               "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_dashboard_renders_the_turns_in_chromium(dashboard, smollm2_engine):
    service, server = dashboard
    dom, console = render(server.url + "/dashboard")
    console_lines = [line for line in console.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console_lines, console_lines
    rows = _Rows()
    rows.feed(dom)
    served = [r["turn_id"] for r in service.telemetry.list_turns(limit=200)]
    assert rows.turn_ids == served and len(served) == 3  # one row per turn, newest first
    assert rows.text["model"] == MODEL_ID and rows.text["exactness"] == smollm2_engine.exactness.describe()
    assert rows.text["session-count"] == str(len({r["session_id"] for r in service.telemetry.list_turns() if r["session_id"]}))
    assert re.search(r"\d+\xa0ms", rows.text["turns"]) and re.search(r"\d+\.\d\xa0tok/s", rows.text["turns"])
