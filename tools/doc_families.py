"""Write the Hugging Face families the converter serves into the docs, from the registry
(megatron_rl_patches/inference/loading/hf/families/): every list between the markers
`<!-- hf-families -->` and `<!-- /hf-families -->` in README.md and docs/*.md becomes the
`model_type` values a config.json may carry, sorted; one opened by `<!-- hf-families:mbridge -->`
those that `converter="mbridge"` serves too. tests/docs/test_doc_families.py fails when a list
differs or a page lists families by hand.

    python tools/doc_families.py            # rewrite the lists in place
    python tools/doc_families.py --check    # exit 1 naming each page whose list differs
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START, MBRIDGE, END = "<!-- hf-families -->", "<!-- hf-families:mbridge -->", "<!-- /hf-families -->"
BLOCK = re.compile("(" + re.escape(START) + "|" + re.escape(MBRIDGE) + ")(.*?)" + re.escape(END), re.S)


def served(mbridge: bool = False) -> list[str]:
    """Every config.json `model_type` the converter reads (families and their aliases), sorted;
    `mbridge`: only those converter="mbridge" serves as well."""
    if str(REPO) not in sys.path:  # this checkout's package, not another installed one
        sys.path.insert(0, str(REPO))
    from megatron_rl_patches.inference.loading.hf.families import REGISTRY

    return sorted(name for name, family in REGISTRY.items() if family.mbridge or not mbridge)


def family_list(mbridge: bool = False) -> str:
    return ", ".join(f"`{name}`" for name in served(mbridge))


def pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def rewritten(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + family_list(m.group(1) == MBRIDGE) + END, text)


def stale(files: list[Path]) -> list[Path]:
    """The files whose marked lists are not the registry's."""
    texts = {f: f.read_text(encoding="utf-8") for f in files if f.exists()}
    return [f for f, text in texts.items() if rewritten(text) != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a list differs")
    args = parser.parse_args(argv)
    files = stale(pages())
    for file in files:
        if args.check:
            print(f"{file.relative_to(REPO)}: the served families differ from the registry; "
                  "run python tools/doc_families.py")
        else:
            file.write_text(rewritten(file.read_text(encoding="utf-8")), encoding="utf-8")
            print(f"rewrote {file.relative_to(REPO)}")
    return 1 if args.check and files else 0


if __name__ == "__main__":
    sys.exit(main())
