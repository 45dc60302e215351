"""How an optional extra is named to the user (issue 72 item 10b): the package is not on the index
(README, "Install"), so `pip install 'megatron-rl-patches[served]'` finds nothing. Every message of
a missing optional library names the library and the wheel built from a clone with its extra, and
no page or message gives the index form as a command."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import megatron_rl_patches

REPO = Path(megatron_rl_patches.__file__).resolve().parent.parent
INDEX_FORM = re.compile(r"pip install ['\"]?megatron-rl-patches\[")  # the name alone: the index's
WHEEL = f"pip install 'dist/megatron_rl_patches-{megatron_rl_patches.__version__}-py3-none-any.whl[{{}}]'"


def _the_client_opened():
    from megatron_rl_patches.teachers.served.http import TeacherClient
    from megatron_rl_patches.teachers.served.settings import ClientSettings

    TeacherClient("http://127.0.0.1:9", ClientSettings()).http()


def _a_checkpoint_read(tmp_path):
    from megatron_rl_patches.inference.loading.hf.files import safe_open_of

    safe_open_of(tmp_path / "model.safetensors")


def _mbridge_imported():
    from megatron_rl_patches.inference.loading.hf.mbridge_adapter import import_mbridge

    import_mbridge()


@pytest.mark.parametrize("library, extra, call", [("httpx", "served", _the_client_opened),
                                                  ("safetensors", "hf", _a_checkpoint_read),
                                                  ("mbridge", "mbridge", _mbridge_imported)])
def test_a_missing_library_names_itself_and_the_wheels_extra(monkeypatch, tmp_path, library, extra, call):
    monkeypatch.setitem(sys.modules, library, None)  # `import library` raises ImportError
    with pytest.raises(ImportError) as caught:
        call(tmp_path) if call is _a_checkpoint_read else call()
    message = str(caught.value)
    assert f"pip install {library}" in message and WHEEL.format(extra) in message, message
    assert "python -m pip wheel --no-deps -w dist ." in message and not INDEX_FORM.search(message), message


def test_no_page_or_message_gives_the_index_form_as_a_command():
    files = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md",
             *sorted((REPO / "megatron_rl_patches").rglob("*.py"))]
    found = [f"{path.relative_to(REPO)}: {line.strip()}" for path in files
             for line in path.read_text(encoding="utf-8").splitlines()
             if INDEX_FORM.search(line) and "finds nothing" not in line]  # saying it finds nothing is the point
    assert not found, found
