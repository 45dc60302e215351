"""Every fenced block of README.md and docs/*.md is true: python blocks run as pasted in a fresh
interpreter (a `# fragment: uses ...` block given the small real objects it lists, doc_namespaces.py;
doc_fresh.py), CLI blocks' commands print what they show, run as pasted in a fresh shell at the
clone's root with no environment on PATH (doc_shell.py), output blocks
match what their code prints, signature listings match the functions. Blocks that cannot run here
are marked `<!-- docs-test: skip: reason -->` and reported as skipped tests with that reason."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import Block, all_blocks  # noqa: E402
from doc_fresh import run_page_python  # noqa: E402
from doc_namespaces import MEGATRON_OUTPUTS, OUTPUTS, PAGES, Page  # noqa: E402
from doc_running import (  # noqa: E402
    assert_output,
    cli_commands,
    listed_signatures,
    signature_mismatches,
)
from doc_shell import clone_root, paste  # noqa: E402
from doc_skipped import skipped_block_checks  # noqa: E402

pytestmark = pytest.mark.reader_facing  # the main and newest lanes (docs/testing.md, "Where a test runs")
BLOCKS = all_blocks()
PAGE_KINDS = ("python", "cli", "output")


def _by_kind(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def _page_params() -> list:
    pages = sorted({b.page for b in BLOCKS if b.kind in PAGE_KINDS and not (b.kind == "output" and b.detail)})
    def marks(page: str) -> list:
        setup = PAGES.get(page, Page())
        return [pytest.mark.megatron] * setup.megatron + [pytest.mark.verl] * setup.verl

    return [pytest.param(page, marks=marks(page), id=page) for page in pages]


def test_every_block_is_runnable_or_marked():
    unmarked = [f"{b.where} ({b.lang or 'no language'}){': ' + b.detail if b.detail else ''}"
                for b in BLOCKS if b.kind == "unmarked"]
    assert not unmarked, (
        "blocks that are neither python, a prompted CLI call with its output, nor marked "
        "`<!-- docs-test: skip: reason -->` / `output` / `output-of: NAME` / `signatures`:\n" + "\n".join(unmarked)
    )


def test_every_skip_has_a_reason_and_every_producer_exists():
    assert all(b.detail for b in _by_kind("skip")), [b.where for b in _by_kind("skip") if not b.detail]
    named = {b.detail for b in _by_kind("output") if b.detail}
    assert named <= set(OUTPUTS), named - set(OUTPUTS)


def test_the_extraction_sees_every_fence_kind():
    """Guards the extractor itself: a regression that found no blocks would pass everything else."""
    kinds = {b.kind for b in BLOCKS}
    assert {"python", "cli", "output", "skip", "signatures"} <= kinds
    assert len(_by_kind("python")) >= 10


def _checked_skips() -> list:
    return [pytest.param(b, id=b.where) for b in _by_kind("skip")
            if skipped_block_checks(b.lang, b.text, b.detail, b.where)]


@pytest.mark.parametrize("block", _checked_skips())
def test_skipped_block_still_parses_and_names_what_exists(block):
    """A block that cannot run here still parses, and the names, commands, make targets,
    variables and patches it mentions exist (a renamed API or a typo fails here)."""
    for check in skipped_block_checks(block.lang, block.text, block.detail, block.where):
        check()


@pytest.mark.parametrize("page", _page_params())
def test_page_blocks_run_and_print_what_they_show(page, clean_patch_state, tmp_path):
    """Each python block as pasted into a fresh interpreter (a page's fragments in one of their own,
    given what they list), and each CLI block's commands as pasted into a fresh shell, all started
    at once; each output block compared with what the runnable block above it printed."""
    setup = PAGES.get(page, Page())
    if setup.verl:
        pytest.importorskip("verl.models", reason=f"{page} needs verl: run `make test-verl` (the verl lane)")
    blocks = [b for b in BLOCKS if b.page == page and b.kind in PAGE_KINDS and not (b.kind == "output" and b.detail)]
    root = clone_root(tmp_path / "clone") if any(b.kind == "cli" for b in blocks) else None
    commands = {(b.where, command): (paste(b.where, command, root), shown)
                for b in blocks if b.kind == "cli" and root for command, shown in cli_commands(b)}
    try:
        printed_by = dict(run_page_python([b for b in blocks if b.kind == "python"], tmp_path))
        printed, ran = None, []
        for block in blocks:
            if block.kind == "python":
                printed = printed_by[block.where]
            elif block.kind == "cli":
                for command, _ in cli_commands(block):
                    pasted, shown = commands[block.where, command]
                    printed = pasted.finish()
                    assert_output(Block(block.page, block.line, "", shown, "output"), printed, f"`{command}`")
            else:
                assert printed is not None, f"{block.where}: an output block with no runnable block above it"
                assert_output(block, printed, "the block above")
            ran.append(block.where)
    finally:
        for pasted, _ in commands.values():
            pasted.stop()
    assert ran


def _output_params() -> list:
    blocks = [b for b in _by_kind("output") if b.detail]
    return [
        pytest.param(b, marks=[pytest.mark.megatron] if b.detail in MEGATRON_OUTPUTS else [], id=b.where)
        for b in blocks
    ]


@pytest.mark.parametrize("block", _output_params())
def test_produced_output_is_what_the_page_shows(block):
    assert_output(block, OUTPUTS[block.detail](), f"the producer {block.detail!r}")


@pytest.mark.parametrize("block", _by_kind("signatures"), ids=lambda b: b.where)
def test_signature_listing_matches_the_functions(block):
    import megatron_rl_patches

    listed = listed_signatures(block.text)
    assert listed, f"{block.where}: no signatures found"
    problems = [p for name, args in listed.items()
                for p in signature_mismatches(name, args, getattr(megatron_rl_patches, name))]
    assert not problems, f"{block.where}:\n" + "\n".join(problems)
