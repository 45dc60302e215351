"""What every command shares: the program name, the exit codes, the one-line error, the help format."""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

PROG = "megatron-rl-patches"

# Every command: 0 ok, 1 a problem found (or a step failed), 2 usage error.
OK, PROBLEM, USAGE = 0, 1, 2


class UsageError(Exception):
    """Raised by a command's `run` for bad arguments: one stderr line, exit code 2."""


def say(command: str, message: str) -> None:
    """One stderr line naming the program and the command."""
    print(f"{PROG} {command}: {message}", file=sys.stderr)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (unless it is None or False) and keeps the epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or any(action.default is hidden for hidden in (None, False, argparse.SUPPRESS)):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def names_option(word: str, option: str) -> bool:
    """Whether `word` names `option` (a long option, e.g. '--api-key') as argparse or vLLM's parser may
    read it, or echo it with its value where it reads no such option: '--' then the name or an
    abbreviation of it, in any case, '_' for '-', '=VALUE' or vLLM's '.FIELD' after it."""
    if not word.startswith("--"):
        return False
    name = word.lstrip("-").split("=", 1)[0].split(".", 1)[0].replace("_", "-").lower()
    return bool(name) and option.lstrip("-").startswith(name)


def secret_values(words: Sequence[str], options: Sequence[str]) -> list[str]:
    """The values `words` give the secret `options` in any spelling (`names_option`): after '=' in
    the word, or the word after it."""
    values = []
    for at, word in enumerate(words):
        if any(names_option(word, option) for option in options):
            if "=" in word:
                values.append(word.split("=", 1)[1])
            elif at + 1 < len(words):
                values.append(words[at + 1])
    return [value for value in values if value]


def without_values(text: str, values: Sequence[str]) -> str:
    """`text` with each of `values` shown as '…' (a word of its own, after '=', or anywhere)."""
    for value in sorted(values, key=len, reverse=True):
        text = re.sub(rf"(?<![^\s=]){re.escape(value)}(?!\S)", "…", text)
        if len(value) >= 3:
            text = text.replace(value, "…")
    return text
