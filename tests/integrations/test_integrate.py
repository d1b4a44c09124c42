"""`agentfold integrate`: golden configs per client/scope/transport, merging, backups, refusals, /v1/models.

Regenerate the golden files after a deliberate template change with
`AGENTFOLD_UPDATE_GOLDEN=1 python -m pytest tests/integrations/test_integrate.py`, then read the diff.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import tomlkit
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentfold.integrations import writer as integrate
from agentfold.integrations.clients import CLIENTS, UI_ONLY, Env, targets
from agentfold.integrations.edits import Op
from agentfold.integrations.errors import ConfigShapeError
from agentfold.integrations.jsonc import merge_json, parse_jsonc
from agentfold.integrations.merge import Change, merge
from agentfold.integrations.settings import Settings, normalize_base_url
from agentfold.integrations.templates import render_readme

GOLDEN = Path(__file__).parents[1] / "golden" / "integrate"
UPDATE = os.environ.get("AGENTFOLD_UPDATE_GOLDEN") == "1"
FILE_CLIENTS = [c for c in CLIENTS if c not in UI_ONLY]
MODEL = "coder-7b"


def settings(transport: str = "http", model: str = MODEL) -> Settings:
    return Settings("http://127.0.0.1:8080", model, 32768, transport, "/models/coder.gguf", "agentfold")


def make_env(tmp_path: Path, scope: str = "project", transport: str = "http", platform: str = "linux") -> Env:
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    return Env(settings(transport), project, home, platform, None, scope)


def cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[int, str, str]:
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    rc = integrate.main([*argv, "--project-dir", str(project), "--home", str(home)])
    out, err = capsys.readouterr()
    return rc, out, err


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def parse(text: str, suffix: str):
    if suffix == ".json":
        return json.loads(text)  # what we write from scratch is strict JSON
    if suffix == ".toml":
        return tomlkit.parse(text).unwrap()
    return yaml.safe_load(text)


# ------------------------------------------------------------------------------------------
# golden files: one per client, scope, transport and file


@pytest.mark.parametrize("transport", ["http", "stdio"])
@pytest.mark.parametrize("scope", ["project", "user"])
@pytest.mark.parametrize("client", FILE_CLIENTS)
def test_golden(tmp_path: Path, client: str, scope: str, transport: str) -> None:
    env = make_env(tmp_path, scope, transport)
    changes = integrate.plan(client, env)
    assert changes
    for change in changes:
        assert change.old is None and change.changed
        assert "{{" not in change.new, "a placeholder was left unfilled"
        suffix = change.target.path.suffix
        data = parse(change.new, suffix)
        assert data, change.target.display
        golden = GOLDEN / f"{client}-{scope}-{transport}.{change.target.label}{suffix}"
        if UPDATE:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(change.new, encoding="utf-8")
        assert golden.exists(), f"missing {golden.name}; run with AGENTFOLD_UPDATE_GOLDEN=1 and review it"
        assert change.new == golden.read_text(encoding="utf-8"), golden.name


@pytest.mark.parametrize("client", UI_ONLY)
def test_golden_ui_only_readme(client: str) -> None:
    text = render_readme(client, settings())
    assert "{{" not in text and "http://127.0.0.1:8080/v1" in text and MODEL in text
    golden = GOLDEN / f"{client}.README.md"
    if UPDATE:
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")


EXPECTED_PATHS = {
    ("claude-code", "project"): [".mcp.json", ".claude/settings.json"],
    ("claude-code", "user"): ["~/.claude.json", "~/.claude/settings.json"],
    ("codex", "project"): [".codex/config.toml"],
    ("codex", "user"): ["~/.codex/config.toml", "~/.codex/agentfold.config.toml"],
    ("cursor", "project"): [".cursor/mcp.json"],
    ("cursor", "user"): ["~/.cursor/mcp.json"],
    ("vscode", "project"): [".vscode/mcp.json"],
    ("vscode", "user"): ["~/.config/Code/User/mcp.json"],
    ("continue", "project"): [".continue/models/agentfold.yaml", ".continue/mcpServers/agentfold.yaml"],
    ("continue", "user"): ["~/.continue/config.yaml"],
    ("zed", "project"): [".zed/settings.json"],
    ("zed", "user"): ["~/.config/zed/settings.json"],
    ("opencode", "project"): ["opencode.json"],
    ("opencode", "user"): ["~/.config/opencode/opencode.json"],
    ("aider", "project"): [".aider.conf.yml", ".aider.model.settings.yml", ".aider.model.metadata.json"],
    ("aider", "user"): ["~/.aider.conf.yml", "~/.aider.model.settings.yml", "~/.aider.model.metadata.json"],
}


@pytest.mark.parametrize(("client", "scope"), sorted(EXPECTED_PATHS))
def test_paths_per_client_and_scope(tmp_path: Path, client: str, scope: str) -> None:
    env = make_env(tmp_path, scope)
    assert [t.display for t in targets(client, env)] == EXPECTED_PATHS[(client, scope)]


@pytest.mark.parametrize(("platform", "client", "path"), [
    ("darwin", "vscode", "~/Library/Application Support/Code/User/mcp.json"),
    ("win32", "vscode", "~/AppData/Roaming/Code/User/mcp.json"),
    ("darwin", "zed", "~/.config/zed/settings.json"),
    ("win32", "zed", "~/AppData/Roaming/Zed/settings.json"),
])
def test_user_paths_per_platform(tmp_path: Path, platform: str, client: str, path: str) -> None:
    env = make_env(tmp_path, "user", platform=platform)
    assert [t.display for t in targets(client, env)] == [path]


def test_templates_say_what_api_md_says(tmp_path: Path) -> None:
    """Spot checks of the facts the golden files rest on."""
    env = make_env(tmp_path, "user")
    claude = {c.target.label: json.loads(c.new) for c in integrate.plan("claude-code", env)}
    assert claude["mcp"]["mcpServers"]["agentfold"] == {"type": "http", "url": "http://127.0.0.1:8080/mcp"}
    assert claude["settings"]["env"] == {
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:8080",  # no /v1 for Claude Code
        "ANTHROPIC_AUTH_TOKEN": "agentfold",
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "API_TIMEOUT_MS": "3600000",  # a CPU's first turn can outlast 10 min: no retry, no non-streaming fallback
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",  # pings do not count: 10 min without an event ends the stream
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "32768",  # the served context: Claude Code compacts before it fills
    }
    codex_config, codex_profile = (tomlkit.parse(c.new).unwrap() for c in integrate.plan("codex", env))
    codex = codex_config
    assert "profiles" not in codex and "profile" not in codex  # Codex 0.134+ refuses both
    instructions = codex_profile.pop("developer_instructions")  # a small model told to use the shell
    assert "exec_command" in instructions and '{"cmd": "cat FILE"}' in instructions
    assert codex_profile == {"model_provider": "agentfold", "model": MODEL, "model_context_window": 32768,
                             "mcp_servers": {"agentfold": {"url": "http://127.0.0.1:8080/mcp", "enabled": False}}}
    assert codex["model_providers"]["agentfold"]["wire_api"] == "responses"
    assert codex["model_providers"]["agentfold"]["base_url"] == "http://127.0.0.1:8080/v1"
    assert codex["mcp_servers"]["agentfold"] == {"url": "http://127.0.0.1:8080/mcp"}
    project_codex = tomlkit.parse(integrate.plan("codex", make_env(tmp_path, "project"))[0].new).unwrap()
    assert set(project_codex) == {"mcp_servers"}  # providers are read only from ~/.codex/config.toml
    cont = yaml.safe_load(integrate.plan("continue", env)[0].new)
    assert cont["models"][0]["capabilities"] == ["tool_use"]
    assert cont["mcpServers"][0] == {"name": "agentfold", "type": "streamable-http", "url": "http://127.0.0.1:8080/mcp"}
    stdio = make_env(tmp_path, "user", "stdio")
    vscode = json.loads(integrate.plan("vscode", stdio)[0].new)
    assert vscode["servers"]["agentfold"] == {"type": "stdio", "command": "agentfold",
                                              "args": ["mcp", "--model", "/models/coder.gguf"]}


# ------------------------------------------------------------------------------------------
# merging into what the user already has


def test_claude_code_merge_keeps_foreign_keys(tmp_path: Path) -> None:
    env = make_env(tmp_path, "project")
    (env.project_dir / ".mcp.json").write_text(json.dumps(
        {"mcpServers": {"github": {"command": "gh-mcp", "args": []}}, "extra": [1, 2]}, indent=4) + "\n")
    (env.project_dir / ".claude").mkdir()
    (env.project_dir / ".claude" / "settings.json").write_text(json.dumps({
        "permissions": {"allow": ["Bash(git status)"]},
        "env": {"MY_VAR": "1", "ANTHROPIC_BASE_URL": "http://old"},
        "model": "opus",
    }, indent=2))
    changes = {c.target.label: c for c in integrate.plan("claude-code", env)}
    mcp = json.loads(changes["mcp"].new)
    assert mcp["mcpServers"]["github"] == {"command": "gh-mcp", "args": []} and mcp["extra"] == [1, 2]
    assert mcp["mcpServers"]["agentfold"]["url"] == "http://127.0.0.1:8080/mcp"
    assert changes["mcp"].new.startswith('{\n    "mcpServers"')  # the file's own 4-space indent is kept
    settings_ = json.loads(changes["settings"].new)
    assert settings_["permissions"] == {"allow": ["Bash(git status)"]} and settings_["model"] == "opus"
    assert settings_["env"]["MY_VAR"] == "1"
    assert settings_["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    assert list(settings_) == ["permissions", "env", "model"]  # key order kept


def test_jsonc_merge_keeps_comments_and_layout(tmp_path: Path) -> None:
    env = make_env(tmp_path, "user")
    path = env.home / ".config" / "zed" / "settings.json"
    path.parent.mkdir(parents=True)
    original = (
        "// Zed settings\n"
        "{\n"
        '  "ui_font_size": 16, // big\n'
        '  "theme": { "mode": "system", "dark": "One Dark", },\n'
        '  "language_models": {\n'
        '    "ollama": { "api_url": "http://localhost:11434" }\n'
        "  },\n"
        "  /* block\n     comment */\n"
        '  "context_servers": {\n'
        '    "other": { "command": "x" },\n'
        "  },\n"
        "}\n"
    )
    path.write_text(original)
    new = integrate.plan("zed", env)[0].new
    for kept in ("// Zed settings", '"ui_font_size": 16, // big', '"theme": { "mode": "system", "dark": "One Dark", },',
                 "/* block\n     comment */", '"ollama": { "api_url": "http://localhost:11434" },',
                 '"other": { "command": "x" },'):
        assert kept in new
    data = parse_jsonc(new).value
    assert data["context_servers"]["agentfold"] == {"url": "http://127.0.0.1:8080/mcp"}
    assert data["language_models"]["openai_compatible"]["AgentFold"]["api_url"] == "http://127.0.0.1:8080/v1"
    assert data["language_models"]["ollama"] == {"api_url": "http://localhost:11434"}
    # the only lines that changed are additions, plus a comma after the previous last member
    removed = [line for line in integrate.diff(Change(targets("zed", env)[0], original, new))
               .splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ['-    "ollama": { "api_url": "http://localhost:11434" }']


@pytest.mark.parametrize(("before", "after"), [
    ("{}", '{\n  "a": {\n    "b": 1\n  }\n}'),
    ("{\n}\n", '{\n  "a": {\n    "b": 1\n  }\n}\n'),
    ('{"x": 1}', '{"x": 1, "a": {"b": 1}}'),
    ('{"x": 1,}', '{"x": 1, "a": {"b": 1}}'),
    ('{\n\t"x": 1\n}', '{\n\t"x": 1,\n\t"a": {\n\t\t"b": 1\n\t}\n}'),
    ('{\n  "x": 1, // one\n}', '{\n  "x": 1, // one\n  "a": {\n    "b": 1\n  },\n}'),
    ('{\n  "a": {"b": 0, "c": 2}\n}', '{\n  "a": {"b": 1, "c": 2}\n}'),
    ("// only a comment\n", '// only a comment\n{\n  "a": {\n    "b": 1\n  }\n}\n'),
    ("", '{\n  "a": {\n    "b": 1\n  }\n}\n'),
])
def test_json_in_place_edits(before: str, after: str) -> None:
    assert merge_json(before, [Op(("a", "b"), 1)]) == after


def test_codex_merge_keeps_toml_comments_and_tables(tmp_path: Path) -> None:
    env = make_env(tmp_path, "user")
    path = env.home / ".codex" / "config.toml"
    path.parent.mkdir(parents=True)
    original = (
        "# my Codex config\n"
        'model = "gpt-5-codex"  # the default\n'
        "\n"
        "[mcp_servers.github]\n"
        'command = "gh-mcp"  # GitHub tools\n'
        "\n"
        "[mcp_servers.agentfold]\n"
        'url = "http://old:1/mcp"\n'
        "\n"
        "# comment that belongs to [tui]\n"
        "[tui]\n"
        "notifications = true\n"
    )
    path.write_text(original)
    new = integrate.plan("codex", env)[0].new
    for kept in ("# my Codex config", 'model = "gpt-5-codex"  # the default', 'command = "gh-mcp"  # GitHub tools',
                 "# comment that belongs to [tui]\n[tui]\nnotifications = true"):
        assert kept in new
    data = tomlkit.parse(new).unwrap()
    assert data["model"] == "gpt-5-codex" and data["mcp_servers"]["github"] == {"command": "gh-mcp"}
    assert data["mcp_servers"]["agentfold"] == {"url": "http://127.0.0.1:8080/mcp"}
    assert "profiles" not in data  # the profile is its own file since Codex 0.134
    # switching transport replaces AgentFold's own entry, not its neighbours
    stdio = merge(targets("codex", make_env(tmp_path, "user", "stdio"))[0], new).new
    assert tomlkit.parse(stdio).unwrap()["mcp_servers"]["agentfold"] == {
        "command": "agentfold", "args": ["mcp", "--model", "/models/coder.gguf"]}
    section = stdio.split("[mcp_servers.agentfold]\n")[1].split("\n[")[0]
    assert "# comment that belongs to [tui]\n[tui]" in stdio and section.startswith('command = "agentfold"')
    assert "\nurl = " not in section


def test_continue_merge_keeps_other_models_and_header(tmp_path: Path) -> None:
    env = make_env(tmp_path, "user")
    path = env.home / ".continue" / "config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({
        "name": "My Config", "version": "2.0.0", "schema": "v1",
        "models": [{"name": "GPT", "provider": "openai", "model": "gpt-4o"},
                   {"name": "AgentFold", "provider": "openai", "model": "old"}],
        "rules": ["be brief"],
    }, sort_keys=False))
    data = yaml.safe_load(integrate.plan("continue", env)[0].new)
    assert (data["name"], data["version"], data["rules"]) == ("My Config", "2.0.0", ["be brief"])
    assert [m["name"] for m in data["models"]] == ["GPT", "AgentFold"]
    assert data["models"][1]["model"] == MODEL and data["models"][1]["capabilities"] == ["tool_use"]
    assert data["mcpServers"] == [{"name": "agentfold", "type": "streamable-http", "url": "http://127.0.0.1:8080/mcp"}]


def test_flat_yaml_merge_keeps_comments(tmp_path: Path) -> None:
    env = make_env(tmp_path, "project")
    path = env.project_dir / ".aider.conf.yml"
    path.write_text("# my aider settings\nauto-commits: false  # I commit myself\nmodel: gpt-4o\n#dark-mode: true\n")
    new = integrate.plan("aider", env)[0].new
    assert new == ("# my aider settings\nauto-commits: false  # I commit myself\nmodel: openai/coder-7b\n"
                   "#dark-mode: true\nopenai-api-base: http://127.0.0.1:8080/v1\nopenai-api-key: agentfold\n")


def test_opencode_v2_layout_is_followed(tmp_path: Path) -> None:
    env = make_env(tmp_path, "project")
    (env.project_dir / "opencode.jsonc").write_text('{\n  // V2\n  "mcp": {"servers": {"x": {"type": "remote", "url": "u"}}}\n}\n')
    [change] = integrate.plan("opencode", env)
    assert change.target.display == "opencode.jsonc"
    data = parse_jsonc(change.new).value
    assert data["mcp"]["servers"]["agentfold"]["url"] == "http://127.0.0.1:8080/mcp" and "agentfold" not in data["mcp"]
    assert data["$schema"] == "https://opencode.ai/config.json"


def test_crlf_files_keep_their_line_endings(tmp_path: Path) -> None:
    env = make_env(tmp_path, "project")
    (env.project_dir / ".cursor").mkdir()
    (env.project_dir / ".cursor" / "mcp.json").write_bytes(b'{\r\n  "mcpServers": {\r\n    "x": {"url": "u"}\r\n  }\r\n}\r\n')
    [change] = integrate.plan("cursor", env)
    assert change.new.count("\r\n") == change.new.count("\n") and "agentfold" in change.new
    assert merge(change.target, change.new).changed is False


# ------------------------------------------------------------------------------------------
# the command: idempotence, backups, dry run, refusals


@pytest.mark.parametrize("scope", ["project", "user"])
@pytest.mark.parametrize("client", FILE_CLIENTS)
def test_rerun_is_idempotent(capsys, tmp_path: Path, client: str, scope: str) -> None:
    rc, out, _ = cli(capsys, tmp_path, client, "--scope", scope, "--model", MODEL)
    assert rc == 0 and "+++" in out
    first = snapshot(tmp_path)
    assert not any(name.endswith(".bak") for name in first)
    rc, out, err = cli(capsys, tmp_path, client, "--scope", scope, "--model", MODEL)
    assert rc == 0 and out == "" and "already up to date" in err
    assert snapshot(tmp_path) == first  # no change, no backup


def test_existing_file_gets_a_backup_then_a_timestamped_one(capsys, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    original = b'{\n  "mcpServers": {\n    "other": {"url": "http://x/mcp"}\n  }\n}\n'
    (project / ".mcp.json").write_bytes(original)
    rc, out, err = cli(capsys, tmp_path, "claude-code", "--model", MODEL)
    assert rc == 0 and "--- .mcp.json\n+++ .mcp.json\n" in out and "backup .mcp.json.bak" in err
    assert ".claude/settings.json: created" in err  # a new file needs no backup
    assert (project / ".mcp.json.bak").read_bytes() == original
    settings_v1 = (project / ".claude" / "settings.json").read_bytes()
    rc, out, err = cli(capsys, tmp_path, "claude-code", "--model", "other-model")
    assert rc == 0 and '-    "ANTHROPIC_DEFAULT_OPUS_MODEL": "coder-7b",' in out and ".mcp.json: already up to date" in err
    assert (project / ".claude" / "settings.json.bak").read_bytes() == settings_v1
    settings_v2 = (project / ".claude" / "settings.json").read_bytes()
    rc, out, err = cli(capsys, tmp_path, "claude-code", "--model", "third-model")
    assert rc == 0
    assert (project / ".claude" / "settings.json.bak").read_bytes() == settings_v1  # never overwritten
    stamped = [p for p in (project / ".claude").iterdir() if p.name.startswith("settings.json.2")]
    assert len(stamped) == 1 and stamped[0].name.endswith(".bak") and stamped[0].read_bytes() == settings_v2
    assert (project / ".mcp.json.bak").read_bytes() == original


def test_writes_through_symlinks_and_keeps_permissions(capsys, tmp_path: Path) -> None:
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    real = dotfiles / "claude.json"
    real.write_text('{"numStartups": 3, "mcpServers": {}}\n')
    real.chmod(0o600)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".claude.json").symlink_to(real)
    rc, _, _ = cli(capsys, tmp_path, "claude-code", "--scope", "user", "--model", MODEL)
    assert rc == 0 and (tmp_path / "home" / ".claude.json").is_symlink()
    data = json.loads(real.read_text())
    assert data["numStartups"] == 3 and "agentfold" in data["mcpServers"]
    assert real.stat().st_mode & 0o777 == 0o600
    assert (dotfiles / "claude.json.bak").read_text() == '{"numStartups": 3, "mcpServers": {}}\n'


def test_dry_run_writes_nothing_and_prints_everything(capsys, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / ".mcp.json").write_text('{"mcpServers": {}}\n')
    before = snapshot(tmp_path)
    rc, out, err = cli(capsys, tmp_path, "claude-code", "--model", MODEL, "--dry-run")
    assert rc == 0 and snapshot(tmp_path) == before
    assert "=== .mcp.json (changed; dry run, not written) ===" in out
    assert "=== .claude/settings.json (new file; dry run, not written) ===" in out
    assert '"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"' in out  # the full resulting file
    assert "--- .mcp.json\n+++ .mcp.json\n" in out and "--- /dev/null\n+++ .claude/settings.json\n" in out
    assert "nothing was written" in err


@pytest.mark.parametrize(("client", "relpath", "content", "message"), [
    ("claude-code", ".claude/settings.json", '{"env": {"A": 1,,}}', ".claude/settings.json is not valid JSON (line 1 column"),
    ("claude-code", ".mcp.json", '{"mcpServers": ["not", "an", "object"]}', "`mcpServers` is a list, not an object"),
    ("codex", ".codex/config.toml", '[mcp_servers\nurl = "x"\n', ".codex/config.toml is not valid TOML"),
    ("codex", ".codex/config.toml", 'mcp_servers = "oops"\n', "`mcp_servers` is a string, not a table"),
    ("continue", ".continue/models/agentfold.yaml", "models: [unclosed\n", "is not valid YAML (line"),
    ("continue", ".continue/models/agentfold.yaml", "- just\n- a list\n", "`(top level)` is a list, not a mapping"),
    ("zed", ".zed/settings.json", '{\n  "a": 1\n  /* never closed\n}', "not valid JSON (line 3 column 3: unterminated /* comment)"),
    ("aider", ".aider.model.metadata.json", "[1, 2]", "`(top level)` is a list, not an object"),
])
def test_malformed_config_is_refused_and_left_alone(capsys, tmp_path: Path, client: str, relpath: str, content: str,
                                                    message: str) -> None:
    path = tmp_path / "project" / relpath
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode())
    before = snapshot(tmp_path)
    rc, out, err = cli(capsys, tmp_path, client, "--model", MODEL)
    assert rc == 1 and out == ""
    assert snapshot(tmp_path) == before  # byte-identical, and no other file of the client was written
    error_lines = [line for line in err.splitlines() if not line.startswith("[agentfold]")]
    assert len(error_lines) == 1 and error_lines[0].startswith("agentfold integrate: error: ")
    assert message in error_lines[0] and "nothing was written" in error_lines[0] and "Traceback" not in err


def test_stdio_needs_a_model_path(capsys, tmp_path: Path) -> None:
    rc, out, err = cli(capsys, tmp_path, "cursor", "--model", MODEL, "--transport", "stdio")
    assert rc == 1 and "--transport stdio needs --model-path" in err
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    rc, out, err = cli(capsys, tmp_path, "cursor", "--model", MODEL, "--transport", "stdio", "--model-path", str(model))
    assert rc == 0
    entry = json.loads((tmp_path / "project" / ".cursor" / "mcp.json").read_text())["mcpServers"]["agentfold"]
    assert entry["args"] == ["mcp", "--model", str(model.resolve())] and entry["command"].endswith("agentfold")


def test_ui_only_clients_print_their_settings(capsys, tmp_path: Path) -> None:
    rc, out, err = cli(capsys, tmp_path, "cline", "--model", MODEL)
    assert rc == 0 and "`http://127.0.0.1:8080/v1`" in out and f"`{MODEL}`" in out and "nothing was written" in err
    assert snapshot(tmp_path) == {}


@pytest.mark.parametrize(("given", "root"), [
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080"),
    ("https://box.local/agentfold/mcp", "https://box.local/agentfold"),
])
def test_base_url_normalization(given: str, root: str) -> None:
    assert normalize_base_url(given) == root


def test_bad_base_url_is_one_line(capsys, tmp_path: Path) -> None:
    rc, _, err = cli(capsys, tmp_path, "cursor", "--base-url", "127.0.0.1:8080")
    assert rc == 1 and err.strip().count("\n") == 0 and "is not an http(s) URL" in err


# ------------------------------------------------------------------------------------------
# /v1/models from a real HTTP server on loopback (a stand-in for the AgentFold server)


@pytest.fixture
def models_server():
    """A real uvicorn server on a free 127.0.0.1 port; set `state["payload"]` / `state["status"]` to steer it."""
    state: dict = {"payload": {"object": "list", "data": [{"id": "served-model", "object": "model"}]}, "status": 200,
                   "requests": []}

    async def models(request: Request) -> JSONResponse:
        state["requests"].append(dict(request.headers))
        return JSONResponse(state["payload"], status_code=state["status"])

    app = Starlette(routes=[Route("/v1/models", models)])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    state["url"] = f"http://127.0.0.1:{port}"
    yield state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_model_name_comes_from_the_running_server(capsys, tmp_path: Path, models_server) -> None:
    models_server["payload"]["data"][0]["context_length"] = 65536
    rc, out, err = cli(capsys, tmp_path, "opencode", "--base-url", models_server["url"] + "/v1")
    assert rc == 0 and len(models_server["requests"]) == 1
    assert f"model 'served-model' (from {models_server['url']}/v1/models)" in err
    data = json.loads((tmp_path / "project" / "opencode.json").read_text())
    provider = data["provider"]["agentfold"]
    assert provider["options"]["baseURL"] == models_server["url"] + "/v1"
    assert provider["models"]["served-model"]["limit"] == {"context": 65536, "output": 8192}
    assert data["mcp"]["agentfold"]["url"] == models_server["url"] + "/mcp"


def test_model_flag_overrides_the_server(capsys, tmp_path: Path, models_server) -> None:
    rc, _, err = cli(capsys, tmp_path, "codex", "--base-url", models_server["url"], "--model", "mine")
    assert rc == 0 and models_server["requests"] == [] and "model 'mine' (from --model)" in err


def test_several_models_first_wins_and_is_announced(capsys, tmp_path: Path, models_server) -> None:
    models_server["payload"] = {"data": [{"id": "a"}, {"id": "b"}], "models": [{"slug": "a"}]}
    rc, _, err = cli(capsys, tmp_path, "vscode", "--base-url", models_server["url"], "--dry-run")
    assert rc == 0 and "model 'a'" in err and "also lists b" in err


@pytest.mark.parametrize(("status", "payload", "message"), [
    (500, {"error": "boom"}, "answered HTTP 500"),
    (200, {"nope": []}, "did not answer with an OpenAI model list"),
    (200, {"data": []}, "lists no model"),
])
def test_bad_server_answers_are_one_line(capsys, tmp_path: Path, models_server, status, payload, message) -> None:
    models_server["status"], models_server["payload"] = status, payload
    rc, out, err = cli(capsys, tmp_path, "cursor", "--base-url", models_server["url"])
    assert rc == 1 and out == "" and message in err and "--model NAME" in err
    assert err.strip().count("\n") == 0 and snapshot(tmp_path) == {}


def test_unreachable_server_without_model_is_one_line(capsys, tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc, out, err = cli(capsys, tmp_path, "claude-code", "--base-url", f"http://127.0.0.1:{port}")
    assert rc == 1 and out == "" and snapshot(tmp_path) == {}
    assert err.strip().count("\n") == 0
    assert f"cannot reach the AgentFold server at http://127.0.0.1:{port}/v1/models" in err and "--model NAME" in err


def test_json_edits_mean_exactly_the_merge() -> None:
    """Any JSON layout, any path: the in-place edit parses back to the plain-data merge."""
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")
    keys = st.sampled_from(["a", "b", "mcpServers", "agentfold", "x y", "é"])
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(keys, inner, max_size=3)), max_leaves=8)

    @hypothesis.settings(max_examples=200, deadline=None)
    @hypothesis.given(st.dictionaries(keys, values, max_size=4), st.lists(keys, min_size=1, max_size=3), values,
                      st.sampled_from([None, 2, 4, "\t"]), st.booleans())
    def check(doc, path, value, indent, comment) -> None:
        text = json.dumps(doc, indent=indent)
        if comment:
            text = "// header\n" + text.replace("{\n", "{ // open\n", 1)
        expected = json.loads(json.dumps(doc))
        node = expected
        for step in path[:-1]:
            if not isinstance(node.get(step), dict):
                if step in node:
                    with pytest.raises(ConfigShapeError):
                        merge_json(text, [Op(tuple(path), value)])
                    return
                node[step] = {}
            node = node[step]
        node[path[-1]] = value
        new = merge_json(text, [Op(tuple(path), value)])
        assert parse_jsonc(new).value == expected
        assert merge_json(new, [Op(tuple(path), value)]) == new

    check()
