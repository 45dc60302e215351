"""Write docs/shared-prefix.md's framework x layout matrix from the shared-prefix table in code
(megatron_rl_patches/integrations/shared_prefix_doors/table.py): the block between
`<!-- shared-prefix-matrix -->` and `<!-- /shared-prefix-matrix -->` becomes `matrix_markdown()`.
tests/docs/test_shared_prefix_matrix.py fails when the page and the table differ.

    python tools/doc_shared_prefix_matrix.py            # rewrite the block in place
    python tools/doc_shared_prefix_matrix.py --check    # exit 1 when the page differs
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "shared-prefix.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page differs")
    args = parser.parse_args(argv)
    if str(REPO) not in sys.path:  # this checkout's package, not another installed one
        sys.path.insert(0, str(REPO))
    from megatron_rl_patches.integrations.shared_prefix_doors.matrix import rewritten

    text = PAGE.read_text(encoding="utf-8")
    wanted = rewritten(text)
    if wanted == text:
        return 0
    if args.check:
        print(f"{PAGE.relative_to(REPO)}: the matrix differs from the table in code; run "
              "python tools/doc_shared_prefix_matrix.py")
        return 1
    PAGE.write_text(wanted, encoding="utf-8")
    print(f"{PAGE.relative_to(REPO)}: matrix rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
