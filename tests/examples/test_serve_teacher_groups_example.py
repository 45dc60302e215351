"""examples/serve_teacher_groups.py's parts on CPU (its run against real servers: the served lane,
tests/teachers/lane/test_served_example_groups.py): vLLM's computed-prompt-token counter read from
its Prometheus text, one GRPO group of G samples sharing exactly its P prompt ids, the saving said
in words that hold at none and at all, and a server that does not answer named in one line."""
from __future__ import annotations

import pytest
import torch
from kit.examples import load_example

pytestmark = pytest.mark.reader_facing  # main and newest lanes

METRICS = """# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 288.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 672.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 960.0
"""


@pytest.fixture(scope="module")
def example():
    return load_example("serve_teacher_groups")


def test_the_computed_prompt_tokens_are_read_from_vllms_counter(example):
    assert example.computed_tokens(METRICS) == 288.0
    assert example.computed_tokens(METRICS.replace("288.0", "288.0\n" + METRICS.splitlines()[2].replace(
        'engine="0"', 'engine="1"'))) == 576.0  # every engine's
    assert example.computed_tokens("vllm:prompt_tokens_total 960.0\n") is None


def test_a_group_shares_exactly_its_prompt(example):
    batch = example.one_group(torch.Generator().manual_seed(0), 8, 96, 24, 1001)
    assert batch.response_starts == [96] * 8 and [len(s) for s in batch.sequences] == [120] * 8
    assert all(torch.equal(s[:96], batch.sequences[0][:96]) for s in batch.sequences)
    assert len({int(s[96]) for s in batch.sequences}) == 8  # no two share more than the prompt


def test_the_saving_in_words(example):
    assert example.fewer(288, 960) == "3.3x fewer"
    assert example.fewer(960, 960) == "no fewer: nothing shared"
    assert example.fewer(0, 960).startswith("none: every token read from the cache")
    assert example.fewer(950, 960) == "10 fewer"


def test_no_server_is_one_line_naming_the_url(example, capsys):
    pytest.importorskip("httpx")
    with pytest.raises(SystemExit) as exited:
        example.main(["--url", "http://127.0.0.1:9"])
    said = capsys.readouterr().err
    assert exited.value.code == 1 and said.count("\n") == 1, said
    assert said.startswith("http://127.0.0.1:9: no model card (ConnectError") and "/health" in said
