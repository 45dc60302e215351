"""How a message or a page says to install one of the package's extras. The package is not on the
package index (README, "Install"), so `pip install 'megatron-rl-patches[served]'` finds nothing:
the extra goes on the wheel built from a clone, or its libraries are installed by name (the Hugging
Face readers' safetensors and mbridge, a served teacher's httpx). A leaf."""
from __future__ import annotations

BUILD = "python -m pip wheel --no-deps -w dist ."  # in a clone: dist/megatron_rl_patches-<version>-py3-none-any.whl


def wheel_with_extra(extra: str) -> str:
    """The pip command installing the wheel `BUILD` writes, with its extra `extra`."""
    from megatron_rl_patches import __version__  # lazy: cycle with the package root, which imports the rooms

    return f"pip install 'dist/megatron_rl_patches-{__version__}-py3-none-any.whl[{extra}]'"


def install_hint(extra: str, libraries: str) -> str:
    """`pip install LIBRARIES`, or the wheel with the extra `extra` (the package is not on the index)."""
    return (f"pip install {libraries}, or the wheel built from a clone with the extra [{extra}] "
            f"(`{BUILD}`, then `{wheel_with_extra(extra)}`; the package is not on the package index)")
