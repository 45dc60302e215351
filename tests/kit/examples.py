"""The repository's examples (examples/*.py) loaded as modules, for tests that call their functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """examples/`name`.py executed as a module named `name` (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no example {name}.py in {EXAMPLES}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
