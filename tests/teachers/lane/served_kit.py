"""The served lane's constants: the server's limits and the tiny checkpoint's shape."""
from __future__ import annotations

import os

VLLM_PYTHON = os.environ.get("MRP_VLLM_PYTHON", "")
API_KEY = "served-lane-key"
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 20
VOCAB = 1001
# vLLM's CPU attention serves head sizes 32, 64, ... (not the kit's default 8)
MODEL_SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, max_position_embeddings=MAX_MODEL_LEN,
                   vocab_size=VOCAB)
# vLLM's pooling runner serving a causal LM's final hidden states per token (CONTEXT §19)
# serve-teacher's KV block in the lane: its default on CPU (vLLM's CPU default of 128 would leave the lane's
# prompts of < 256 tokens one or two blocks)
OURS_BLOCK = 32
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')
