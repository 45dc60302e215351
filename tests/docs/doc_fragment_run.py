"""`python doc_fragment_run.py PAGE PRINTED_JSON`: a page's `# fragment: uses NAME, ...` blocks in
order in this fresh interpreter, each given exactly the names it lists (built by doc_namespaces.py,
the reader's own model, batch or step) and nothing else; the page's final check after the last.
Writes {page:line: what the block printed}; a failing block's traceback names its markdown line."""
from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path

from doc_blocks import REPO, fragment_names, page_blocks
from doc_namespaces import PAGES, Page
from doc_running import run_python


def main(page: str, printed_path: str) -> None:
    setup = PAGES.get(page, Page())
    fragments = [b for b in page_blocks(REPO / page) if b.kind == "python" and fragment_names(b.text)]
    printed = {}
    with ExitStack() as stack:
        namespace = setup.build(stack)
        replace = setup.replace(namespace)
        for block in fragments:
            setup.before(block, namespace)
            listed = fragment_names(block.text)
            missing = [name for name in listed if name not in namespace]
            assert not missing, f"{block.where}: doc_namespaces.py gives no {missing} for {page}"
            given = {"__name__": "__main__", **{name: namespace[name] for name in listed}}
            printed[block.where] = run_python(block, given, replace)
            namespace.update({k: v for k, v in given.items() if k not in listed and not k.startswith("__")})
        setup.finish(namespace)
    Path(printed_path).write_text(json.dumps(printed))


if __name__ == "__main__":
    main(*sys.argv[1:])
