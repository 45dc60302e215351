"""The `tokenizers` library is an optional extra: importing the module costs nothing, and a
missing library is an ImportError naming the extra."""
from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_module_is_light():
    proc = run("import sys; import megatron_rl_patches.cross_tokenizer as ct; "
               "print(sorted(m for m in ('torch', 'tokenizers', 'numpy') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_missing_library_names_the_extra():
    proc = run("import sys; sys.modules['tokenizers'] = None\n"
               "from megatron_rl_patches.cross_tokenizer import token_bytes\n"
               "try:\n    token_bytes('tokenizer.json', [1])\n"
               "except ImportError as e:\n    print(e)\n")
    assert proc.returncode == 0, proc.stderr
    assert "pip install tokenizers" in proc.stdout and "pip install -e '.[cross-tokenizer]'" in proc.stdout


def test_bad_tokenizer_arguments(tmp_path):
    pytest.importorskip("tokenizers")
    from megatron_rl_patches.cross_tokenizer import load_tokenizer

    with pytest.raises(TypeError, match="tokenizers.Tokenizer"):
        load_tokenizer(42)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
