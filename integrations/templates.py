"""The snippets under `integrations/<client>/`, read as package data and filled in.

Each client folder holds its config fragments (JSON / TOML / YAML) and a README with
`{{PLACEHOLDER}}`s; this module is the one place that knows how they are found and filled.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

import tomlkit
import yaml

from agentfold.integrations.errors import IntegrateError
from agentfold.integrations.settings import Settings

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
    """The raw text of `integrations/<client>/<name>`, placeholders and all."""
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
    """The client's README with the placeholders it has values for filled in (printed for UI-only clients)."""
    values = settings.placeholders()
    return _PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), m.group(0))), template_text(client, "README.md"))
