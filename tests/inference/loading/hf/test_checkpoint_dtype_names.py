"""The dtype config.json gives, as transformers' AutoConfig reads it (issue 63 item 8): within one level
`dtype` wins over `torch_dtype`, and a wrapper's (a vision-language model's) dtype over its text model's
(transformers loads the whole model in it). The reader merged per field name and read `dtype` before
`torch_dtype`, so a wrapper's `torch_dtype: float16` lost to `text_config.dtype: bfloat16`. Every pair of
the two names at both levels, against AutoConfig."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from megatron_rl_patches.inference.loading.hf.checkpoint_config import read_checkpoint_config

transformers = pytest.importorskip("transformers")
CONFIGS = Path(__file__).resolve().parents[3] / "apps" / "cli" / "hf_configs"
# each level's fields; where both names are written they disagree, so which one won shows
WRAPPER = {"none": {}, "dtype": {"dtype": "float16"}, "torch_dtype": {"torch_dtype": "float16"},
           "both": {"dtype": "float16", "torch_dtype": "float32"}}
TEXT = {"none": {}, "dtype": {"dtype": "bfloat16"}, "torch_dtype": {"torch_dtype": "bfloat16"},
        "both": {"dtype": "bfloat16", "torch_dtype": "float64"}}


def _written(name: str, outer: dict, text: dict | None, tmp_path: Path) -> Path:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    for level in (config, config.get("text_config", {})):
        level.pop("dtype", None)
        level.pop("torch_dtype", None)
    config.update(outer)
    if text is not None:
        config["text_config"].update(text)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _short(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@pytest.mark.parametrize(("outer", "text"), list(itertools.product(WRAPPER, TEXT)))
def test_a_wrappers_dtype_as_autoconfig_gives_it(outer, text, tmp_path):
    root = _written("Qwen3.5-27B", WRAPPER[outer], TEXT[text], tmp_path)
    auto = transformers.AutoConfig.from_pretrained(root)
    want = _short(auto.dtype) or _short(auto.text_config.dtype)  # the wrapper's, else its text model's
    assert read_checkpoint_config(root).dtype == want, (outer, text, auto.dtype, auto.text_config.dtype)


@pytest.mark.parametrize("names", list(WRAPPER))
def test_a_plain_configs_dtype_as_autoconfig_gives_it(names, tmp_path):
    root = _written("Qwen3-8B", WRAPPER[names], None, tmp_path)
    assert read_checkpoint_config(root).dtype == _short(transformers.AutoConfig.from_pretrained(root).dtype)
