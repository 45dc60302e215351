"""What the NeMo-RL records leave to NeMo-RL or refuse, on its real code in one process: a named
fallback (top-k sampling), raw teacher logits refused by `nemo_rl_topk_kd`, the worker NeMo-RL
builds on a GPU refused by name (what a CPU cannot give), revert."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = pytest.mark.nemo_rl

import nemo_kit as kit  # noqa: E402
import torch  # noqa: E402

import megatron_rl_patches  # noqa: E402


def _model(seed: int = 0):
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    return build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=seed)


def test_top_k_sampling_goes_to_nemo_rls_own_path_with_a_named_line(nemo_cpu, caplog):
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
    from nemo_rl.models.megatron.data import get_microbatch_iterator
    from nemo_rl.models.megatron.train import LogprobsPostProcessor, megatron_forward_backward

    model, cfg = _model(), kit.policy_cfg()
    post = LogprobsPostProcessor(cfg, TrainingSamplingParams(top_k=5))

    def run():
        iterator, count, micro, _, padded = get_microbatch_iterator(kit.batch(), cfg, kit.BATCH, straggler_timer=None)
        return megatron_forward_backward(model=model, data_iterator=iterator, num_microbatches=count,
                                         seq_length=padded, mbs=micro, post_processing_fn=post, forward_only=True,
                                         sampling_params=post.sampling_params)[0]["logprobs"]

    own = run()
    megatron_rl_patches.apply(["nemo_rl_fused_logprobs"], strict=True)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        fallen = run()
    assert torch.equal(own, fallen)
    assert "nemo_rl_fused_logprobs: top-k / top-p sampling: this step uses NeMo-RL's own logits path" in caplog.text


def test_raw_teacher_logits_are_refused_by_nemo_rl_topk_kd(nemo_cpu):
    from nemo_rl.algorithms.loss.loss_functions import DistillationLossConfig, DistillationLossFn
    from nemo_rl.models.megatron.train import LossPostProcessor, TopkLogitsPostProcessor

    cfg = kit.policy_cfg()
    raw = kit.drive(_model(seed=7), kit.batch(), cfg, TopkLogitsPostProcessor(cfg, kit.K))[0]  # NeMo-RL's own: logits
    data = kit.batch(teacher=(raw["topk_logits"] + 10.0, raw["topk_indices"]))
    megatron_rl_patches.apply(["nemo_rl_topk_kd"], strict=True)
    with pytest.raises(ValueError, match="must be log-probs over the teacher's whole vocabulary.*nemo_rl_topk"):
        kit.drive(_model(), data, cfg, LossPostProcessor(DistillationLossFn(DistillationLossConfig()), cfg))


def test_nemo_rls_megatron_worker_cannot_be_built_here_and_says_why():
    """MegatronPolicyWorker (train / get_logprobs / get_topk_logits) imports megatron-core 0.20's FSDP
    names and Megatron-Bridge; it also needs Ray GPU ids, torch.cuda.set_device and NCCL. The lane
    runs the functions it calls (train.py's driver and post-processors) instead."""
    with pytest.raises(ImportError, match="FullyShardedDataParallelV1"):
        import nemo_rl.models.policy.workers.megatron_policy_worker  # noqa: F401


def test_revert_gives_nemo_rls_own_step_back(nemo_cpu):
    import nemo_rl.models.megatron.train as train

    original = train.forward_with_post_processing_fn
    megatron_rl_patches.apply(["nemo_rl_fused_logprobs", "nemo_rl_topk", "nemo_rl_topk_kd"], strict=True)
    assert train.forward_with_post_processing_fn is not original
    statuses = {s.name: s.status for s in megatron_rl_patches.applied() if s.name.startswith("nemo_rl")}
    assert statuses == dict.fromkeys(("nemo_rl_fused_logprobs", "nemo_rl_topk", "nemo_rl_topk_kd"), "applied")
    megatron_rl_patches.revert()
    assert train.forward_with_post_processing_fn is original


def test_the_whole_vocabulary_loss_refuses_by_name_what_it_cannot_serve(nemo_cpu, tmp_path):
    """`WholeVocabularyDistillationLossFn` on `nemo_rl_topk_kd`'s step: a student step at another
    temperature than the served teacher's, and a batch without the served states, are refused
    naming the fix (there is no NeMo-RL path to fall back to)."""
    from nemo_rl.models.megatron.train import LossPostProcessor

    from megatron_rl_patches.integrations.nemo_rl.vocab_kd import WholeVocabularyDistillationLossFn
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf

    save_tiny_hf(tmp_path, "qwen3", seed=1, hidden_size=64, head_dim=32, intermediate_size=96,
                 max_position_embeddings=64, vocab_size=kit.VOCAB)
    cfg = kit.policy_cfg()
    loss = WholeVocabularyDistillationLossFn({"kl_type": "forward"}, head=tmp_path, temperature=1.0)
    megatron_rl_patches.apply(["nemo_rl_topk_kd"], strict=True)
    fix = r"served_teacher_policy\(\.\.\., temperature=0.8\)"
    with pytest.raises(ValueError, match=rf"temperature 0.8 .* at 1.0.*{fix}"):
        kit.drive(_model(), kit.batch(), cfg, LossPostProcessor(loss, cfg), forward_only=False, temperature=0.8)
    with pytest.raises(ValueError, match=r"needs data\['teacher_hidden_states'\].*full_vocabulary=True"):
        kit.drive(_model(), kit.batch(), cfg, LossPostProcessor(loss, cfg), forward_only=False)
