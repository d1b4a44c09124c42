"""`AGENTFOLD_<FLAG>` environment variables as defaults for a command's options.

Containers, systemd units and launchers set environment variables more easily than they edit a
command line, so every `serve` option has one: `--ctx-size` is `AGENTFOLD_CTX_SIZE`, `--no-draft`
is `AGENTFOLD_NO_DRAFT=1`, a repeatable one takes a comma-separated list. They only change the
defaults, so the command line wins (a repeatable option's command-line values are added). A bad value is not reported while the parser is built (that
would break every other command); it is kept, and `check_env` raises it as one readable line.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

PREFIX = "AGENTFOLD_"
EPILOG = ("Every option can also be set with an environment variable AGENTFOLD_<OPTION> (e.g. AGENTFOLD_PORT=9000, "
          "AGENTFOLD_MODEL=gemma3, AGENTFOLD_CTX_SIZE=16384, AGENTFOLD_NO_DRAFT=1); the command line wins. A "
          "repeatable option takes a comma-separated list, which the command line's values add to.")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_name(option: str) -> str:
    """`--ctx-size` -> `AGENTFOLD_CTX_SIZE`."""
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def _convert(action: argparse.Action, name: str, raw: str) -> Any:
    """The value `raw` stands for, checked the way the command line would check it."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if raw.strip().lower() not in (*_TRUE, *_FALSE):
            raise ValueError(f"{name}={raw!r}: expected 1/true/yes/on or 0/false/no/off")
        return (raw.strip().lower() in _TRUE) == isinstance(action, argparse._StoreTrueAction)
    values = [v.strip() for v in raw.split(",") if v.strip()] if isinstance(action, argparse._AppendAction) else [raw]
    converted = []
    for value in values:
        try:
            item = action.type(value) if action.type else value
        except (TypeError, ValueError):
            kind = getattr(action.type, "__name__", "value")
            raise ValueError(f"{name}={raw!r}: not a valid {kind} for {action.option_strings[-1]}") from None
        if action.choices is not None and item not in action.choices:
            raise ValueError(f"{name}={raw!r}: {action.option_strings[-1]} must be one of "
                             f"{', '.join(map(str, action.choices))}")
        converted.append(item)
    return converted if isinstance(action, argparse._AppendAction) else converted[0]


class _BadValue:
    """The default an option gets from a bad variable: harmless if the command line sets the option.
    (Not a str: argparse would run the option's type on a str default and print its usage.)"""

    def __init__(self, message: str) -> None:
        self.message = message

    def __str__(self) -> str:
        return self.message


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Make each set `AGENTFOLD_<OPTION>` the default of its option; bad values wait for `check_env`."""
    environ = os.environ if environ is None else environ
    defaults: dict[str, Any] = {}
    errors: list[str] = []  # bad values of repeatable options: the command line adds to them, so always bad
    for action in parser._actions:
        long_options = [o for o in action.option_strings if o.startswith("--") and o not in ("--help", "--version")]
        name = env_name(long_options[0]) if long_options else None
        if name is None or name not in environ:
            continue
        try:
            defaults[action.dest] = _convert(action, name, environ[name])
        except ValueError as error:
            if isinstance(action, argparse._AppendAction):
                errors.append(str(error))
            else:
                defaults[action.dest] = _BadValue(str(error))
    parser.set_defaults(**defaults, env_errors=errors)
    parser.epilog = EPILOG


def check_env(args: argparse.Namespace) -> None:
    """Raise the first bad `AGENTFOLD_*` value the command line did not override, as one line (exit 2)."""
    bad = [str(v) for v in vars(args).values() if isinstance(v, _BadValue)]
    errors = [*(getattr(args, "env_errors", None) or []), *bad]
    if errors:
        raise ValueError(errors[0])
