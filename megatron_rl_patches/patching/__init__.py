"""Patch machinery: records, selection, start-up hook. Knows nothing of Megatron nor of which
patches exist: the registry of every known patch is named here by a string, resolved when used."""
# lazy imports: import cost: the start-up hook imports this package in every process (tests/test_lazy_import.py)
from __future__ import annotations

TYPE_CHECKING = False  # not `typing`'s: this package is imported at every interpreter start-up
if TYPE_CHECKING:
    from megatron_rl_patches.patching.registry import Registry

# The composition root: the function of no argument that builds the registry of every known
# patch. A "module:attribute" string, so this layer imports no integration; replaceable for tests
# and for embedders with their own registry.
DEFAULT_REGISTRY = "megatron_rl_patches.integrations:default_registry"


def load_registry(factory: str = DEFAULT_REGISTRY) -> Registry:
    """The registry `factory` ("module:function") returns; the default one unless told."""
    import pkgutil

    return pkgutil.resolve_name(factory)()


# The frameworks' own settings variables (e.g. top-k OPD's), checked by `run` and the start-up hook
# as their patches read them: "module:function" of an `environ` mapping, for the same reason.
SETTINGS_CHECK = "megatron_rl_patches.integrations:check_settings"


def check_settings(environ: object = None, check: str = SETTINGS_CHECK) -> None:
    """ValueError naming the framework variable at fault in `environ` (default: this process's)."""
    import pkgutil

    pkgutil.resolve_name(check)(environ)
