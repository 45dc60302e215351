"""verl 0.9.1's real Megatron engine with pipeline parallelism, in one 4-rank gloo world: PP=2 and PP=2
x 2 virtual stages (each stage two data-parallel ranks). verl's `forward_step` and
`postprocess_micro_batch_func` (ppo_loss with the entropy bonus) run inside megatron-core's own
forward-backward schedule as verl's `forward_backward_batch` calls it (`make_batch_generator`,
seq_length=1 with variable_seq_lengths, two micro-batches): the stages before the last hand their
hidden states on, the last one meets `verl_fused_logprobs`. Against verl's own unpatched logits path
on the same chunks: each micro-batch's log-probs and entropy and loss (last stage) and every chunk's
gradients (every stage). Negative control: another micro-batch's log-probs are told apart.

MEGATRON_RL_PATCHES_SHARED_PREFIX=1 through verl's real `forward_backward_batch` (`prefix_checks`), both
routes' training step against the same steps packed whole: at PP = 2 (the first stage plans the packed
ids, the last one the samples verl hands it unpacked, both the same sharing plan; the first stage's
embedding against the samples' trie) and, in the same world, at CP = 2 x TP = 2 with sequence
parallelism (verl's default beside TP: each sequence padded to 2 CP x TP and cut zigzag; the whole
micro-batch rebuilt from the context-parallel ranks' shares, each rank running its share of the shorter
stream; every gradient summed over the CP ranks, the norms' over the TP ranks too, as
`finalize_model_grads` does)."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = [pytest.mark.verl, pytest.mark.multirank]

import verl_kit as kit  # noqa: E402
from prefix_checks import PREFIX_TOLERANCE, prefix_checks  # noqa: E402
from verl_kit import CONTROL, ENTROPY_COEFF, PROMPTS, REL, RESPONSES, TEMPERATURE  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

MICRO_BATCHES = 2
TRAINING = ("unfused-train", "fused-train")  # the shared-prefix checks' passes here
LAYOUTS = {"vpp2": 2, "pp2": None}  # name: virtual stages per pipeline stage


def _chunks(virtual: int | None) -> tuple[list, object]:
    """This rank's model chunks (verl's fused forward patched on each, as its engine does) and their config."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt
    from megatron_rl_patches.testing.pipeline import pipeline_chunks, tiny_pipeline_config

    # what verl's engine sets for its pipelines: shapes travel with the activations, overlapped p2p
    # under VPP (the dense model dispatches no tokens; megatron refuses its default allgather
    # dispatcher beside variable lengths)
    config = tiny_pipeline_config(2, virtual, variable_seq_lengths=True, batch_p2p_comm=False,
                                  overlap_p2p_comm=virtual is not None, moe_token_dispatcher_type="alltoall")

    def provider(pre_process=True, post_process=True, vp_stage=None):
        model = build_packed_gpt(vocab_size=kit.VOCAB, seed=3, config=config, pre_process=pre_process,
                                 post_process=post_process, vp_stage=vp_stage)
        patch_fused_forward(model)
        return model

    return pipeline_chunks(provider), config


def _schedule(fused: bool, chunks: list, config) -> dict:
    """One global batch of verl micro-batches through megatron-core's schedule as verl runs it."""
    import functools

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from verl.utils.megatron.pipeline_parallel import make_batch_generator
    from verl.workers.utils.losses import ppo_loss

    eng = kit.engine(fused, tf_config=config)
    loss_function = functools.partial(ppo_loss, kit.actor_config(ENTROPY_COEFF))
    post = functools.partial(eng.postprocess_micro_batch_func, forward_only=False, loss_function=loss_function)
    step = functools.partial(eng.forward_step, logits_processor_func=loss_function, postprocess_micro_batch_func=post)
    micro_batches = [kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE, seed=seed, calculate_entropy=True,
                                  num_micro_batch=MICRO_BATCHES) for seed in range(MICRO_BATCHES)]
    reduced = get_forward_backward_func()(
        forward_step_func=step, data_iterator=make_batch_generator(micro_batches, vpp_size=len(chunks)),
        model=chunks, num_microbatches=MICRO_BATCHES, seq_length=1, micro_batch_size=1, forward_only=False)
    grads = {f"chunk{i}.{name}": g for i, chunk in enumerate(chunks) for name, g in kit.grads(chunk).items()}
    return {"reduced": reduced, "grads": grads}


def _rows(reduced: list, key: str, last: bool = False) -> list:
    return [row for out in reduced for row in kit.response_rows(out["model_output"][key], PROMPTS, last)]


def _checks(virtual: int | None) -> dict:
    import torch

    import megatron_rl_patches

    chunks, config = _chunks(virtual)
    megatron_rl_patches.revert()
    plain = _schedule(False, chunks, config)
    megatron_rl_patches.apply(only="verl_fused_logprobs")
    fused = _schedule(True, chunks, config)
    megatron_rl_patches.revert()
    out = {"grads": max(kit.relative(fused["grads"][n], plain["grads"][n]) for n in plain["grads"]),
           "same_names": sorted(fused["grads"]) == sorted(plain["grads"]) and len(plain["grads"]) > 2,
           "last_stage": bool(plain["reduced"])}
    if plain["reduced"]:  # the last stage: the micro-batches' outputs and losses
        for key in ("log_probs", "entropy"):  # the rows verl reads (its trainer's batch: no sequence's last row)
            pairs = zip(_rows(fused["reduced"], key), _rows(plain["reduced"], key))
            out[key] = max(kit.relative(got, want) for got, want in pairs)
        out["loss"] = max(abs(f["loss"] - p["loss"]) / abs(p["loss"])
                          for f, p in zip(fused["reduced"], plain["reduced"]))
        # rows per micro-batch, sequence by sequence: the first sequence of the second micro-batch
        other = _rows(plain["reduced"], "log_probs")[len(PROMPTS)]
        out["control_other_micro_batch"] = kit.relative(other, _rows(fused["reduced"], "log_probs")[0])
        out["unread_rows"] = max(float(torch.cat([row[:p - 1], row[-1:]]).abs().max()) for o in fused["reduced"]
                                 for row, p in zip(o["model_output"]["log_probs"].unbind(), PROMPTS))
        out["micro_batches"] = len(fused["reduced"])
    return out


def _world(rank: int, world_size: int) -> dict:
    import verl.models.mcore.registry  # noqa: F401  (bound by name before any patch: see verl_kit)

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results = {}
    for name, virtual in LAYOUTS.items():
        with megatron_on_cpu(pipeline_parallel=2, virtual_pipeline=virtual):
            results[name] = _checks(virtual)
            if virtual is None:
                results["prefix-pp2"] = prefix_checks(_chunks(None)[0], align=1, passes=TRAINING)
    with megatron_on_cpu(tensor_parallel=2, context_parallel=2):
        results["prefix-cp2-tp2"] = prefix_checks(_cp_tp_model(), align=2, context=2, passes=TRAINING)
    return results


def _cp_tp_model():
    """The packed GPT at CP = 2 (the kit's zigzag CPU attention) x TP = 2 + SP, as verl's engine holds it."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(vocab_size=kit.VOCAB, seed=3, context_parallel_layout="zigzag",
                             tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)
    patch_fused_forward(model)  # what verl's engine does at build time
    return model


@pytest.fixture(scope="module")
def pipeline_world() -> list[dict]:
    return run_multirank(_world, 4, timeout=600)


@pytest.mark.parametrize("layout", [pytest.param("pp2", marks=layouts.mark("pp2", "thd")),
                                    pytest.param("vpp2", marks=layouts.mark("vpp2", "pp2", "thd"))])
def test_pipelined_fused_route_equals_verls_logits_path(pipeline_world, layout):
    for first, last in _stages(pipeline_world, layout):  # per data-parallel rank
        print(layout, first, last)
        assert not first["last_stage"] and last["last_stage"] and last["micro_batches"] == MICRO_BATCHES
        for stage in (first, last):
            assert stage["same_names"] and stage["grads"] < REL, stage
        assert max(last["log_probs"], last["entropy"], last["loss"]) < REL, last
        assert last["unread_rows"] == 0.0  # the rows verl never reads met no output weight
        assert last["control_other_micro_batch"] > CONTROL  # the comparison tells the micro-batches apart


def _stages(world: list[dict], key: str) -> list[tuple[dict, dict]]:
    """(first stage, last stage) of each data-parallel rank: megatron-core's rank order puts the pipeline
    outermost (ranks 0, 1 the first stage, 2, 3 the last)."""
    half = len(world) // 2
    return [(world[dp][key], world[half + dp][key]) for dp in range(half)]


@layouts.mark("pp2", "thd")
def test_shared_prefix_at_pipeline_parallelism_equals_each_sample_packed_whole(pipeline_world):
    """Setting on against off at PP = 2, both routes' training step: the last stage's log-probs, entropy and
    loss within 1e-6, every stage's gradients too, the first stage's embedding running the samples' trie."""
    for first, last in _stages(pipeline_world, "prefix-pp2"):
        print(first, last)
        _pipeline_prefix_checks(first, last)


def _pipeline_prefix_checks(first: dict, last: dict) -> None:
    for what in TRAINING:
        assert first[what]["rows_whole"] == [first["logical_rows"]], what
        assert first[what]["rows_planned"] == [first["trie_rows"]] < [first["logical_rows"]], what
        assert last[what]["rows_whole"] == last[what]["rows_planned"] == [], what  # no embedding on the last stage
        errors = {key: last[what][key] for key in ("log_probs", "entropy", "loss", "grads") if key in last[what]}
        errors.update({f"first-{key}": first[what][key] for key in ("grads",) if key in first[what]})
        assert {"log_probs", "entropy"} <= set(errors) and max(errors.values()) < PREFIX_TOLERANCE, (what, errors)
        assert last[what]["control"] > CONTROL, what
        assert "loss" in errors and "first-grads" in errors and first[what]["same_names"], what


@layouts.mark("cp2-zigzag", "sp", "tp2", "thd")
def test_shared_prefix_at_cp2_tp2_equals_each_sample_packed_whole(pipeline_world):
    for rank, result in enumerate(pipeline_world):
        got = result["prefix-cp2-tp2"]
        print(rank, got)
        for what in TRAINING:
            checks = got[what]
            errors = {key: checks[key] for key in ("log_probs", "entropy", "loss", "grads") if key in checks}
            assert set(errors) == {"log_probs", "entropy", "loss", "grads"}, (what, errors)
            assert max(errors.values()) < PREFIX_TOLERANCE and checks["same_names"], (what, errors)
            assert checks["rows_whole"] == [got["logical_rows"]], what
            assert checks["rows_planned"] == [got["trie_rows"]] and got["trie_rows"] < got["logical_rows"], what
            assert checks["control"] > CONTROL, what
