"""The documentation is checked: command lines parse, links and named files exist, headline figures
equal their JSON.

What is checked, in README.md, docs/*.md and integrations/README.md:

- **Command lines.** Every `agentfold ...` command in a fenced `bash` / `sh` block (a line, or a
  segment after `&&`, `;`, `--` of `mlx.launch`; `.venv/bin/`, leading `VAR=value` assignments,
  a trailing `&` and `# comments` are stripped; lines ending in `\\` and indented lines that start
  with `[` or `--` continue the previous command) and every inline code span that starts with
  `agentfold ` or `.venv/bin/agentfold `, read by the real parser (`agentfold.cli._build_parser`):
  - a *synopsis* (it contains `[`, `]`, `(`, `)`, `{`, `}`, `|` or `...`, or an upper-case
    placeholder such as `CLIENT` or `TURN_ID` in a positional place): each sub-command named must
    exist (`a|b` alternatives: each one) and each `--flag` must be an option of it;
  - a *reference* (only the program or sub-command names, e.g. `agentfold bench decode`): the
    sub-command exists;
  - any other line is *concrete* and must parse. An upper-case placeholder (`FILE`, `N`,
    `ADDR:PORT`, `FILE.json`) after an option is replaced by a value of that option's type
    (`1` for int, `0.5` for float, the first choice for choices), else kept as it is.
- **Links.** Every relative Markdown link or image target (`[text](path)`, without its
  `#anchor`) exists, relative to the file that links it.
- **Named files.** Every `bench-results/...` name anywhere in the text, and every path in a code
  span that starts with a top-level folder (`agentfold/`, `engine/`, `kernels/`, `sessions/`,
  `tests/`, `integrations/`, `docs/`, `bench-results/`, `.ci/`), exists in the repository.
- **Headline figures.** In README.md, between `<!-- headline:start -->` and
  `<!-- headline:end -->`, each table row links one JSON file under `bench-results/`; each cell
  holding `<!-- json: PATH[, PATH...] -->` has as many numbers (before the comment) as paths, and
  each number equals the JSON value at its path rounded to the number's decimals (`PATH*100` for a
  percentage of a fraction). A row's `--out` names its JSON. To change a figure, change the JSON
  and the cell together; the path next to it says where the test looks.

Each kind of check is also shown to fail on a deliberately broken copy of the text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "integrations" / "README.md"]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
TOP_FOLDERS = ("agentfold", "engine", "kernels", "sessions", "tests", "integrations", "docs", "bench-results", ".ci")
SYNOPSIS_MARKS = ("[", "]", "(", ")", "{", "}", "|", "...")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?::[A-Z][A-Z0-9_]*)?(?:\.[a-z]+)?$")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@contextmanager
def _no_agentfold_env() -> Iterator[None]:
    """The parser reads `AGENTFOLD_*` defaults when it is built: build it without them."""
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("AGENTFOLD_")]}
    try:
        yield
    finally:
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    from agentfold.cli import _build_parser

    with _no_agentfold_env():
        return _build_parser()


# --- finding command lines ---


def _code_blocks(text: str) -> Iterator[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block."""
    lang, lines, inside = "", [], False
    for line in text.splitlines():
        fence = re.match(r"^\s*```+\s*([\w+-]*)", line)
        if fence and not inside:
            lang, lines, inside = fence.group(1).lower(), [], True
        elif fence and inside:
            yield lang, lines
            inside = False
        elif inside:
            lines.append(line)


def _joined(lines: list[str]) -> list[str]:
    """Lines with `\\` continuations and indented synopsis continuations joined."""
    out: list[str] = []
    for line in lines:
        stripped = line.strip()
        if out and (out[-1].endswith("\\") or (line[:1].isspace() and stripped[:1] in ("[", "-"))):
            out[-1] = out[-1].rstrip("\\").rstrip() + " " + stripped
        else:
            out.append(line.rstrip())
    return out


def _command_of(segment: str) -> str | None:
    """`agentfold ...` from one shell segment, or None when the segment runs something else."""
    words = segment.strip().split()
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if words and words[0] == "mlx.launch" and "--" in words:
        words = words[words.index("--") + 1:]
    if not words or not (words[0] == "agentfold" or words[0].endswith("/agentfold")):
        return None
    if words[-1] == "&":
        words = words[:-1]
    return " ".join(["agentfold", *words[1:]]).rstrip("&").rstrip()


def _strip_comment(line: str) -> str:
    return re.split(r"(?:^|\s)#(?:\s|$)", line, maxsplit=1)[0]


def command_lines(text: str) -> list[str]:
    """Every `agentfold ...` command line of the text (see the module's docstring)."""
    found = []
    for lang, lines in _code_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        for line in _joined(lines):
            for segment in re.split(r"&&|;|\|\|", _strip_comment(line).lstrip("$ ")):
                if (command := _command_of(segment)) is not None:
                    found.append(command)
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", outside):
        if re.match(r"^(?:\.venv/bin/)?agentfold(?:\s|$)", span) and (command := _command_of(span)):
            found.append(command)
    return found


# --- checking command lines against the parser ---


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _walk(parser: argparse.ArgumentParser, words: list[str]) -> tuple[list[argparse.ArgumentParser], list[str], str]:
    """The parsers the leading sub-command words name (several for `a|b`), the words after them,
    and a problem ('' if none)."""
    current = [parser]
    while words and not words[0].startswith("-") and (subs := _subparsers(current[0])):
        if PLACEHOLDER.match(words[0]):
            break  # `agentfold COMMAND --help`: any sub-command
        names = words[0].split("|")
        if any(name not in subs for name in names):
            return current, words, f"unknown sub-command {words[0]!r}"
        current = [subs[name] for name in names]
        words = words[1:]
    return current, words, ""


def _placeholder_value(action: argparse.Action | None, word: str) -> str:
    if action is None or not PLACEHOLDER.match(word):
        return word
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type is int:
        return "1"
    if action.type is float:
        return "0.5"
    return word


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """'' if argv parses (or exits 0, as --version does), else argparse's message."""
    class Refused(Exception):
        pass

    def error(message: str) -> None:
        raise Refused(message)

    parsers = [parser]
    while parsers:
        p = parsers.pop()
        p.error = error  # type: ignore[method-assign]
        parsers.extend(_subparsers(p).values())
    try:
        with _no_agentfold_env(), open(os.devnull, "w") as null:
            stdout, sys.stdout = sys.stdout, null
            try:
                parser.parse_args(argv)
            finally:
                sys.stdout = stdout
    except Refused as refused:
        return str(refused)
    except SystemExit as done:
        return "" if done.code in (0, None) else f"exit {done.code}"
    return ""


def check_command(parser: argparse.ArgumentParser, line: str) -> str:
    """'' if the documented command line agrees with the parser, else what is wrong."""
    try:
        words = shlex.split(line)[1:]
    except ValueError as bad:
        return f"{line}: {bad}"
    leaves, rest, problem = _walk(parser, words)
    if problem:
        return f"{line}: {problem}"
    options = _options(leaves[0])
    bare = [w for i, w in enumerate(rest) if PLACEHOLDER.match(w) and not (i and rest[i - 1] in options)]
    if any(mark in line for mark in SYNOPSIS_MARKS) or bare:
        flags = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", " ".join(words)))
        known = set().union(*(_options(leaf) for leaf in leaves))
        unknown = sorted(flags - known)
        return f"{line}: not an option of it: {', '.join(unknown)}" if unknown else ""
    if not rest:
        return ""  # the program or a sub-command, named
    argv = [_placeholder_value(options.get(words[i - 1]) if i else None, w) for i, w in enumerate(words)]
    message = _parse(parser, argv)
    return f"{line}: {message}" if message else ""


# --- links, named files, headline figures ---


def check_links(text: str, base: Path) -> list[str]:
    problems = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^(?:[a-z]+:|#)", target):
            continue
        path = (base / target.split("#", 1)[0]).resolve()
        if not path.exists():
            problems.append(f"link {target}: no such file ({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
    return problems


def check_named_files(text: str) -> list[str]:
    names = set(re.findall(r"bench-results/[\w./-]*\w", text))
    folders = "|".join(re.escape(f) for f in TOP_FOLDERS)
    for span in re.findall(r"`([^`\n]+)`", text):
        for name in re.findall(rf"(?<![\w./~<-])(?:{folders})/[\w./-]*", span):
            if not any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in name.split("/")):
                names.add(name.rstrip("./"))
    return [f"named file {name}: not in the repository" for name in sorted(names) if not (ROOT / name).exists()]


def _json_value(data: object, path: str) -> float:
    scale = 1.0
    if "*" in path:
        path, factor = path.split("*", 1)
        scale = float(factor)
    value = data
    for part in re.findall(r"[^.\[\]]+", path.strip()):
        value = value[int(part)] if isinstance(value, list) else value[part]  # type: ignore[index]
    return float(value) * scale  # type: ignore[arg-type]


def headline_rows(text: str) -> list[str]:
    match = re.search(r"<!-- headline:start -->(.*?)<!-- headline:end -->", text, re.S)
    if not match:
        return []
    return [line for line in match.group(1).splitlines() if line.startswith("|") and "bench-results/" in line]


def check_headline(text: str, root: Path = ROOT) -> list[str]:
    rows = headline_rows(text)
    if not rows:
        return ["README.md: no headline table between <!-- headline:start --> and <!-- headline:end -->"]
    problems = []
    for row in rows:
        files = sorted(set(re.findall(r"\]\((bench-results/[\w./-]+\.json)\)", row)))
        if len(files) != 1:
            problems.append(f"headline row links {len(files)} JSON files, not 1: {row}")
            continue
        if not (root / files[0]).exists():
            problems.append(f"headline row: {files[0]} does not exist")
            continue
        data = json.loads((root / files[0]).read_text())
        outs = re.findall(r"--out\s+([^\s`|]+)", row)
        if outs and outs[0] != files[0]:
            problems.append(f"headline row: the command writes {outs[0]}, the row links {files[0]}")
        cells = [cell for cell in row.split("|") if "<!-- json:" in cell]
        if not cells:
            problems.append(f"headline row has no <!-- json: PATH --> cell: {row}")
        for cell in cells:
            shown, paths = cell.split("<!-- json:", 1)
            paths_list = [p.strip() for p in paths.split("-->", 1)[0].split(",")]
            numbers = NUMBER.findall(re.sub(r"<!--.*?-->", "", shown))
            if len(numbers) != len(paths_list):
                problems.append(f"{files[0]}: {len(numbers)} numbers for {len(paths_list)} paths in {cell.strip()!r}")
                continue
            for number, path in zip(numbers, paths_list, strict=True):
                try:
                    value = _json_value(data, path)
                except (KeyError, IndexError, TypeError, ValueError):
                    problems.append(f"{files[0]}: no number at {path}")
                    continue
                decimals = len(number.split(".", 1)[1]) if "." in number else 0
                if float(number.replace(",", "")) != round(value, decimals):
                    problems.append(f"{files[0]}: {path} is {value}, the README says {number}")
    return problems


def _problems(path: Path, text: str | None = None) -> list[str]:
    text = path.read_text() if text is None else text
    parser = build_parser()
    found = [check_command(parser, line) for line in command_lines(text)]
    found += check_links(text, path.parent) + check_named_files(text)
    return [f"{path.relative_to(ROOT)}: {p}" for p in found if p]


# --- the checks on the real documents ---


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_links_and_files(path: Path) -> None:
    assert _problems(path) == []


def test_changelog_links_and_files() -> None:
    """The changelog's history may name commands that changed since; its links and files must exist."""
    path = ROOT / "CHANGELOG.md"
    assert check_links(path.read_text(), path.parent) + check_named_files(path.read_text()) == []


def test_headline_figures_equal_their_json() -> None:
    assert check_headline((ROOT / "README.md").read_text()) == []


def test_readme_opens_with_the_two_commands_and_stays_short() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.startswith(
        "```bash\n"
        'bash .ci/setup.sh && .venv/bin/agentfold generate "Write a Python function that reverses a string."\n'
        ".venv/bin/python -m pytest -q\n"
        "```\n")
    assert ".venv/bin/python -m pytest -q -m slow" in text
    assert len(text.splitlines()) <= 200


def test_documents_are_found() -> None:
    """The checks above see real commands, links and figures (an empty scan would pass anything)."""
    readme = (ROOT / "README.md").read_text()
    assert len(command_lines(readme)) >= 5
    assert len(headline_rows(readme)) >= 5
    assert sum(len(command_lines(p.read_text())) for p in DOCS) >= 50


# --- each check fails on a broken copy ---


def test_a_broken_command_line_is_reported() -> None:
    parser = build_parser()
    assert check_command(parser, "agentfold serve --model coder --port 9000") == ""
    assert "--no-such-flag" in check_command(parser, "agentfold serve --model coder --no-such-flag")
    assert check_command(parser, "agentfold bench decode --out") != ""  # --out needs a value
    assert check_command(parser, "agentfold integrate claude-cod") != ""  # not a choice
    assert check_command(parser, "agentfold servve --port 1") != ""
    assert "--nope" in check_command(parser, "agentfold serve [--nope N]")  # synopsis: flags are real
    assert check_command(parser, "agentfold sessions list|show|nope") != ""
    assert check_command(parser, "agentfold serve --port N") == ""  # a placeholder of an int option
    broken = (ROOT / "README.md").read_text().replace("agentfold integrate claude-code",
                                                     "agentfold integrate claude-code --scoop user", 1)
    assert any("--scoop" in p for p in _problems(ROOT / "README.md", broken))


def test_a_broken_link_is_reported() -> None:
    text = (ROOT / "README.md").read_text()
    target = re.search(r"\]\((docs/[\w-]+\.md)\)", text)
    assert target
    broken = text.replace(target.group(1), target.group(1).replace(".md", "-gone.md"), 1)
    assert any("-gone.md: no such file" in p for p in _problems(ROOT / "README.md", broken))


def test_a_missing_benchmark_file_is_reported() -> None:
    assert check_named_files("see bench-results/decode-coder-xeon.json") == []
    assert check_named_files("see bench-results/decode-coder-nowhere.json") != []
    assert check_named_files("`engine/no_such_module.py` does it") != []
    text = (ROOT / "docs" / "performance.md").read_text()
    broken = text.replace("bench-results/lanes-amd-epyc-32.json", "bench-results/lanes-amd-epyc-33.json")
    assert any("lanes-amd-epyc-33.json" in p for p in _problems(ROOT / "docs" / "performance.md", broken))


def test_a_changed_figure_is_reported() -> None:
    text = (ROOT / "README.md").read_text()
    row = headline_rows(text)[0]
    cell = next(cell for cell in row.split("|") if "<!-- json:" in cell)
    shown = NUMBER.findall(cell.split("<!-- json:", 1)[0])[0]
    changed = row.replace(cell, cell.replace(shown, f"{float(shown.replace(',', '')) + 1:g}", 1))
    assert changed != row
    assert check_headline(text.replace(row, changed)) != []
    wrong_path = re.sub(r"(<!-- json: )[^,>]*", r"\1no.such.path ", row, count=1)
    assert any("no number at no.such.path" in p for p in check_headline(text.replace(row, wrong_path)))


# --- the documentation site ---


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
