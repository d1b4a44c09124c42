"""Which files each coding assistant reads, per scope and platform, and what goes into each.

One builder per client turns its templates into `Target`s; this is where client-specific knowledge
about paths and layouts lives (Codex reads providers only from the user file, Zed's language models
are a user setting, opencode's V2 layout nests MCP servers, ...).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomlkit
import tomlkit.exceptions

from agentfold.integrations.edits import ANYTHING, Op, Target, ops_from
from agentfold.integrations.jsonc import JsonSyntaxError, parse_jsonc
from agentfold.integrations.settings import Settings
from agentfold.integrations.templates import load_template

CLIENTS = ("claude-code", "codex", "cursor", "vscode", "continue", "zed", "opencode", "aider", "cline", "roo")
UI_ONLY = ("cline", "roo")  # configured in their settings UI: we print the filled-in README instead
NO_MCP = ("aider",)


@dataclass(frozen=True)
class Env:
    """Where the files go: the settings, the project and home folders, the platform and the scope."""

    settings: Settings
    project_dir: Path
    home: Path
    platform: str = sys.platform
    xdg_config_home: Path | None = None
    scope: str = "project"

    @property
    def config_home(self) -> Path:
        return self.xdg_config_home or self.home / ".config"

    def display(self, path: Path) -> str:
        """`path` relative to the project (project scope) or as `~/...` (user scope)."""
        root, prefix = (self.project_dir, "") if self.scope == "project" else (self.home, "~/")
        with contextlib.suppress(ValueError):
            return prefix + path.relative_to(root).as_posix()
        return str(path)


def _first_existing(*paths: Path) -> Path:
    return next((p for p in paths if p.exists()), paths[0])


def _claude_code(env: Env, scope: str) -> list[Target]:
    s, t = env.settings, env.settings.transport
    mcp = ops_from(load_template("claude-code", f"mcp.{t}.json", s), owned=[("mcpServers", "*")])
    settings = ops_from(load_template("claude-code", "settings.json", s))
    if scope == "project":
        return [_t(env, "mcp", env.project_dir / ".mcp.json", "json", mcp),
                _t(env, "settings", env.project_dir / ".claude" / "settings.json", "json", settings)]
    return [_t(env, "mcp", env.home / ".claude.json", "json", mcp),
            _t(env, "settings", env.home / ".claude" / "settings.json", "json", settings)]


CODEX_PROFILE = "agentfold"  # `codex --profile agentfold` reads ~/.codex/agentfold.config.toml
CODEX_PROFILE_KEY = "profile"  # the top-level selector Codex 0.134 dropped
_CODEX_LEGACY = ("Codex 0.134 and later refuse it; the profile is now "
                 f"~/.codex/{CODEX_PROFILE}.config.toml (`codex --profile {CODEX_PROFILE}`)")


def _codex(env: Env, scope: str) -> list[Target]:
    fragment = load_template("codex", f"config.{env.settings.transport}.toml", env.settings)
    if scope == "project":  # Codex reads model providers only from the user's files
        ops = ops_from({"mcp_servers": fragment["mcp_servers"]}, owned=[("*", "*")])
        return [_t(env, "config", env.project_dir / ".codex" / "config.toml", "toml", ops)]
    config = env.home / ".codex" / "config.toml"
    default_reason = (_CODEX_LEGACY + f'; to keep AgentFold the default, put model_provider = "{CODEX_PROFILE}" '
                      f'and model = "{env.settings.model}" at the top of ~/.codex/config.toml instead')
    legacy = (Op((CODEX_PROFILE_KEY,), CODEX_PROFILE, remove=True, reason=default_reason),
              Op(("profiles", CODEX_PROFILE), ANYTHING, remove=True, reason=_CODEX_LEGACY))
    profile = load_template("codex", "profile.toml", env.settings)
    # the MCP server off under this profile (profile.toml says why); Codex checks a layer's table whole
    profile["mcp_servers"] = {"agentfold": {**fragment["mcp_servers"]["agentfold"], "enabled": False}}
    profile_ops = ops_from(profile)
    kept = {key: value for key, value in _codex_legacy_profile(config).items()  # the user's own additions
            if not any(op.path == (key,) for op in profile_ops)}
    profile_ops += tuple(Op((key,), value, only_if_missing=True) for key, value in kept.items())
    return [_t(env, "config", config, "toml", ops_from(fragment, owned=[("*", "*")]) + legacy),
            _t(env, "profile", env.home / ".codex" / f"{CODEX_PROFILE}.config.toml", "toml", profile_ops)]


def _codex_legacy_profile(config: Path) -> dict:
    """What an older AgentFold (or the user) put in `[profiles.agentfold]` of ~/.codex/config.toml."""
    try:
        data = tomlkit.parse(config.read_text(encoding="utf-8")).unwrap()
    except (OSError, UnicodeDecodeError, tomlkit.exceptions.ParseError):
        return {}  # missing, or malformed (merge() reports it)
    profiles = data.get("profiles")
    legacy = profiles.get(CODEX_PROFILE) if isinstance(profiles, dict) else None
    return legacy if isinstance(legacy, dict) else {}


def _cursor(env: Env, scope: str) -> list[Target]:
    ops = ops_from(load_template("cursor", f"mcp.{env.settings.transport}.json", env.settings), owned=[("mcpServers", "*")])
    root = env.project_dir if scope == "project" else env.home
    return [_t(env, "mcp", root / ".cursor" / "mcp.json", "json", ops)]


def _vscode(env: Env, scope: str) -> list[Target]:
    ops = ops_from(load_template("vscode", f"mcp.{env.settings.transport}.json", env.settings), owned=[("servers", "*")])
    if scope == "project":
        path = env.project_dir / ".vscode" / "mcp.json"
    elif env.platform == "darwin":
        path = env.home / "Library" / "Application Support" / "Code" / "User" / "mcp.json"
    elif env.platform == "win32":
        path = env.home / "AppData" / "Roaming" / "Code" / "User" / "mcp.json"
    else:
        path = env.config_home / "Code" / "User" / "mcp.json"
    return [_t(env, "mcp", path, "json", ops)]


def _continue(env: Env, scope: str) -> list[Target]:
    s, t = env.settings, env.settings.transport
    header = ("name", "version", "schema")
    if scope == "project":  # local blocks, one file per kind
        folder = env.project_dir / ".continue"
        return [_t(env, "models", folder / "models" / "agentfold.yaml", "yaml",
                   ops_from(load_template("continue", "models.yaml", s), defaults=header)),
                _t(env, "mcpServers", folder / "mcpServers" / "agentfold.yaml", "yaml",
                   ops_from(load_template("continue", f"mcpServers.{t}.yaml", s), defaults=header))]
    return [_t(env, "config", env.home / ".continue" / "config.yaml", "yaml",
               ops_from(load_template("continue", f"config.{t}.yaml", s), defaults=header))]


def _zed(env: Env, scope: str) -> list[Target]:
    fragment = load_template("zed", f"settings.{env.settings.transport}.json", env.settings)
    owned = [("language_models", "openai_compatible", "*"), ("context_servers", "*")]
    if scope == "project":  # language_models is a user setting; context_servers also works per project
        return [_t(env, "settings", env.project_dir / ".zed" / "settings.json", "json",
                   ops_from({"context_servers": fragment["context_servers"]}, owned=owned))]
    if env.platform == "win32":
        path = env.home / "AppData" / "Roaming" / "Zed" / "settings.json"
    else:
        path = env.config_home / "zed" / "settings.json"
    return [_t(env, "settings", path, "json", ops_from(fragment, owned=owned))]


def _opencode(env: Env, scope: str) -> list[Target]:
    fragment = load_template("opencode", f"opencode.{env.settings.transport}.json", env.settings)
    folder = env.project_dir if scope == "project" else env.config_home / "opencode"
    path = _first_existing(folder / "opencode.json", folder / "opencode.jsonc")
    if _opencode_v2(path):  # the V2 layout nests MCP servers under "mcp": {"servers": {...}}
        fragment["mcp"] = {"servers": fragment["mcp"]}
    ops = ops_from(fragment, owned=[("provider", "*"), ("mcp", "*"), ("mcp", "servers", "*")], defaults=("$schema",))
    return [_t(env, "config", path, "json", ops)]


def _opencode_v2(path: Path) -> bool:
    try:
        root = parse_jsonc(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, JsonSyntaxError):
        return False  # missing (V1 it is) or malformed (merge() reports it)
    mcp = root.value.get("mcp") if root is not None and isinstance(root.value, dict) else None
    servers = mcp.get("servers") if isinstance(mcp, dict) else None
    return isinstance(servers, dict) and "type" not in servers  # not a V1 server that happens to be named "servers"


def _aider(env: Env, scope: str) -> list[Target]:
    s = env.settings
    root = env.project_dir if scope == "project" else env.home
    return [_t(env, "conf", root / ".aider.conf.yml", "yaml", ops_from(load_template("aider", "aider.conf.yml", s))),
            _t(env, "model-settings", root / ".aider.model.settings.yml", "yaml",
               ops_from(load_template("aider", "aider.model.settings.yml", s))),
            _t(env, "model-metadata", root / ".aider.model.metadata.json", "json",
               ops_from(load_template("aider", "aider.model.metadata.json", s), owned=[("*",)]))]


def _t(env: Env, label: str, path: Path, fmt: str, ops: tuple[Op, ...]) -> Target:
    return Target(label, path, fmt, ops, env.display(path))


_TARGETS: dict[str, Callable[[Env, str], list[Target]]] = {
    "claude-code": _claude_code, "codex": _codex, "cursor": _cursor, "vscode": _vscode,
    "continue": _continue, "zed": _zed, "opencode": _opencode, "aider": _aider,
}


def targets(client: str, env: Env) -> list[Target]:
    """The files `client` reads at `env.scope`, with what AgentFold writes into each."""
    if client in UI_ONLY:
        return []
    return _TARGETS[client](env, env.scope)
