"""The served teacher in verl's per-step metrics (issue 88 item 4, `verl_topk_kd`'s
`teacher_metrics`), on verl 0.9.1's real agent loop: two real `AgentLoopWorker`s run their real
`generate_sequences` (verl's own per-sample postprocessing, its `_compute_teacher_logprobs` and
its real teacher client, answered by the served teacher against a stand-in vLLM server), verl's
real `AgentLoopManager.generate_sequences` gathers them into its `timing` dict, and verl's own
`compute_timing_metrics` turns that into the trainer's metrics: `timing_s/teacher/...`, each step
that step's figures. The one stand-in for verl is the agent loop's generation (a scripted loop
registered as verl registers its own: no LLM server); Ray's remote call is a direct call."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import types

import numpy as np
import pytest
from kit.ports import refused_port

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = pytest.mark.verl

import megatron_rl_patches  # noqa: E402

# the suite's stand-in vLLM server, by its path: verl's lane installs a `tests` package of its own
_SPEC = importlib.util.spec_from_file_location("local_servers", pathlib.Path(__file__).parents[3] / "teachers" /
                                               "local_servers.py")
assert _SPEC is not None and _SPEC.loader is not None
servers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(servers)

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"
K, VOCAB, PROMPT_LENGTH, RESPONSE_LENGTH = 2, 40, 8, 8
# each step's samples: (prompt ids, response ids); the workers get two each (verl's chunking)
STEPS = ([([3, 4, 5], [6, 7, 8, 9]), ([10, 11], [12, 13, 14]), ([3, 5, 7, 9], [11, 13]), ([20, 21], [22, 23, 24])],
         [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10, 11]), ([12, 13, 14], [15]), ([16], [17, 18])])


class ScriptedLoop:
    """An agent loop of verl's registry that answers each sample's scripted response (the LLM's part)."""

    def __init__(self, **_: object) -> None:
        pass

    async def run(self, sampling_params: dict, **kwargs: object) -> object:
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

        prompt, response = list(kwargs["prompt"]), list(kwargs["response"])  # type: ignore[call-overload]
        return AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                               metrics=AgentLoopMetrics(generate_sequences=0.01 * len(response)))


def teacher_client(replica: object = None) -> object:
    """verl's real teacher client, built from verl's generated trainer config (one teacher, top-k K;
    `replica`: verl's own teacher replica's client, asked when the variable is unset)."""
    from omegaconf import OmegaConf
    from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager
    from verl.trainer import config as verl_config

    config = OmegaConf.load(os.path.join(os.path.dirname(verl_config.__file__), "_generated_ppo_megatron_trainer.yaml"))
    config.distillation.enabled = True
    config.distillation.distillation_loss.loss_mode = "forward_kl_topk"
    config.distillation.distillation_loss.topk = K
    teacher = config.distillation.teacher_models.teacher_model
    teacher.model_path, teacher.key, teacher.num_replicas, teacher.inference.name = "/unused", "gsm8k", 1, "vllm"
    return AsyncTeacherLLMServerManager(config, {"default": replica})


def worker(tokenizer: object, replica: object = None) -> object:
    """verl's real AgentLoopWorker with what its `generate_sequences` reads (its __init__ starts
    Ray-placed servers and loads a model config)."""
    from verl.experimental.agent_loop import agent_loop

    agent_loop._agent_loop_registry["scripted"] = {"_target_": f"{__name__}.ScriptedLoop"}
    one = object.__new__(agent_loop.AgentLoopWorker)
    one.config = types.SimpleNamespace(data={})
    one.rollout_config = types.SimpleNamespace(
        temperature=1.0, top_p=1.0, top_k=-1, calculate_log_probs=False, prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH, agent=types.SimpleNamespace(default_agent_loop="scripted"),
        val_kwargs=types.SimpleNamespace(top_p=1.0, top_k=-1, temperature=0.0))
    one.llm_client, one.tokenizer, one.processor, one.hf_model_type = None, tokenizer, None, None
    one.dataset_cls, one.tools, one.reward_loop_worker_handles, one.mm_processor_kwargs = None, [], None, {}
    one.distillation_enabled, one.teacher_key, one.teacher_server_manager = True, "data_source", teacher_client(replica)
    return one


class Remote:
    """A worker as verl's manager calls it (`worker.generate_sequences.remote(chunk)`), without Ray."""

    def __init__(self, one: object) -> None:
        self.generate_sequences = types.SimpleNamespace(remote=one.generate_sequences)  # type: ignore[attr-defined]


def prompts(step: list) -> object:
    from verl.protocol import DataProto

    def column(values: list) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    return DataProto.from_single_dict({
        "prompt": column([p for p, _ in step]), "response": column([r for _, r in step]),
        "raw_prompt": column([[{"role": "user", "content": "x"}]] * len(step)),
        "data_source": column(["gsm8k"] * len(step))})


@pytest.fixture
def tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, VOCAB)
    return PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), pad_token="t0")


def run_steps(tokenizer: object) -> list[dict]:
    """verl's trainer metrics of each step of STEPS (`compute_timing_metrics` of the manager's timing)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.trainer.ppo.metric_utils import compute_timing_metrics

    manager = object.__new__(AgentLoopManager)
    manager.agent_loop_workers = [Remote(worker(tokenizer)), Remote(worker(tokenizer))]
    out = []
    for step in STEPS:
        output = manager.generate_sequences(prompts(step))  # verl's auto_await runs it here
        assert output.batch["teacher_ids"].shape == (len(step), PROMPT_LENGTH + RESPONSE_LENGTH, K)  # served rows
        out.append(compute_timing_metrics(batch=output, timing_raw=output.meta_info["timing"]))
    return out


def test_each_steps_served_teacher_figures_reach_verls_trainer_metrics(tokenizer, clean_patch_state, monkeypatch):
    with servers.vllm_like() as server:
        monkeypatch.setenv(VARIABLE, f"{servers.url_of(server)};engine=vllm")
        megatron_rl_patches.apply(only="verl_topk_kd")
        steps = run_steps(tokenizer)
        where = servers.url_of(server).split("://", 1)[1]
        completions = server.answered("/v1/completions")
    replica = f"timing_s/teacher/replica/{where}"
    for step, metrics in zip(STEPS, steps):
        assert metrics["timing_s/teacher/samples"] == len(step)  # both workers' samples, summed
        assert metrics["timing_s/teacher/rows"] == sum(len(p) + len(r) - 1 for p, r in step)
        assert metrics["timing_s/teacher/bytes"] > 0 and metrics["timing_s/teacher/taken_out"] == 0
        assert metrics["timing_s/teacher/retries"] == metrics["timing_s/teacher/failovers"] == 0
        assert metrics[f"{replica}/failed"] == 0
        assert 0 < metrics[f"{replica}/latency_p50_s"] <= metrics[f"{replica}/latency_p95_s"] < 30
        assert "timing_s/agent_loop/generate_sequences/max" in metrics  # verl's own figures beside them
        assert metrics[f"{replica}/requests"] == len(step)  # the step's own: one request a sample, read once
    assert completions == sum(map(len, STEPS)) + 2  # and each worker's teacher's connect probe, not a sample's


def test_without_the_variable_verls_metrics_have_no_teacher_keys(tokenizer, clean_patch_state, monkeypatch):
    """Unset (verl's own teacher replicas answer; a stand-in one here): no `teacher/` key is added."""
    monkeypatch.delenv(VARIABLE, raising=False)
    megatron_rl_patches.apply(only="verl_topk_kd")

    async def generate(**kwargs):
        rows = len(kwargs["prompt_ids"])
        return types.SimpleNamespace(extra_fields={"prompt_ids": [[7] * K] * rows,
                                                   "prompt_logprobs": [[-1.0] * K] * rows})

    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.trainer.ppo.metric_utils import compute_timing_metrics

    replica = types.SimpleNamespace(generate=generate)
    manager = object.__new__(AgentLoopManager)
    manager.agent_loop_workers = [Remote(worker(tokenizer, replica)), Remote(worker(tokenizer, replica))]
    output = manager.generate_sequences(prompts(STEPS[0]))
    metrics = compute_timing_metrics(batch=output, timing_raw=output.meta_info["timing"])
    assert not [key for key in metrics if "teacher/" in key] and "timing_s/agent_loop/generate_sequences/max" in metrics



def test_a_replica_down_shows_in_verls_metrics_and_a_warning(tokenizer, clean_patch_state, monkeypatch, caplog):
    """Two replicas, one down: each worker's teacher starts with the other and takes the dead one
    out, verl's metrics count both take-outs (one a worker) and the retries, every sample is
    answered, and the client names the dead replica in a warning line. (A replica killed mid-step:
    the client's failover and hedging, tests/teachers/test_served_replicas.py; what it records
    reaches verl by this same seam.)"""
    with refused_port() as port, servers.vllm_like() as alive:  # a replica that is down: connections refused
        dead = f"127.0.0.1:{port}"
        monkeypatch.setenv(VARIABLE, f"{servers.url_of(alive)}|http://{dead};engine=vllm")
        megatron_rl_patches.apply(only="verl_topk_kd")
        with caplog.at_level("WARNING"):
            first, second = run_steps(tokenizer)
    assert first["timing_s/teacher/samples"] == len(STEPS[0]) and second["timing_s/teacher/samples"] == len(STEPS[1])
    assert first["timing_s/teacher/taken_out"] == 2 and first["timing_s/teacher/retries"] >= 1
    assert any(dead in record.getMessage() for record in caplog.records if record.levelname == "WARNING")
