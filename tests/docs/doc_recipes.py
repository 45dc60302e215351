"""docs/recipes.md's framework blocks read as a user pastes them: a section's blocks, a job's
variables (the JSON a `ray job submit --runtime-env-json` and slime's `--train-env-vars` take), the
flags after `--`, and the `key=value` overrides of a Hydra command line (verl's, NeMo-RL's)."""
from __future__ import annotations

import json
import re
import shlex

from doc_blocks import REPO, Block, page_blocks
from doc_servers import commands

RECIPES = REPO / "docs" / "recipes.md"
SHARED_PREFIX = "## A group's prompt once: shared-prefix packing"


def section_blocks(heading: str, page=RECIPES) -> list[Block]:
    """The blocks under the line `heading` (`## ...` or `### ...`), up to the next heading of its level or above."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading) + 1
    level = len(heading.split(" ", 1)[0])
    end, fenced = len(lines), False
    for i in range(start, len(lines)):
        fenced ^= lines[i].startswith("```")
        marks = lines[i].split(" ", 1)[0]
        if not fenced and marks and set(marks) == {"#"} and len(marks) <= level:
            end = i
            break
    return [b for b in page_blocks(page) if start < b.line <= end]


def runtime_env(command: str) -> dict[str, str]:
    """The `env_vars` of a `ray job submit --runtime-env-json=...` command, `$ENV` read from `env_line`."""
    words = shlex.split(command)
    given = next(w.split("=", 1)[1] for w in words if w.startswith("--runtime-env-json="))
    return json.loads(given)["env_vars"]


def after_dashes(command: str) -> list[str]:
    """The words after a lone `--` (the job's own command line), the trailing `...` left out."""
    words = shlex.split(command)
    return [w for w in words[words.index("--") + 1:] if w != "..."]


def overrides(words: list[str]) -> dict[str, str]:
    """A Hydra command line's `key=value` words (no `--` flags)."""
    return dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))


def slime_job(block: Block) -> tuple[dict[str, str], list[str], list[str]]:
    """(the job's variables, slime's argv after `--` with `$ENV` put in, the flags a comment adds
    after "also:")."""
    found = commands(block)
    (env_line,) = [c for c in found if c.startswith("ENV=")]
    variables = json.loads(shlex.split(env_line)[0].removeprefix("ENV="))
    (submit,) = [c for c in found if c.startswith("ray job submit")]
    submit = submit.replace("$ENV", json.dumps(variables).replace('"', '\\"'))
    env = runtime_env(submit)
    argv = after_dashes(submit)
    assert env == variables, (env, variables)  # the runtime_env holds the job's variables
    added = [flag for line in block.text.splitlines() if line.lstrip().startswith("#") and "also:" in line
             for flag in re.findall(r"(--[\w-]+)", line.split("also:", 1)[1])]
    return variables, argv, added
