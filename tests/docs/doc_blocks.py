"""The fenced blocks of README.md and docs/*.md, each classified as the docs test treats it.

A block is one of:
- `python`: pasted alone into a fresh interpreter; a `# fragment: uses NAME, ...` block is run in a
  fresh interpreter of its page's fragments, given exactly the names it lists (doc_fresh.py);
- `signatures`: a listing of public call signatures, compared with the real functions;
- `cli`: `$ ` lines calling the package's CLI (`megatron-rl-patches ...`, `python -m
  megatron_rl_patches ...`) or an example (`python examples/...`), the clone's environment's
  (`.venv/bin/`) or not, each followed by the output it shows; run as pasted in a fresh shell with
  no environment on PATH (doc_shell.py: a bare `python` / `megatron-rl-patches` fails) and compared;
- `output`: what the previous runnable block of the page prints (marker `docs-test: output`), or
  what a named producer of the test prints (marker `docs-test: output-of: NAME`);
- `skip`: marked `<!-- docs-test: skip: reason -->` on the line above the fence;
- `unmarked`: none of these; the docs test fails on it.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
# what a `$ ` line of a cli block calls: the CLI or an example, with the clone's environment or bare
# (bare ones are run too, and fail: doc_shell.py)
CLI_PROGRAMS = tuple(prefix + program for prefix in (".venv/bin/", "")
                     for program in ("megatron-rl-patches ", "python -m megatron_rl_patches ", "python examples/",
                                     "python3 examples/"))
SHELL_LANGS = ("bash", "console", "text", "sh", "shell", "")
FRAGMENT = re.compile(r"^# fragment: uses (?P<names>[\w, ]+?)(?: \(.*\))?$")


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository, e.g. "docs/logprobs.md"
    line: int  # 1-based line of the opening fence
    lang: str
    text: str  # the block's content, dedented by the fence's indentation
    kind: str  # python | signatures | cli | output | skip | unmarked
    detail: str = ""  # skip: the reason; output: "" (previous block) or the producer's name

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def fragment_names(text: str) -> list[str]:
    """The names a python block's `# fragment: uses NAME, ...` first line lists ([]: none)."""
    marker = FRAGMENT.match(text.splitlines()[0] if text.strip() else "")
    return [name.strip() for name in marker.group("names").split(",")] if marker else []


def doc_pages() -> list[Path]:
    """README.md and every page under docs/, in a fixed order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _marker(lines: list[str], fence_index: int) -> str | None:
    """The body of a `docs-test:` marker on the nearest non-blank line above the fence."""
    i = fence_index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i < 0:
        return None
    found = MARKER.match(lines[i])
    return found.group("body") if found else None


def is_cli_block(lang: str, text: str) -> bool:
    """Shell-ish block whose commands are all prompted (`$ `) calls of our CLI, with some output."""
    if lang not in SHELL_LANGS:
        return False
    lines = [line for line in text.splitlines() if line.strip()]
    commands = [line[2:] for line in lines if line.startswith("$ ")]
    if not commands or len(commands) == len(lines):
        return False
    return all(_cli_argv_start(command) is not None for command in commands)


def _cli_argv_start(command: str) -> str | None:
    """The program a command line calls (the CLI or an example), after any `NAME=value` prefix."""
    words = command.split()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)
    rest = " ".join(words) + " "
    for program in CLI_PROGRAMS:
        if rest.startswith(program):
            return program
    return None


def classify(lang: str, text: str, marker: str | None) -> tuple[str, str]:
    if marker is not None:
        name, _, rest = marker.partition(":")
        name, rest = name.strip(), rest.strip()
        if name in ("skip", "output-of", "output", "signatures"):
            kind = "output" if name == "output-of" else name
            return kind, rest
        return "unmarked", f"unknown docs-test marker {marker!r}"
    if lang == "python":
        return "python", ""
    if is_cli_block(lang, text):
        return "cli", ""
    return "unmarked", ""


def page_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    page = path.relative_to(REPO).as_posix()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.group("indent"), opening.group("lang")
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: a fence that is never closed")
        body = [line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1 : end]]
        text = textwrap.dedent("\n".join(body)) + "\n"
        kind, detail = classify(lang, text, _marker(lines, i))
        blocks.append(Block(page, i + 1, lang, text, kind, detail))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in doc_pages() for block in page_blocks(path)]
