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

Wired into the CLI by `agentfold.cli` through `add_parser(subparsers)` and `run(args)`. This module is
the command itself (arguments, reading, backups, writing, messages); the rest of the package holds the
pieces it drives: `settings` and `server_model` (what to configure), `templates` and `clients` (which
files, with what), `merge` with `jsonc`, `toml_merge` and `yaml_merge` (the per-format merging),
`edits` (the format-independent ops), `notes` (what to tell the user), `errors` (the refusals).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentfold.integrations.clients import CLIENTS, NO_MCP, UI_ONLY, Env, targets
from agentfold.integrations.errors import IntegrateError
from agentfold.integrations.merge import Change, merge
from agentfold.integrations.notes import context_warning, notes
from agentfold.integrations.server_model import fetch_model
from agentfold.integrations.settings import DEFAULT_BASE_URL, DEFAULT_CONTEXT_LENGTH, Settings, normalize_base_url
from agentfold.integrations.templates import render_readme

SCOPES = ("project", "user")
TRANSPORTS = ("http", "stdio")
PROG = "agentfold integrate"


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
    """The unified diff of one change, as printed (marks a missing final newline like `diff` does)."""
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


def _resolve_settings(args: argparse.Namespace) -> tuple[Settings, str, int | None]:
    """The settings, where the model name came from, and the served (or declared) context if known."""
    base_url = normalize_base_url(args.base_url)
    context, served = args.context_length, None
    if args.model:
        model, source = args.model, "--model"
    else:
        found = fetch_model(base_url)
        model, source, served = found.id, f"{base_url}/v1/models", found.context_length
        context = context or served
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
    return settings, source, served or context


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
    settings, source, known_context = _resolve_settings(args)
    env = _env(args, settings)
    client, scope = args.client, args.scope
    _say(f"{client}: model {settings.model!r} (from {source}), server {settings.base_url}, "
         f"{scope} scope" + ("" if client in NO_MCP + UI_ONLY else f", MCP over {settings.transport}"))
    too_small = context_warning(client, known_context, settings.model)
    if too_small:
        _say(f"warning: {too_small}")
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
