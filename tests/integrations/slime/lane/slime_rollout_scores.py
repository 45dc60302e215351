"""Run in a fresh interpreter (as slime's rollout manager runs in its own process) by the served
teacher's rollout lane tests and benchmark: slime 624b824a's real rollout functions
(`generate_and_rm_group` -> `generate_and_rm` -> `generate`, its sample hooks, the rollout
manager's `log_rollout_data`, `_convert_samples_to_train_data` and `_split_train_data_by_dp`) with
the package's `slime_opd` patches, SGLang's `/generate` answered by `GenerateStandIn` (token ids
sampled by a real vLLM server of a tiny model: SGLang's CPU kernel needs a source build), ray and
SGLang's own modules inert. The served teachers come from MEGATRON_RL_PATCHES_OPD_TEACHERS (and
MEGATRON_RL_PATCHES_OPD_SCORE_AT) as in the rollout manager's runtime_env.

    python slime_rollout_scores.py CONFIG.json
CONFIG: {"engine": the vLLM URL generating, "model": its directory (slime's --hf-checkpoint),
"prompts": [prompt length per prompt], "group": samples per prompt (slime's --n-samples-per-prompt;
default 1): each prompt's samples one `generate_and_rm_group` call, GRPO's, their responses seeded
by session ids the script names (a rerun samples the same responses whatever order the requests
arrive in), "response": new tokens per sample (slime's --rollout-max-response-len), "spread":
whether the responses end at different lengths (as EOS ends them: each between a quarter of it and
all of it), "seed", "rounds": rollouts in a row (one process, as slime's long-lived rollout
manager: seeds seed, seed + 1, ...), "contexts": [per sample a train_metadata dict or null], "out":
a torch.save path}. Writes per round the data-parallel rank's rollout data (one rank), the
rollout's seconds and the extra metrics slime's `log_rollout_data` received; prints one JSON line of the figures."""
from __future__ import annotations

import asyncio
import http.server
import json
import sys
import threading
import time
import types
import urllib.request
import zlib
from typing import Any

from megatron_rl_patches.testing.service_stubs import SERVICES, install_service_stubs

# ray, SGLang and two packages slime's reward hub imports at module level (unused here: the reward is ours)
install_service_stubs((*SERVICES, "sglang", "sglang_router", "aiohttp", "pylatexenc"))

import megatron_rl_patches  # noqa: E402

LOGGED: dict[str, Any] = {}


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


class GenerateStandIn(http.server.ThreadingHTTPServer):
    """SGLang's `/generate` (token ids in, sampled ids and their log-probs out, slime's meta_info
    shape) answered by a vLLM server's `/v1/completions` over the same ids: every new token
    sampled by the real model, no stop token (`ignore_eos`: each response `max_new_tokens` long)."""

    daemon_threads = True

    def __init__(self, engine: str, spread: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), GenerateAnswer)
        self.engine, self.spread = engine, spread
        with urllib.request.urlopen(f"{engine}/v1/models", timeout=60) as reply:
            self.model = json.loads(reply.read())["data"][0]["id"]
        self.seed = 0
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, body: dict, session: str | None = None) -> dict:
        params = body.get("sampling_params", {})
        self.seed += 1
        seed = self.seed if session is None else zlib.crc32(session.encode())  # a named sample's own seed
        longest = int(params["max_new_tokens"])
        wanted = longest  # with `spread`: where an EOS would have ended it, from the prompt's ids
        if self.spread:
            wanted = max(1, round(longest * (0.25 + 0.75 * (zlib.crc32(bytes(body["input_ids"])) % 1000) / 999)))
        reply = post_json(f"{self.engine}/v1/completions", {
            "model": self.model, "prompt": list(body["input_ids"]), "max_tokens": wanted,
            "temperature": float(params.get("temperature", 1.0)), "top_p": float(params.get("top_p", 1.0)),
            "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True, "seed": seed})
        choice = reply["choices"][0]
        ids = [int(token.split(":")[-1]) for token in choice["logprobs"]["tokens"]]
        return {"text": choice.get("text", ""), "meta_info": {
            "output_token_logprobs": [[float(lp), i, None] for lp, i in zip(choice["logprobs"]["token_logprobs"], ids)],
            "finish_reason": {"type": "length", "length": len(ids)} if len(ids) >= longest else {"type": "stop"}}}


class GenerateAnswer(http.server.BaseHTTPRequestHandler):
    server: GenerateStandIn

    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        data = json.dumps(self.server.answer(body, self.headers.get("X-SMG-Routing-Key"))).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


async def zero_reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """The rollout's reward (slime's --custom-rm-path): none needed here."""
    return 0.0


def captured_log(rollout_id: int, args: Any, samples: Any, rollout_extra_metrics: dict, rollout_time: float) -> bool:
    """slime's --custom-rollout-log-function-path: what its log_rollout_data was handed, kept (in
    the script's own module: slime imports this file again under its name)."""
    sys.modules["__main__"].LOGGED.update(rollout_extra_metrics or {})
    return True  # slime's own logging skipped (no tracker here)


def rollout_args(engine: GenerateStandIn, config: dict) -> Any:
    """slime's arguments as its rollout functions read them (the rollout manager's parsed args)."""
    group = int(config.get("group", 1))
    return types.SimpleNamespace(
        hf_checkpoint=config["model"], sglang_router_ip="127.0.0.1", sglang_router_port=engine.server_address[1],
        rollout_num_engines=1, sglang_server_concurrency=64, sglang_dp_size=None, use_distributed_post=False,
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=config["response"],
        rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False, n_samples_per_prompt=group,
        partial_rollout=False, mask_offpolicy_in_partial_rollout=False, group_rm=False,
        custom_generate_function_path=None, custom_rm_path="slime_rollout_scores.zero_reward", rm_type=None,
        use_rollout_routing_replay=False, ci_test=False, rollout_sample_hook_path=None,
        # slime sends a sample's session id (X-SMG-Routing-Key) with consistent hashing: the stand-in seeds by it
        router_policy="consistent_hashing" if group > 1 else None,
        sglang_enable_deterministic_inference=False,
        custom_rollout_log_function_path="slime_rollout_scores.captured_log",
        load_debug_rollout_data=False, reward_key=None, advantage_estimator="reinforce", rewards_normalization=False,
        rollout_batch_size=len(config["prompts"]), micro_batch_size=1, use_dynamic_batch_size=False,
        max_tokens_per_gpu=None, balance_data=False, balance_by_flops=False,
        global_batch_size=len(config["prompts"]) * group,
        rollout_data_transport="object-store")


def main(config: dict) -> dict:
    import torch

    megatron_rl_patches.apply(only=["slime_opd"], strict=True)
    import slime.ray.rollout as manager_module
    from slime.rollout import sglang_rollout
    from slime.utils.http_utils import init_http_client
    from slime.utils.types import Sample

    engine = GenerateStandIn(config["engine"], bool(config.get("spread", False)))
    args = rollout_args(engine, config)
    init_http_client(args)
    state = sglang_rollout.GenerateState(args)
    manager_module.ray = types.SimpleNamespace(put=lambda value, **_: value)  # the object store: the dict itself
    manager = object.__new__(manager_module.RolloutManager)
    manager.args = args
    manager.custom_convert_samples_to_train_data_func = manager.custom_reward_post_process_func = None
    manager.set_train_parallel_config({"dp_size": 1, "cp_size": 1, "vpp_size": 1,
                                       "microbatch_group_size_per_vp_stage": 1})
    rounds = []
    for seed in range(config["seed"], config["seed"] + int(config.get("rounds", 1))):
        gen = torch.Generator().manual_seed(seed)
        group, groups = int(config.get("group", 1)), []
        metas = config.get("contexts") or [None] * 999
        for number, length in enumerate(config["prompts"]):
            prompt = torch.randint(1, 64, (length,), generator=gen).tolist()
            members = range(number * group, (number + 1) * group)
            groups.append([Sample(index=index, group_index=number, prompt="", tokens=list(prompt),
                                  train_metadata=metas[index],
                                  session_id=None if group == 1 else f"{seed}-{index}") for index in members])

        async def rollout(groups: list = groups) -> list:
            return await asyncio.gather(*(sglang_rollout.generate_and_rm_group(args, members,
                                                                               state.sampling_params.copy())
                                          for members in groups))

        started = time.perf_counter()
        groups = asyncio.run(rollout())
        seconds = time.perf_counter() - started
        done = [s for group in groups for s in group]
        LOGGED.clear()
        manager_module.log_rollout_data(0, args, done, {}, seconds)  # as the rollout manager's generate() does
        (box,) = manager._split_train_data_by_dp(manager._convert_samples_to_train_data(done))
        rounds.append({"rank": box.inner, "logged": dict(LOGGED), "rollout_s": seconds})
    torch.save({"rounds": rounds}, config["out"])
    engine.shutdown()
    return {"rollout_s": [r["rollout_s"] for r in rounds],
            "logged": {k: v for k, v in rounds[-1]["logged"].items() if k.startswith("teacher/")},
            "keys": sorted(rounds[-1]["rank"])}


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        print(json.dumps(main(json.load(handle))))
