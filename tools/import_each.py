"""Import every module of megatron_rl_patches/ alone, each in a fresh interpreter, and print what it
pulled in: the third-party top-level packages and how many of the package's own modules. A module
that fails to import (a cycle shows as "partially initialized module") prints its last error line.

    python tools/import_each.py                      # this interpreter, every module
    python tools/import_each.py --json out.json      # also write {module: {"ok", "third_party", "own"}}
    python tools/import_each.py --diff a.json b.json # what changed between two runs (exit 1 if any)
    python tools/import_each.py -j 2 megatron_rl_patches.ops   # only modules under these prefixes, 2 at a time

Run it with each lane's interpreter (e.g. .venv-mcore013/bin/python) to check the modules import on
every megatron version; compare two runs with --diff to see what a change adds to an import set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_rl_patches"
PROBE = (
    "import json, sys\n"
    "before = set(sys.modules)\n"
    "import {module}\n"
    "new = set(sys.modules) - before\n"
    "tops = {{n.split('.')[0] for n in new}} - set(sys.stdlib_module_names) - {{'{package}'}}\n"
    "own = sum(n.startswith('{package}') for n in new)\n"
    "print(json.dumps([sorted(t for t in tops if not t.startswith('_')), own]))\n"
)


def modules(*prefixes: str) -> list[str]:
    names = []
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if "shim" in parts or parts[-1] == "__main__":  # run by the interpreter (sitecustomize, -m), not imported
            continue
        name = ".".join(parts)
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes or (PACKAGE,)):
            names.append(name)
    return names


def probe(module: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [environ.get("PYTHONPATH")])])
    code = PROBE.format(module=module, package=PACKAGE)
    proc = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "error": last}
    third_party, own = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"ok": True, "third_party": third_party, "own": own}


def diff(before: dict, after: dict) -> list[str]:
    lines = []
    for module in sorted(set(before) | set(after)):
        a, b = before.get(module), after.get(module)
        if a is None or b is None:
            lines.append(f"{module}: {'added' if a is None else 'removed'}")
        elif a["ok"] != b["ok"] or a.get("third_party") != b.get("third_party"):
            lines.append(f"{module}: {a} -> {b}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="*", metavar="prefix")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.diff:
        before, after = (json.loads(Path(p).read_text()) for p in args.diff)
        lines = diff(before, after)
        print("\n".join(lines) or "no change")
        return 1 if lines else 0
    names = modules(*args.prefixes)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(names, pool.map(probe, names)))
    failed = 0
    for name, result in results.items():
        if result["ok"]:
            print(f"{name}: {' '.join(result['third_party']) or '-'} (own {result['own']})")
        else:
            failed += 1
            print(f"{name}: FAILED {result['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    print(f"{len(results)} modules, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
