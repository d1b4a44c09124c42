"""`agentfold integrate CLIENT`: wire a running AgentFold server into a coding assistant's config.

The model name comes from the server's `GET /v1/models` (or `--model`). The snippets live in
`integrations/<client>/` (the `agentfold.integrations` package) with `{{PLACEHOLDER}}`s; they are
filled in and merged into the client's existing JSON / TOML / YAML files:

- only AgentFold's own entries are written (`mcpServers.agentfold`, `[model_providers.agentfold]`,
  the `ANTHROPIC_*` keys of Claude Code's `env` block, ...); everything else is kept as it was;
- JSON (and JSON with comments, as Zed and VS Code write it) is edited in place, so comments,
  key order and indentation survive; TOML goes through tomlkit, which keeps comments; YAML goes
  through PyYAML (flat files such as `.aider.conf.yml` are edited line by line to keep comments);
- every file is read and merged before any is written; a file that does not parse is refused with
  one line on stderr and left byte-identical;
- an existing file is copied to `<file>.bak` (or `<file>.<timestamp>.bak` when that is taken)
  before it is replaced, and a unified diff is printed; a second run finds nothing to change and
  writes nothing, backups included;
- `--dry-run` writes nothing and prints each resulting file in full, then the diff.

Wired into the CLI by `agentfold.cli` through `add_parser(subparsers)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.exceptions
import tomlkit.items
import yaml

CLIENTS = ("claude-code", "codex", "cursor", "vscode", "continue", "zed", "opencode", "aider", "cline", "roo")
UI_ONLY = ("cline", "roo")  # configured in their settings UI: we print the filled-in README instead
NO_MCP = ("aider",)
SCOPES = ("project", "user")
TRANSPORTS = ("http", "stdio")
DEFAULT_BASE_URL = "http://127.0.0.1:8080"
DEFAULT_CONTEXT_LENGTH = 32768  # Claude Code's system prompt alone is 14-23K tokens
PROG = "agentfold integrate"


class IntegrateError(Exception):
    """A problem the user can fix; reported as one line on stderr, never a traceback."""


# --------------------------------------------------------------------------------------------
# settings, the server's model, templates


@dataclass(frozen=True)
class Settings:
    """What goes into the placeholders."""

    base_url: str  # server root, no trailing slash, no /v1 (Claude Code wants it that way)
    model: str
    context_length: int = DEFAULT_CONTEXT_LENGTH
    transport: str = "http"
    model_path: str | None = None  # checkpoint `agentfold mcp --model` loads (stdio transport)
    command: str = "agentfold"  # the executable stdio clients start

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def mcp_url(self) -> str:
        return self.base_url + "/mcp"

    @property
    def max_output_tokens(self) -> int:
        return max(256, min(8192, self.context_length // 4))

    def placeholders(self) -> dict[str, str | int]:
        values: dict[str, str | int] = {
            "BASE_URL": self.base_url,
            "OPENAI_BASE_URL": self.openai_base_url,
            "MCP_URL": self.mcp_url,
            "MODEL": self.model,
            "CONTEXT_LENGTH": self.context_length,
            "MAX_OUTPUT_TOKENS": self.max_output_tokens,
            "AGENTFOLD": self.command,
        }
        if self.model_path is not None:
            values["MODEL_PATH"] = self.model_path
        return values


def normalize_base_url(url: str) -> str:
    """`http://host:port` from what a user may type (`.../v1`, `.../mcp`, a trailing slash)."""
    url = url.strip()
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise IntegrateError(f"--base-url {url!r} is not an http(s) URL (example: {DEFAULT_BASE_URL})")
    path = parsed.path.rstrip("/")
    for suffix in ("/v1", "/mcp"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


@dataclass(frozen=True)
class ServerModel:
    id: str
    context_length: int | None
    others: tuple[str, ...] = ()


_CONTEXT_KEYS = ("context_length", "max_model_len", "context_window", "max_context_length", "n_ctx")


def fetch_model(base_url: str, timeout: float = 5.0) -> ServerModel:
    """The first model of the server's `GET /v1/models` (OpenAI list shape `{"data": [{"id": ...}]}`)."""
    url = base_url + "/v1/models"
    request = urllib.request.Request(url, headers={"Accept": "application/json", "Authorization": "Bearer agentfold"})
    host = urllib.parse.urlsplit(url).hostname or ""
    handlers = [urllib.request.ProxyHandler({})] if host in ("127.0.0.1", "localhost", "::1") else []
    opener = urllib.request.build_opener(*handlers)
    hint = "start it with `agentfold serve`, or pass --model NAME"
    try:
        with opener.open(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        raise IntegrateError(f"{url} answered HTTP {error.code}; is this an AgentFold server? Or pass --model NAME") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        reason = getattr(reason, "strerror", None) or reason
        raise IntegrateError(f"cannot reach the AgentFold server at {url} ({reason}); {hint}") from None
    try:
        payload = json.loads(body)
        entries = [entry for entry in payload["data"] if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise IntegrateError(f"{url} did not answer with an OpenAI model list; pass --model NAME") from None
    if not entries:
        raise IntegrateError(f"{url} lists no model; pass --model NAME")
    first = entries[0]
    context = next((first[k] for k in _CONTEXT_KEYS if isinstance(first.get(k), int) and first[k] > 0), None)
    return ServerModel(first["id"], context, tuple(entry["id"] for entry in entries[1:]))


_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def _fill(value: Any, values: dict[str, str | int]) -> Any:
    """Replace `{{NAME}}` in every string and key; a string that is only an int placeholder becomes an int."""
    if isinstance(value, dict):
        return {_fill(k, values): _fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, values) for v in value]
    if not isinstance(value, str):
        return value
    whole = _PLACEHOLDER.fullmatch(value)
    if whole and isinstance(values.get(whole.group(1)), int):
        return values[whole.group(1)]

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise IntegrateError(f"template placeholder {{{{{name}}}}} has no value")
        return str(values[name])

    return _PLACEHOLDER.sub(substitute, value)


def template_text(client: str, name: str) -> str:
    return (resources.files("agentfold.integrations") / client / name).read_text(encoding="utf-8")


def load_template(client: str, name: str, settings: Settings) -> Any:
    """A template from `integrations/<client>/`, parsed, with its placeholders filled in."""
    text = template_text(client, name)
    if name.endswith(".json"):
        data = json.loads(text)
    elif name.endswith(".toml"):
        data = tomlkit.parse(text).unwrap()
    else:
        data = yaml.safe_load(text)
    return _fill(data, settings.placeholders())


def render_readme(client: str, settings: Settings) -> str:
    values = settings.placeholders()
    return _PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), m.group(0))), template_text(client, "README.md"))


# --------------------------------------------------------------------------------------------
# targets: which files each client reads, per scope


@dataclass(frozen=True)
class Named:
    """A path step into a list: the item whose `name` is this (Continue's models, aider's settings)."""

    name: str


@dataclass(frozen=True)
class Op:
    path: tuple[str | Named, ...]
    value: Any
    only_if_missing: bool = False  # header keys (`name`, `version`, `$schema`): never overwrite the user's


@dataclass(frozen=True)
class Target:
    label: str  # short name for golden files and messages: mcp, settings, config, ...
    path: Path
    fmt: str  # json | toml | yaml
    ops: tuple[Op, ...]
    display: str = ""  # the path as shown to the user (relative to the project, or ~/...)


@dataclass(frozen=True)
class Env:
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


def ops_from(fragment: Any, owned: Sequence[tuple[str, ...]] = (), defaults: Sequence[str] = ()) -> tuple[Op, ...]:
    """The writes a template fragment stands for.

    Dicts merge key by key down to the leaves, except at an `owned` path (`*` matches any key), whose
    value is AgentFold's own entry and is replaced whole. A list of dicts with a `name` merges item by
    item on that name. Top-level keys in `defaults` are written only where the file lacks them.
    """
    ops: list[Op] = []

    def is_owned(path: tuple[str, ...]) -> bool:
        return any(len(o) == len(path) and all(a in ("*", b) for a, b in zip(o, path, strict=True)) for o in owned)

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if path and isinstance(path[-1], str) and is_owned(path):  # type: ignore[arg-type]
            ops.append(Op(path, value))
        elif isinstance(value, dict) and value:
            for key, child in value.items():
                walk(child, (*path, key))
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
            for item in value:
                ops.append(Op((*path, Named(item["name"])), item))
        else:
            ops.append(Op(path, value, only_if_missing=len(path) == 1 and path[0] in defaults))

    walk(fragment, ())
    return tuple(ops)


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


def _codex(env: Env, scope: str) -> list[Target]:
    fragment = load_template("codex", f"config.{env.settings.transport}.toml", env.settings)
    if scope == "project":  # Codex reads model providers only from ~/.codex/config.toml
        fragment = {"mcp_servers": fragment["mcp_servers"]}
        path = env.project_dir / ".codex" / "config.toml"
    else:
        path = env.home / ".codex" / "config.toml"
    return [_t(env, "config", path, "toml", ops_from(fragment, owned=[("*", "*")]))]


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
    except (OSError, UnicodeDecodeError, _JsonSyntaxError):
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


def notes(client: str, env: Env) -> list[str]:
    """What to do next, and what the command could not do for this client."""
    s, scope = env.settings, env.scope
    out: list[str] = []
    stdio = s.transport == "stdio" and client not in NO_MCP
    if client == "claude-code":
        out.append("restart Claude Code; it asks once to approve the `agentfold` MCP server from .mcp.json"
                   if scope == "project" else "restart Claude Code")
        out.append("CLAUDE_CODE_ATTRIBUTION_HEADER=0 keeps the prompt prefix stable, so AgentFold's prefix cache hits")
        if "/" in s.model:
            out.append(f"the model name {s.model!r} contains '/', which Claude Code handles badly; serve a short alias")
    elif client == "codex":
        if scope == "project":
            out.append("Codex loads .codex/config.toml only in trusted projects, and reads model providers only from "
                       "~/.codex/config.toml: run `agentfold integrate codex --scope user` to send its model traffic here")
        else:
            out.append('start Codex with `codex --profile agentfold` (or put `profile = "agentfold"` at the top of '
                       "~/.codex/config.toml to make it the default)")
    elif client == "cursor":
        out.append("only MCP is wired: Cursor sends model requests from its own servers, which cannot reach "
                   f"{s.base_url} (see integrations/README.md)")
    elif client == "vscode":
        out.append("the AgentFold tools appear in Copilot Chat's agent mode (`MCP: List Servers` starts and stops it)")
    elif client == "continue":
        out.append("reload Continue and pick the model `AgentFold`")
        legacy = env.home / ".continue" / "config.json"
        if scope == "user" and legacy.exists():
            out.append(f"{env.display(legacy)} exists: Continue ignores it once config.yaml exists; move what you need")
    elif client == "zed":
        if scope == "project":
            out.append("Zed reads language models only from the user settings: run `agentfold integrate zed --scope user` "
                       "to add the model too")
        else:
            out.append("Zed takes the API key from AGENTFOLD_API_KEY (any value works): export AGENTFOLD_API_KEY=agentfold; "
                       "then pick the model in the Agent Panel")
    elif client == "opencode":
        out.append(f"pick the model with /models in opencode, or run `opencode -m agentfold/{s.model}`")
    elif client == "aider":
        out.append("run `aider` " + ("in this folder" if scope == "project" else "anywhere"))
        if s.transport == "stdio":
            out.append("aider has no MCP support; --transport does not apply")
    if stdio:
        out.append("stdio: the client starts its own `agentfold mcp` process, which loads the model itself")
    return out


# --------------------------------------------------------------------------------------------
# JSON with comments: parse with positions, edit in place


class ConfigShapeError(Exception):
    """An existing file parses, but holds something else where AgentFold's entry goes."""

    def __init__(self, dotted: str, value: Any, wanted: str):
        super().__init__(f"`{dotted}` is {_kind(value)}, not {wanted}")


def _kind(value: Any) -> str:
    if hasattr(value, "unwrap"):  # a tomlkit item
        value = value.unwrap()
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


class _JsonSyntaxError(Exception):
    def __init__(self, message: str, text: str, pos: int):
        line = text.count("\n", 0, pos) + 1
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        super().__init__(f"line {line} column {column}: {message}")


@dataclass
class _JNode:
    kind: str  # object | array | scalar
    start: int
    end: int = 0
    value: Any = None
    members: list[tuple[str, int, _JNode]] = field(default_factory=list)  # (key, key start, value) for objects


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


class _JsoncParser:
    """JSON plus `//` and `/* */` comments and trailing commas (Zed, VS Code and opencode accept those)."""

    def __init__(self, text: str):
        self.text = text
        self.i = 0

    def fail(self, message: str, pos: int | None = None) -> None:
        raise _JsonSyntaxError(message, self.text, self.i if pos is None else pos)

    def skip(self) -> None:
        text, n = self.text, len(self.text)
        while self.i < n:
            c = text[self.i]
            if c in " \t\r\n\ufeff":
                self.i += 1
            elif text.startswith("//", self.i):
                end = text.find("\n", self.i)
                self.i = n if end < 0 else end + 1
            elif text.startswith("/*", self.i):
                end = text.find("*/", self.i + 2)
                if end < 0:
                    self.fail("unterminated /* comment")
                self.i = end + 2
            else:
                return

    def document(self) -> _JNode | None:
        self.skip()
        if self.i == len(self.text):
            return None
        node = self.value()
        self.skip()
        if self.i != len(self.text):
            self.fail("unexpected text after the end of the document")
        return node

    def value(self) -> _JNode:
        if self.i >= len(self.text):
            self.fail("unexpected end of file")
        c = self.text[self.i]
        if c == "{":
            return self.container("object", "}")
        if c == "[":
            return self.container("array", "]")
        start = self.i
        if c == '"':
            return _JNode("scalar", start, *self.string_end())
        for word, val in (("true", True), ("false", False), ("null", None)):
            if self.text.startswith(word, start):
                self.i = start + len(word)
                return _JNode("scalar", start, self.i, val)
        match = _NUMBER.match(self.text, start)
        if not match:
            self.fail(f"unexpected character {c!r}")
        self.i = match.end()
        return _JNode("scalar", start, self.i, json.loads(match.group()))

    def string_end(self) -> tuple[int, str]:
        try:
            value, end = json.decoder.scanstring(self.text, self.i + 1, True)
        except json.JSONDecodeError as error:
            self.fail(error.msg, error.pos)
        self.i = end
        return end, value

    def container(self, kind: str, close: str) -> _JNode:
        node = _JNode(kind, self.i, value={} if kind == "object" else [])
        self.i += 1
        self.skip()
        while self.i < len(self.text) and self.text[self.i] != close:
            if kind == "object":
                if self.text[self.i] != '"':
                    self.fail("expected a quoted key")
                key_start = self.i
                _, key = self.string_end()
                self.skip()
                if self.i >= len(self.text) or self.text[self.i] != ":":
                    self.fail("expected ':'")
                self.i += 1
                self.skip()
                child = self.value()
                node.members.append((key, key_start, child))
                node.value[key] = child.value
            else:
                child = self.value()
                node.members.append(("", child.start, child))
                node.value.append(child.value)
            self.skip()
            if self.i < len(self.text) and self.text[self.i] == ",":
                self.i += 1
                self.skip()
            elif self.i < len(self.text) and self.text[self.i] != close:
                self.fail(f"expected ',' or '{close}'")
        if self.i >= len(self.text):
            self.fail(f"missing '{close}'", node.start)
        self.i += 1
        node.end = self.i
        return node


def parse_jsonc(text: str) -> _JNode | None:
    return _JsoncParser(text).document()


def _line_indent(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    return re.match(r"[ \t]*", text[start:]).group()  # type: ignore[union-attr]


def _member(node: _JNode, key: str) -> _JNode | None:
    found = [child for k, _, child in node.members if k == key]
    return found[-1] if found else None  # duplicate keys: the last one wins, as in every JSON reader


def _json_set(text: str, root: _JNode, path: tuple[str, ...], value: Any, unit: str) -> str:
    """`text` with `path` set to `value`, everything else untouched (comments, order, layout)."""
    node = root
    for depth, key in enumerate(path):
        child = _member(node, key)
        if child is None:
            rest: Any = value
            for k in reversed(path[depth + 1:]):
                rest = {k: rest}
            return _json_insert(text, node, key, rest, unit)
        if depth == len(path) - 1:
            rendered = _json_render(value, _line_indent(text, child.start), unit)
            return text[:child.start] + rendered + text[child.end:]
        if child.kind != "object":
            raise ConfigShapeError(".".join(path[: depth + 1]), child.value, "an object")
        node = child
    raise AssertionError("empty path")


def _json_render(value: Any, base: str, unit: str) -> str:
    """`value` as indented JSON whose continuation lines start with `base`; short lists of scalars stay on one line."""
    if isinstance(value, dict) and value:
        inner = base + unit
        members = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_json_render(v, inner, unit)}" for k, v in value.items()]
        return "{\n" + ",\n".join(members) + "\n" + base + "}"
    if isinstance(value, list) and value:
        if not any(isinstance(v, (dict, list)) for v in value):
            flat = "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"
            if len(flat) <= 80:
                return flat
        inner = base + unit
        return "[\n" + ",\n".join(inner + _json_render(v, inner, unit) for v in value) + "\n" + base + "]"
    return json.dumps(value, ensure_ascii=False)


def _json_insert(text: str, node: _JNode, key: str, value: Any, unit: str) -> str:
    close = node.end - 1
    obj_indent = _line_indent(text, node.start)
    if not node.members:
        inner = text[node.start + 1:close]
        member_indent = obj_indent + unit
        member = json.dumps(key, ensure_ascii=False) + ": " + _json_render(value, member_indent, unit)
        if inner.strip() == "":
            return text[:node.start + 1] + "\n" + member_indent + member + "\n" + obj_indent + text[close:]
        return text[:node.start + 1] + "\n" + member_indent + member + text[node.start + 1:]  # comments inside {}
    last = node.members[-1][2]
    first_key_start = node.members[0][1]
    after = _JsoncParser(text)
    after.i = last.end
    after.skip()
    trailing_comma = text[after.i] == ","
    if "\n" not in text[node.start:first_key_start]:  # a one-line object: stay on one line
        member = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        return text[:close].rstrip() + ("" if trailing_comma else ",") + " " + member + text[close:]
    member_indent = _line_indent(text, first_key_start)
    member = member_indent + json.dumps(key, ensure_ascii=False) + ": " + _json_render(value, member_indent, unit) + ("," if trailing_comma else "")
    line_start = text.rfind("\n", 0, close) + 1
    if text[line_start:close].strip() == "" and line_start > last.end:
        insert_at, piece = line_start, member + "\n"
    else:
        insert_at, piece = close, "\n" + member + "\n" + obj_indent
    text = text[:insert_at] + piece + text[insert_at:]
    if not trailing_comma:
        text = text[:last.end] + "," + text[last.end:]
    return text


def _indent_unit(text: str, root: _JNode) -> str:
    if root.members and "\n" in text[root.start:root.members[0][1]]:
        unit = _line_indent(text, root.members[0][1])[len(_line_indent(text, root.start)):]
        if unit:
            return unit
    return "  "


# --------------------------------------------------------------------------------------------
# merging, per format


class _Missing:
    pass


MISSING = _Missing()


def _lookup(data: Any, path: Sequence[str | Named]) -> Any:
    for step in path:
        if isinstance(step, Named):
            if not isinstance(data, list):
                return MISSING
            data = next((item for item in data if isinstance(item, dict) and item.get("name") == step.name), MISSING)
        elif isinstance(data, dict) and step in data:
            data = data[step]
        else:
            return MISSING
        if data is MISSING:
            return MISSING
    return data


def _plain_set(data: Any, path: tuple[str | Named, ...], value: Any, dotted: str) -> Any:
    """Set `path` in plain data (dicts and lists); returns the (possibly new) root."""
    if not path:
        return copy.deepcopy(value)
    step, rest = path[0], path[1:]
    if isinstance(step, Named):
        if data is None:
            data = []
        if not isinstance(data, list):
            raise ConfigShapeError(dotted, data, "a list")
        for index, item in enumerate(data):
            if isinstance(item, dict) and item.get("name") == step.name:
                data[index] = _plain_set(item, rest, value, dotted)
                return data
        data.append(_plain_set(None, rest, value, dotted))
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigShapeError(dotted, data, "a mapping")
    data[step] = _plain_set(data.get(step), rest, value, dotted)
    return data


def _dotted(path: Sequence[str | Named]) -> str:
    return ".".join(f"[name={p.name}]" if isinstance(p, Named) else p for p in path) or "(top level)"


def _pending(data: Any, ops: Sequence[Op]) -> list[Op]:
    out = []
    for op in ops:
        existing = _lookup(data, op.path)
        if existing is MISSING or (not op.only_if_missing and existing != op.value):
            out.append(op)
    return out


def _merge_json(text: str | None, ops: Sequence[Op]) -> str:
    root = parse_jsonc(text) if text is not None else None
    if root is None:
        data: Any = None
        for op in ops:
            data = _plain_set(data, op.path, op.value, _dotted(op.path))
        prefix = text.rstrip() + "\n" if text and text.strip() else ""  # keep a file of only comments
        return prefix + _json_render(data or {}, "", "  ") + "\n"
    if root.kind != "object":
        raise ConfigShapeError("(top level)", root.value, "an object")
    unit = _indent_unit(text, root)  # type: ignore[arg-type]
    expected = copy.deepcopy(root.value)
    for op in _pending(root.value, ops):
        if any(isinstance(step, Named) for step in op.path):
            raise AssertionError("JSON targets do not merge lists")
        text = _json_set(text, root, op.path, op.value, unit)  # type: ignore[arg-type]
        expected = _plain_set(expected, op.path, op.value, _dotted(op.path))
        root = parse_jsonc(text)  # type: ignore[assignment,arg-type]
    if root.value != expected:  # the in-place edit must mean exactly the merge
        raise IntegrateError("internal error: the JSON edit did not produce the expected document; nothing written")
    return text  # type: ignore[return-value]


def _toml_table(value: dict, trailing: Sequence[Any] = ()) -> tomlkit.items.Table:
    table = tomlkit.table()
    for key, item in value.items():
        table.add(key, item)
    for item in trailing:
        table.add(item)
    if not trailing:
        table.add(tomlkit.nl())
    return table


def _merge_toml(text: str | None, ops: Sequence[Op]) -> str:
    doc = tomlkit.parse(text) if text else tomlkit.document()
    pending = _pending(doc.unwrap(), ops)
    if not pending:
        return text or ""
    for op in pending:
        parent: Any = doc
        for depth, step in enumerate(op.path[:-1]):
            if step not in parent:
                parent[step] = tomlkit.table(is_super_table=True)
            parent = parent[step]
            if not isinstance(parent, dict):
                raise ConfigShapeError(_dotted(op.path[: depth + 1]), parent, "a table")
        key = op.path[-1]
        old = parent.get(key)
        if isinstance(op.value, dict) and isinstance(parent, tomlkit.items.InlineTable):
            new = tomlkit.inline_table()
            new.update(op.value)
            parent[key] = new
        elif isinstance(op.value, dict):
            trailing: list[Any] = []  # comments and blank lines after the old entry belong to what follows
            if isinstance(old, tomlkit.items.Table):
                for k, item in reversed(old.value.body):
                    if k is not None:
                        break
                    trailing.insert(0, item)
            parent[key] = _toml_table(op.value, trailing)
        else:
            parent[key] = op.value
    out = tomlkit.dumps(doc)
    return out.rstrip("\n") + "\n"


class _YamlDumper(yaml.SafeDumper):
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:  # indent lists under their key
        return super().increase_indent(flow, False)


def _yaml_dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_YamlDumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=4096)


def _yaml_flat_edit(text: str, changes: dict[str, Any], expected: Any) -> str | None:
    """Top-level scalar keys set line by line, so the file's comments stay; None when that is not safe."""
    lines = text.splitlines(keepends=True)
    for key, value in changes.items():
        line = _yaml_dump({key: value})
        if line.count("\n") != 1:
            return None
        pattern = re.compile(rf"^{re.escape(key)}\s*:")
        hits = [i for i, existing in enumerate(lines) if pattern.match(existing)]
        if len(hits) > 1:
            return None
        if hits:
            lines[hits[0]] = line
        else:
            if lines and not lines[-1].endswith("\n"):
                lines[-1] += "\n"
            lines.append(line)
    out = "".join(lines)
    try:
        return out if yaml.safe_load(out) == expected else None
    except yaml.YAMLError:
        return None


def _merge_yaml(text: str | None, ops: Sequence[Op]) -> tuple[str, bool]:
    """The merged YAML, and whether comments had to be dropped (PyYAML cannot keep them)."""
    data = yaml.safe_load(text) if text else None
    root_is_list = bool(ops) and isinstance(ops[0].path[0], Named)
    if data is not None and not isinstance(data, list if root_is_list else dict):
        raise ConfigShapeError("(top level)", data, "a list" if root_is_list else "a mapping")
    pending = _pending(data, ops)
    if not pending:
        return text or "", False
    merged = copy.deepcopy(data)
    for op in pending:
        merged = _plain_set(merged, op.path, op.value, _dotted(op.path))
    if text and isinstance(data, dict) and all(len(op.path) == 1 and isinstance(op.path[0], str) for op in pending):
        flat = _yaml_flat_edit(text, {op.path[0]: op.value for op in pending}, merged)  # type: ignore[misc]
        if flat is not None:
            return flat, False
    had_comments = bool(text) and any(line.lstrip().startswith("#") for line in text.splitlines())  # type: ignore[union-attr]
    return _yaml_dump(merged), had_comments


_FORMAT_NAMES = {"json": "JSON", "toml": "TOML", "yaml": "YAML"}


def _syntax_detail(error: Exception) -> str:
    mark = getattr(error, "problem_mark", None)
    if mark is not None:  # PyYAML: the message spans lines; keep the gist
        problem = getattr(error, "problem", None) or "syntax error"
        return f"line {mark.line + 1} column {mark.column + 1}: {problem}"
    return " ".join(str(error).split())


@dataclass
class Change:
    target: Target
    old: str | None  # None: the file does not exist
    new: str
    warnings: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.old != self.new


def merge(target: Target, old: str | None) -> Change:
    """The new content of one file; IntegrateError (one line) if the existing file cannot be used."""
    name = _FORMAT_NAMES[target.fmt]
    warnings: list[str] = []
    crlf = old is not None and "\r\n" in old  # edit with \n, hand back the file's own line endings
    text = old.replace("\r\n", "\n") if crlf else old  # type: ignore[union-attr]
    try:
        if target.fmt == "json":
            new = _merge_json(text, target.ops)
        elif target.fmt == "toml":
            new = _merge_toml(text, target.ops)
        else:
            new, dropped = _merge_yaml(text, target.ops)
            if dropped:
                warnings.append(f"{target.display}: PyYAML cannot keep comments; they are in the backup")
    except (_JsonSyntaxError, tomlkit.exceptions.ParseError, yaml.YAMLError) as error:
        raise IntegrateError(f"{target.display} is not valid {name} ({_syntax_detail(error)}); "
                             "fix it and run again (nothing was written)") from None
    except ConfigShapeError as error:
        raise IntegrateError(f"{target.display}: {error}; fix it and run again (nothing was written)") from None
    if new == text:
        new = old  # type: ignore[assignment]  # nothing to do: not even line endings change
    elif crlf:
        new = new.replace("\n", "\r\n")
    return Change(target, old, new, warnings)


def _read(path: Path, display: str) -> str | None:
    if not path.exists():
        return None
    if not path.is_file():
        raise IntegrateError(f"{display} is not a regular file; nothing was written")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise IntegrateError(f"{display} is not UTF-8 text; fix it and run again (nothing was written)") from None


def plan(client: str, env: Env) -> list[Change]:
    """Read and merge every file of `client` at `env.scope`; writes nothing."""
    return [merge(target, _read(target.path, target.display)) for target in targets(client, env)]


def diff(change: Change) -> str:
    display = change.target.display
    old_lines = (change.old or "").splitlines(keepends=True)
    new_lines = change.new.splitlines(keepends=True)
    lines = difflib.unified_diff(old_lines, new_lines, "/dev/null" if change.old is None else display, display)
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def _backup_path(path: Path) -> Path:
    candidate = path.with_name(path.name + ".bak")
    if not candidate.exists():
        return candidate
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        candidate = path.with_name(f"{path.name}.{stamp}{'' if n == 0 else f'-{n}'}.bak")
        if not candidate.exists():
            return candidate
    raise IntegrateError(f"cannot find a free backup name for {path}")


def write(change: Change) -> Path | None:
    """Write one changed file atomically (through a symlink, to its target); returns the backup made."""
    path = Path(os.path.realpath(change.target.path))
    path.parent.mkdir(parents=True, exist_ok=True)
    backup = None
    if change.old is not None:
        backup = _backup_path(path)
        shutil.copy2(path, backup)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(change.new)
            handle.flush()
            os.fsync(handle.fileno())
        if change.old is not None:
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return backup


# --------------------------------------------------------------------------------------------
# the command


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `integrate` to an argparse subparsers object; the handler is `run(args)`."""
    parser = subparsers.add_parser(
        "integrate", help="wire AgentFold into a coding assistant's config",
        description="Write AgentFold (model provider and MCP server) into a coding assistant's config files, "
                    "merging with what is there, keeping a backup and printing a diff.",
    )
    parser.add_argument("client", choices=CLIENTS, help="the coding assistant")
    parser.add_argument("--scope", choices=SCOPES, default="project",
                        help="project: files in --project-dir (default); user: files under --home")
    parser.add_argument("--transport", choices=TRANSPORTS, default="http",
                        help="MCP transport: http (the running server's /mcp, default) or stdio "
                             "(the client starts `agentfold mcp --model PATH`)")
    parser.add_argument("--dry-run", action="store_true", help="write nothing; print each resulting file and the diff")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the AgentFold server (default {DEFAULT_BASE_URL})")
    parser.add_argument("--model", help="model name to configure (default: the first of the server's /v1/models)")
    parser.add_argument("--model-path", help="checkpoint for `agentfold mcp --model` (needed with --transport stdio)")
    parser.add_argument("--context-length", type=int,
                        help=f"context window to declare (default: from /v1/models, else {DEFAULT_CONTEXT_LENGTH})")
    parser.add_argument("--project-dir", default=".", help="the project folder (default: the current folder)")
    parser.add_argument("--home", help="the home folder for --scope user (default: ~)")
    parser.set_defaults(handler=run)
    return parser


def _say(message: str) -> None:
    print(f"[agentfold] {message}", file=sys.stderr, flush=True)


def _resolve_settings(args: argparse.Namespace) -> tuple[Settings, str]:
    base_url = normalize_base_url(args.base_url)
    context = args.context_length
    if args.model:
        model, source = args.model, "--model"
    else:
        found = fetch_model(base_url)
        model, source = found.id, f"{base_url}/v1/models"
        context = context or found.context_length
        if found.others:
            source += f"; it also lists {', '.join(found.others)} (choose with --model)"
    if context is not None and context <= 0:
        raise IntegrateError("--context-length must be positive")
    model_path = None
    if args.transport == "stdio" and args.client not in NO_MCP + UI_ONLY:
        if not args.model_path:
            raise IntegrateError("--transport stdio needs --model-path PATH: the checkpoint `agentfold mcp` loads")
        resolved = Path(args.model_path).expanduser().resolve()
        if not resolved.exists():
            raise IntegrateError(f"--model-path {args.model_path}: no such file or folder")
        model_path = str(resolved)
    command = shutil.which("agentfold") or "agentfold"
    settings = Settings(base_url, model, context or DEFAULT_CONTEXT_LENGTH, args.transport, model_path, command)
    return settings, source


def _env(args: argparse.Namespace, settings: Settings) -> Env:
    project = Path(args.project_dir).expanduser().resolve()
    if args.scope == "project" and not project.is_dir():
        raise IntegrateError(f"--project-dir {args.project_dir}: no such folder")
    home = Path(args.home).expanduser().resolve() if args.home else Path.home()
    xdg = os.environ.get("XDG_CONFIG_HOME") if not args.home else None
    return Env(settings, project, home, sys.platform, Path(xdg) if xdg else None, args.scope)


def run(args: argparse.Namespace) -> int:
    """Handler of `agentfold integrate`; returns the exit status (1 on any refusal, with one line on stderr)."""
    try:
        return _run(args)
    except IntegrateError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"{PROG}: error: {error.strerror or error}: {error.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    settings, source = _resolve_settings(args)
    env = _env(args, settings)
    client, scope = args.client, args.scope
    _say(f"{client}: model {settings.model!r} (from {source}), server {settings.base_url}, "
         f"{scope} scope" + ("" if client in NO_MCP + UI_ONLY else f", MCP over {settings.transport}"))
    if client in UI_ONLY:
        sys.stdout.write(render_readme(client, settings))
        _say(f"{client} is configured in its settings UI: use the values above (nothing was written)")
        return 0
    changes = plan(client, env)  # every file is read and merged before any is written
    for change in changes:
        for warning in change.warnings:
            _say(f"warning: {warning}")
    if args.dry_run:
        for change in changes:
            state = "unchanged" if not change.changed else ("new file" if change.old is None else "changed")
            sys.stdout.write(f"=== {change.target.display} ({state}; dry run, not written) ===\n")
            sys.stdout.write(change.new if change.new.endswith("\n") or not change.new else change.new + "\n")
            sys.stdout.write(diff(change))
        _say("dry run: nothing was written")
    else:
        for change in changes:
            if not change.changed:
                _say(f"{change.target.display}: already up to date")
                continue
            sys.stdout.write(diff(change))
            backup = write(change)
            if backup is None:
                _say(f"{change.target.display}: created")
            else:
                _say(f"{change.target.display}: updated (backup {env.display(backup)})")
    for note in notes(client, env):
        _say(note)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agentfold.integrations.writer CLIENT ...`, the same as `agentfold integrate CLIENT ...`."""
    parser = argparse.ArgumentParser(prog="agentfold")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["integrate", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
