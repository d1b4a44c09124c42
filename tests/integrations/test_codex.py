"""Codex 0.134+ profiles (one file each), the migration off `[profiles.agentfold]`, and the context warning.

Checked against the real Codex CLI 0.171.0: `codex exec --strict-config --profile agentfold` starts
with the files written here and sends its requests to the provider; with a `[profiles.agentfold]`
table or a top-level `profile = "agentfold"` in config.toml it refuses to start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomlkit

from agentfold.integrations.notes import context_warning
from tests.integrations.test_integrate import MODEL, cli, models_server, snapshot  # noqa: F401  (fixture)

# what `agentfold integrate codex --scope user` wrote before Codex 0.134, plus what a user adds around it
LEGACY = """\
# my Codex config
profile = "agentfold"
model = "gpt-5-codex"

[model_providers.agentfold]
name = "AgentFold"
base_url = "http://127.0.0.1:8080/v1"
wire_api = "responses"

[profiles.agentfold]
model_provider = "agentfold"
model = "old-model"
approval_policy = "never"  # added by the user

# the work profile
[profiles.work]
model = "o3"

[mcp_servers.agentfold]
url = "http://127.0.0.1:8080/mcp"
"""


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "home" / ".codex" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_legacy_profile_moves_to_its_own_file(capsys, tmp_path: Path) -> None:
    config = write_config(tmp_path, LEGACY)
    rc, out, err = cli(capsys, tmp_path, "codex", "--scope", "user", "--model", MODEL)
    assert rc == 0, err
    new = config.read_text()
    data = tomlkit.parse(new).unwrap()
    assert "profile" not in data and "agentfold" not in data["profiles"]
    assert data["profiles"]["work"] == {"model": "o3"} and data["model"] == "gpt-5-codex"  # the user's own
    assert "# my Codex config" in new and "# the work profile\n[profiles.work]" in new
    assert data["model_providers"]["agentfold"]["wire_api"] == "responses"
    profile = tomlkit.parse((config.parent / "agentfold.config.toml").read_text()).unwrap()
    assert "exec_command" in profile.pop("developer_instructions")  # a small model told to use the shell
    assert profile == {"model_provider": "agentfold", "model": MODEL, "model_context_window": 32768,
                       "mcp_servers": {"agentfold": {"url": "http://127.0.0.1:8080/mcp", "enabled": False}},
                       "approval_policy": "never"}  # the user's addition to the old table comes along
    assert (config.parent / "config.toml.bak").read_text() == LEGACY
    assert "removed `profile = \"agentfold\"`" in err and "removed [profiles.agentfold]" in err
    assert "codex --profile agentfold" in err and "-[profiles.agentfold]" in out
    before = snapshot(tmp_path)
    rc, out, err = cli(capsys, tmp_path, "codex", "--scope", "user", "--model", MODEL)
    assert rc == 0 and out == "" and err.count("already up to date") == 2 and "removed" not in err
    assert snapshot(tmp_path) == before


def test_only_the_whole_legacy_profile_table_goes(capsys, tmp_path: Path) -> None:
    """The `[profiles]` table goes once its last profile is gone; a selector naming another profile stays."""
    config = write_config(tmp_path, 'profile = "work"\n\n[profiles.agentfold]\nmodel = "x"\n')
    rc, _, err = cli(capsys, tmp_path, "codex", "--scope", "user", "--model", MODEL)
    data = tomlkit.parse(config.read_text()).unwrap()
    assert rc == 0 and data["profile"] == "work" and "profiles" not in data
    assert 'still selects `profile = "work"`' in err and "~/.codex/work.config.toml" in err


@pytest.mark.parametrize(("client", "context", "warned"), [
    ("claude-code", 8192, True), ("codex", 8192, True), ("codex", 32768, False), ("opencode", 16384, True),
    ("aider", 16384, False), ("aider", 8192, True), ("cursor", 8192, False),  # cursor: MCP only
])
def test_context_warning_per_client(client: str, context: int, warned: bool) -> None:
    warning = context_warning(client, context, "smollm2")
    assert (warning is not None) == warned
    if warned:
        assert f"{context}-token context" in warning and "--model gemma3" in warning and "32K context" in warning


def test_served_context_below_the_client_need_is_warned(capsys, tmp_path: Path, models_server) -> None:  # noqa: F811
    models_server["payload"]["data"][0]["context_length"] = 8192
    rc, _, err = cli(capsys, tmp_path, "claude-code", "--base-url", models_server["url"])
    warning = [line for line in err.splitlines() if "token context" in line]
    assert rc == 0 and len(warning) == 1
    assert "'served-model' has a 8192-token context, too small for claude-code" in warning[0]
    assert "32K or more is recommended" in warning[0] and "agentfold serve --model gemma3" in warning[0]
    models_server["payload"]["data"][0]["context_length"] = 32768
    rc, _, err = cli(capsys, tmp_path, "codex", "--base-url", models_server["url"], "--dry-run")
    assert rc == 0 and "token context" not in err


def test_declared_context_is_checked_without_a_server(capsys, tmp_path: Path) -> None:
    rc, _, err = cli(capsys, tmp_path, "codex", "--model", MODEL, "--context-length", "8192", "--dry-run")
    assert rc == 0 and "has a 8192-token context, too small for codex" in err
    rc, _, err = cli(capsys, tmp_path, "codex", "--model", MODEL, "--dry-run")
    assert rc == 0 and "token context" not in err  # unknown: nothing to say
