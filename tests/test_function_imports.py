"""Every import inside a function of the package states why it is not at module level (issue 56):
`# lazy: <reason>` on or above the statement, or the file's `# lazy imports: <reason>` note
(tools/function_imports.py reads them). A reason starts with one of REASONS; one naming an optional
dependency is checked against the file: that package is not imported at its module level."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("function_imports", REPO / "tools" / "function_imports.py")
assert _spec is not None and _spec.loader is not None
function_imports = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, function_imports)  # dataclasses look their module up there
_spec.loader.exec_module(function_imports)

# "order": the import must wait for something the function does first (e.g. sys.path set up).
REASONS = ("optional dependency ", "import cost", "cycle ", "megatron version-dependent", "order: ")
# Distribution name -> the top-level package it installs, where they differ.
PACKAGES = {"megatron-core": "megatron", "liger-kernel": "liger_kernel"}

def test_every_function_import_states_its_reason():
    missing = [f"{item.path}:{item.line} {item.name}" for item in function_imports.unexplained(REPO)]
    assert missing == [], "say why with `# lazy: <reason>` (see tools/function_imports.py), or hoist it"


def test_reasons_use_the_vocabulary():
    odd = [f"{item.path}:{item.line} {item.reason!r}" for item in function_imports.scan(REPO)
           if item.reason and not item.reason.startswith(REASONS)]
    assert odd == [], f"a reason starts with one of {REASONS}"


def test_an_optional_dependency_is_not_imported_at_module_level():
    wrong = []
    for item in function_imports.scan(REPO):
        if not item.reason.startswith("optional dependency "):
            continue
        named = item.reason.removeprefix("optional dependency ").split()[0].rstrip(":,;")
        package = PACKAGES.get(named, named)
        if item.top == function_imports.PACKAGE:  # an own module that needs the dependency: not checked here
            continue
        if item.top != package or package in function_imports.module_level_tops(REPO / item.path):
            wrong.append(f"{item.path}:{item.line} imports {item.name}, reason {item.reason!r}")
    assert wrong == []



def test_the_scanner_reads_each_form(tmp_path):
    package = tmp_path / function_imports.PACKAGE
    package.mkdir()
    (package / "a.py").write_text(
        "import os\n\n\n"
        "def f():\n    import json\n    import torch  # lazy: import cost: torch only here\n"
        "    # lazy: optional dependency megatron-core\n    from megatron.core import x\n"
        "    from . import b\n\n\n"
        "class C:\n    import sys\n\n    def g(self):\n        import sys\n"
    )
    (package / "b.py").write_text("# lazy imports: cycle a <-> b\n\n\ndef h():\n    from .a import f\n")
    found = {(item.path.split("/")[-1], item.line): item for item in function_imports.scan(tmp_path)}
    assert sorted(found) == [("a.py", 5), ("a.py", 6), ("a.py", 8), ("a.py", 9), ("a.py", 16), ("b.py", 5)]
    assert [found["a.py", n].kind for n in (5, 6, 8, 9)] == ["stdlib", "torch", "megatron", "own"]
    assert found["a.py", 6].reason == "import cost: torch only here"
    assert found["a.py", 8].reason == "optional dependency megatron-core"
    assert found["a.py", 5].reason == "" and found["a.py", 16].reason == ""
    assert found["b.py", 5].reason == "cycle a <-> b" and found["b.py", 5].top == function_imports.PACKAGE
    assert {item.line for item in function_imports.unexplained(tmp_path)} == {5, 9, 16}
