"""vLLM's engine held in process (`TeacherEngine`): the pooling runner serving a causal LM's final
hidden state at every position (`token_embed`, no activation), its prefix cache on. `states(ids,
start)` computes one sample: with `start` None every position, the cache not read (a full pass, as
vLLM's own server computes it); with `start` the positions from `start` - 1 on, the group's shared
prefix read from the cache where an earlier member of the group wrote it (`prefixes`). Rows for
prompt log-probs come from the same states through the model's output layer (`rows`), in float32.
vLLM is imported only here, when the command runs."""
# lazy imports: import cost: vLLM, FastAPI, uvicorn and prometheus_client load only when the command runs
from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.apps.serve_teacher.prefixes import SharedPrefixes
from megatron_rl_patches.apps.serve_teacher.versions import check_vllm_version

POOLER = {"task": "token_embed"}
# serve-teacher's KV block on CPU where the engine arguments name none: vLLM shares whole blocks only, and its
# CPU default of 128 shares nothing of a prompt under 128 tokens; its CPU attention takes multiples of 32 (16
# is refused: "No common block size"), and 32 runs as fast as 128 (docs/benchmarks.md, "KV block size")
CPU_BLOCK = 32


def default_block_size(is_cpu: bool) -> int | None:
    """The block serve-teacher asks for where the engine arguments name none: on CPU `CPU_BLOCK`, the
    smallest its attention runs; elsewhere vLLM's own default (16 on a GPU, already its smallest)."""
    return CPU_BLOCK if is_cpu else None


def engine_arguments(model: str, extra: Sequence[str]) -> Any:
    """vLLM's `AsyncEngineArgs` from its own command-line parser (`extra`: the engine arguments after
    `--`), with what this server needs: the pooling runner per token, the prefix cache on, and the
    KV block `default_block_size` where `extra` names none."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="serve-teacher -- (vLLM engine arguments)"))
    given = parser.parse_args(["--model", model, *extra])
    for name, wanted in (("runner", "pooling"), ("convert", "embed")):
        if getattr(given, name, None) not in (None, "auto", wanted):
            raise ValueError(f"serve-teacher runs vLLM's engine with --{name} {wanted} (hidden states per token, "
                             f"prompt log-probs formed from them); drop --{name} {getattr(given, name)} from the "
                             f"engine arguments")
    if getattr(given, "enable_prefix_caching", None) is False:
        raise ValueError("serve-teacher shares a group's prefix through vLLM's prefix cache: drop "
                         "--no-enable-prefix-caching from the engine arguments")
    block: list[str] = []
    if getattr(given, "block_size", None) is None:
        from vllm.platforms import current_platform

        chosen = default_block_size(current_platform.is_cpu())
        block = [] if chosen is None else ["--block-size", str(chosen)]
    ours = parser.parse_args(["--model", model, *extra, *block, "--runner", "pooling", "--convert", "embed",
                              "--pooler-config", json.dumps(POOLER), "--enable-prefix-caching"])
    ours.disable_log_stats = False  # the engine's counters (/metrics)
    return AsyncEngineArgs.from_cli_args(ours)


class TeacherEngine:
    """The engine, the model's output layer (float32) and the groups' shared prefixes."""

    def __init__(self, model: str, extra: Sequence[str]) -> None:
        import vllm
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        check_vllm_version(vllm.__version__)
        arguments = engine_arguments(model, extra)
        self.engine = AsyncLLM.from_engine_args(arguments, usage_context=UsageContext.OPENAI_API_SERVER)
        config = self.engine.model_config
        self.name = (arguments.served_model_name or [model])[0] if isinstance(arguments.served_model_name, list) \
            else arguments.served_model_name or model
        self.root = model
        self.max_model_len = int(config.max_model_len)
        self.max_logprobs = int(config.max_logprobs)
        self.vocab_size = int(config.get_vocab_size())
        self.block_size = int(self.engine.vllm_config.cache_config.block_size)
        self.head = output_layer(model, self.vocab_size)
        self.prefixes = SharedPrefixes()
        self.counter = itertools.count()
        self.fallbacks = 0  # samples computed again whole: their cached rows were not kept

    async def pass_once(self, ids: list[int], read_cache: bool) -> tuple[torch.Tensor, int]:
        """One pass: (the states of the positions computed [len(ids) - cached, H], cached)."""
        from vllm import PoolingParams

        params = PoolingParams(task="token_embed", use_activation=False, skip_reading_prefix_cache=not read_cache)
        final = None
        async for output in self.engine.encode({"prompt_token_ids": ids}, params, f"teacher-{next(self.counter)}"):
            final = output
        assert final is not None
        states = final.outputs.data
        cached = int(getattr(final, "num_cached_tokens", 0) or 0) if read_cache else 0
        return states[len(states) - (len(ids) - cached):], cached

    async def states(self, ids: list[int], start: int | None) -> torch.Tensor:
        """Every position's state (`start` None), or positions `start` - 1 ... end (see the module's words)."""
        if start is None:
            states, _ = await self.pass_once(ids, read_cache=False)
            return states
        async with self.prefixes.turn(ids, start):
            computed, cached = await self.pass_once(ids, read_cache=True)
            before = self.prefixes.rows(ids, start, cached)
            if before is None:  # rows inside the cached prefix that no kept member covers: a full pass
                self.fallbacks += 1
                computed, cached = await self.pass_once(ids, read_cache=False)
                before = computed[:0]
            rows = torch.cat([before.to(computed.dtype).reshape(-1, computed.shape[1]),
                              computed[max(start - 1 - cached, 0):]])
            self.prefixes.keep(ids, start, rows)
            return rows

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text` in the served model's tokenizer's ids; LookupError where it was started without one."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise LookupError("Tokenizer not available: the engine was started with --skip-tokenizer-init")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def shutdown(self) -> None:
        """The engine and its core process stopped (once; a second call does nothing)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()


def output_layer(model: str, vocab_size: int) -> torch.Tensor:
    """The model's output layer [V, H] in float32 (lm_head.weight, or the embedding where tied; a
    family's logit scale applied, a soft cap refused), read as the trainer's head reads it."""
    from megatron_rl_patches.teachers.head.teacher_head import TeacherHead  # lazy: import cost: safetensors, torch

    head = TeacherHead.from_hf(model, dtype=torch.float32)
    if head.vocab_size != vocab_size:
        raise ValueError(f"{model}: the output layer holds {head.vocab_size} rows, the engine a vocabulary of "
                         f"{vocab_size}")
    return head.weight[:vocab_size]
