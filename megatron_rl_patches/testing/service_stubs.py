"""Inert stand-ins for the service packages a framework's modules import at module level but a CPU
test never uses (the NeMo-RL lane: ray, mlflow, wandb, swanlab, hydra, fastapi, zmq, tensorboard,
pynvml, megatron.bridge).

`install_service_stubs()` puts an import finder first on `sys.meta_path` that serves each named
package and every module below it as an empty module. Any attribute of such a module is an `Inert`:
calling it gives another one (or, called with one function or class alone, that function or class
back, so decorators like `@ray.remote` leave what they decorate as it is), its attributes are
inert, it is falsy, iterates as empty, works as a context manager and as a base class. Nothing
talks to a service: a test that reaches one sees values that do nothing. Test-only (never used by
library code); `remove_service_stubs()` takes the finder and the served modules away again.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

SERVICES = ("ray", "mlflow", "wandb", "swanlab", "hydra", "fastapi", "zmq", "tensorboard", "pynvml",
            "megatron.bridge")


class Inert:
    """A value that does nothing, whatever is done with it."""

    def __init__(self, name: str = "inert") -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and (isinstance(args[0], type) or callable(args[0])):
            return args[0]  # a bare decorator: what it decorates stays as it is
        return Inert(f"{self._name}()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Inert(f"{self._name}.{name}")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (type(self._name.rpartition(".")[2] or "Inert", (), {}),)

    def __getitem__(self, key: Any) -> Any:
        return Inert(f"{self._name}[]")

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __enter__(self) -> Inert:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __or__(self, other: Any) -> Any:  # `Inert | None` in annotations evaluated at import
        return Inert(self._name)

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<inert stand-in {self._name}>"


class _StubModule(types.ModuleType):
    """A served module: every missing attribute is an `Inert`; it is a package, so submodules import."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Inert(f"{self.__name__}.{name}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: `import ray.util.queue` finds the submodule here too
        # a release number past any minimum a caller checks (torch.utils.tensorboard wants >= 1.15)
        module.__version__ = "999.0+stand-in"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class ServiceStubFinder(importlib.abc.MetaPathFinder):
    """Serves the named packages (and their submodules) as inert modules."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self.loader = _StubLoader()

    def serves(self, fullname: str) -> bool:
        return any(fullname == name or fullname.startswith(name + ".") for name in self.names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not self.serves(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self.loader, is_package=True)


def install_service_stubs(names: Iterable[str] = SERVICES) -> ServiceStubFinder:
    """Serve `names` as inert modules from now on (idempotent per name list); returns the finder."""
    names = tuple(names)
    for finder in sys.meta_path:
        if isinstance(finder, ServiceStubFinder) and finder.names == names:
            return finder
    real = [name for name in names if name in sys.modules and not isinstance(sys.modules[name], _StubModule)]
    if real:
        raise RuntimeError(f"install_service_stubs: {real} are imported already (the real packages); "
                           "install the stand-ins before anything imports them, or leave those names out")
    finder = ServiceStubFinder(names)
    sys.meta_path.insert(0, finder)
    return finder


def remove_service_stubs() -> None:
    """Take every stand-in finder off `sys.meta_path` and forget the modules it served."""
    finders = [finder for finder in sys.meta_path if isinstance(finder, ServiceStubFinder)]
    for finder in finders:
        sys.meta_path.remove(finder)
        for name in [name for name in sys.modules if finder.serves(name)]:
            del sys.modules[name]


def is_stand_in(module: Any) -> bool:
    """Whether `module` is one of the stand-ins."""
    return isinstance(module, _StubModule)
