"""How the Triton top-k id step (:meth:`.backend.TritonTiles.topk`) cuts a call into launches:
each launch's candidates (k per vocabulary tile and row) and their merge into the running top-k
stay within a budget that is both the tile budget of the device and a share of the call's own
U = T·V_local·4 bytes, so the step's excess peak stays a small share of U at every T and does not
grow with T. A launch is a block of rows times a group of whole vocabulary tiles: each tile's
values are computed as in one launch over everything (same tile, same reduction order), and the
merge is exact (value descending, id ascending), so the ids do not depend on the cut."""
from __future__ import annotations

import math

import torch

from megatron_rl_patches.ops.kernels.torch_tiles import CPU_TILE_BYTES, CUDA_TILE_BYTES

# bytes one candidate costs while its launch is merged: the kernel's value (fp32) and id (int64),
# their concatenation with the running top-k, best_of's argsort by id (keys and indices, and the
# sort's double buffers on CUDA), the gathered copies and the stable sort by value with its buffers
TOPK_BYTES_PER_CANDIDATE = 80
# the share of the call's U a launch may hold (the running top-k and the ids come on top: T·k·20
# bytes, k ≤ 64 of V_local ≥ 32,768 columns: under 1% of U)
TOPK_SHARE_OF_U = 1 / 16


def topk_budget(n_rows: int, n_valid: int, device: torch.device) -> int:
    """Bytes one launch's candidates and their merge may hold."""
    tile_bytes = CUDA_TILE_BYTES if device.type == "cuda" else CPU_TILE_BYTES
    return min(tile_bytes, int(TOPK_SHARE_OF_U * n_rows * n_valid * 4))


def topk_launch_shape(n_rows: int, n_valid: int, k: int, block_m: int, block_n: int,
                      device: torch.device) -> tuple[int, int]:
    """(rows, columns) of one launch: whole row blocks of the kernel (`block_m`) and whole
    vocabulary tiles (`block_n`); every tile of a row block when they fit the budget (then as
    many row blocks as fit), else as many tiles as fit, at least one row block of one tile."""
    budget = topk_budget(n_rows, n_valid, device)
    tiles = math.ceil(n_valid / block_n)
    per_tile_block = TOPK_BYTES_PER_CANDIDATE * k * min(block_m, n_rows)
    tiles_fit = budget // per_tile_block
    if tiles_fit >= tiles:
        blocks = max(1, budget // (per_tile_block * tiles))
        return block_m * blocks, tiles * block_n
    return block_m, max(1, tiles_fit) * block_n


def topk_launch_bytes(rows: int, cols: int, k: int, block_n: int) -> int:
    """What one launch of `rows` rows over `cols` columns holds at its merge (the accounting
    :func:`topk_launch_shape` plans with)."""
    return TOPK_BYTES_PER_CANDIDATE * k * rows * math.ceil(cols / block_n)
