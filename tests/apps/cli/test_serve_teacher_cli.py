"""`megatron-rl-patches serve-teacher`'s command line, as a careless user types it (issue 105 items
2, 6 and 9), in the main venv (no vLLM): the API key never reaches a message whatever spelling
argparse or vLLM's parser accepts (`_` for `-`, `=`, an abbreviation, vLLM's dotted form), before
'--' or among the engine arguments; a MODEL_DIR whose config.json is not JSON is one line naming the
file; without vLLM's server stack the command says in one line where it runs. Each exits without
a traceback."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.apps.cli import main

KEY = "s3cr3t-KEY-words"
# after '--': vLLM's parser reads '_' as '-' and echoes what it does not know (the key with it)
ENGINE_SPELLINGS = [["--api-key", KEY], [f"--api-key={KEY}"], ["--api_key", KEY], [f"--api_key={KEY}"],
                    ["--api-k", KEY], [f"--api={KEY}"], ["--api_k", KEY], [f"--api-key.x={KEY}"], ["--API_KEY", KEY]]
# before '--': this command's own option, or what argparse does not know and would echo
OWN_SPELLINGS = [["--api_key", KEY], [f"--api_key={KEY}"], ["--api_ke", KEY], [f"--api_k={KEY}"],
                 ["--api-key", KEY, "--bogus"], ["--bogus", f"--api-key={KEY}", "stray"]]


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return tmp_path


@pytest.mark.parametrize("words", ENGINE_SPELLINGS, ids=lambda words: words[0].replace(KEY, "KEY"))
def test_a_key_among_the_engine_arguments_is_refused_unechoed_in_every_spelling(capsys, model_dir, words):
    assert main(["serve-teacher", str(model_dir), "--", "--dtype", "float32", *words]) == 2
    said = capsys.readouterr()
    assert "--api-key is this command's, not an engine argument" in said.err, said.err
    assert KEY not in said.err + said.out


@pytest.mark.parametrize("words", OWN_SPELLINGS, ids=lambda words: " ".join(words).replace(KEY, "KEY"))
def test_a_key_before_the_engine_arguments_never_reaches_a_message(capsys, model_dir, words):
    assert main(["serve-teacher", str(model_dir), *words]) == 2
    said = capsys.readouterr()
    assert "unrecognized arguments" in said.err, said.err
    assert KEY not in said.err + said.out


@pytest.mark.parametrize(("text", "problem"), [("{not json", "is not JSON (JSONDecodeError"),
                                               ("[" * 100_000, "nests deeper than Python's recursion limit"),
                                               (None, "is unreadable (FileNotFoundError")])
def test_a_model_dir_without_a_readable_config_is_one_line_naming_the_file(capsys, tmp_path, text, problem):
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    assert main(["serve-teacher", str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert f"MODEL_DIR {str(tmp_path)!r}: its config.json {problem}" in said
    assert "give the teacher's Hugging Face checkpoint directory" in said


def test_without_vllms_server_stack_the_command_names_where_it_runs(capsys, model_dir):
    pytest.importorskip("torch")
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this interpreter has vLLM's server stack (the served lane's venv)")
    assert main(["serve-teacher", str(model_dir)]) == 1
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert "serve-teacher: it runs in vLLM's environment" in said and ".lanes/vllm/bin/python -m megatron_rl_patches " \
                                                                   "serve-teacher" in said
