"""`megatron-rl-patches startup install|remove`: the start-up files for editable installs."""
from __future__ import annotations

import argparse
import os
import sys

from megatron_rl_patches.apps.cli._common import OK, PROBLEM, UsageError, say
from megatron_rl_patches.patching.startup import files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("install", "remove"), help="write or delete the start-up files")
    parser.add_argument(
        "--site",
        metavar="DIR",
        default=None,
        help="site-packages directory (default: the running interpreter's)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        done = files.install(args.site) if args.action == "install" else files.remove(args.site)
    except NotADirectoryError as exc:
        raise UsageError(str(exc)) from None
    except (files.ForeignStartupFile, OSError) as exc:
        say("startup", str(exc))
        return PROBLEM
    for path, what in done:
        print(f"{what:<9} {path}")
    site_dir = os.path.dirname(done[0][0])
    if args.action == "install" and not files.is_site_dir(site_dir):
        print(
            f"note: {site_dir} is not a site directory of {sys.executable}; only interpreters "
            "that read .pth files from it will run the start-up hook",
            file=sys.stderr,
        )
    return OK
