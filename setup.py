"""Build hooks: write the start-up files (.pth, and .start for Python >= 3.15) at the wheel root,
from their one source (megatron_rl_patches/patching/startup/files.py, read without importing the
package), so a wheel built from a checkout or from the sdist has them.

PEP 660 editable installs do not carry them; `megatron-rl-patches startup install` covers that.
"""
import os
import re
import runpy
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP_SOURCE = os.path.join("megatron_rl_patches", "patching", "startup", "files.py")
STARTUP_CONTENTS = runpy.run_path(os.path.join(HERE, STARTUP_SOURCE))["CONTENTS"]
# The repository's planned public home (setup.cfg's `url`): relative links in the README become
# absolute ones there, so they work on a package index page too.
REPOSITORY = "https://github.com/megatron-rl-patches/megatron-rl-patches"


def long_description() -> str:
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    # [text](docs/x.md) or (examples/y.py) or (LICENSE): not http(s), not an in-page #anchor
    return re.sub(r"\]\((?!https?://|#)([^)\s]+)\)", lambda m: f"]({REPOSITORY}/blob/main/{m.group(1)})", text)


class BuildPyWithStartupFiles(build_py):
    """Writes the start-up files at build_lib's root and reports them, so the wheel's RECORD
    lists them (pip then removes them on uninstall)."""

    def run(self):
        # Start from an empty build_lib: setuptools reuses build/lib between builds, so a module
        # moved or deleted in the tree (cli.py -> cli/) would otherwise ship in the next wheel.
        if not getattr(self, "editable_mode", False) and os.path.isdir(self.build_lib):
            shutil.rmtree(self.build_lib)
        super().run()
        for name, text in STARTUP_CONTENTS.items():
            with open(os.path.join(self.build_lib, name), "w", encoding="utf-8") as handle:
                handle.write(text)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, name) for name in STARTUP_CONTENTS]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        for name in STARTUP_CONTENTS:
            mapping[os.path.join(self.build_lib, name)] = STARTUP_SOURCE
        return mapping


setup(cmdclass={"build_py": BuildPyWithStartupFiles}, long_description=long_description())
