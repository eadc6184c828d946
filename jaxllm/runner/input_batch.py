"""The persistent batch: one row per running request, kept across steps.

A request keeps its row from the step it is scheduled until it finishes or is preempted, so
per-step input preparation is a handful of vectorised numpy gathers over rows instead of a
Python loop over requests, and on-device per-row state (penalty counts, biases) has a stable
index.
"""
from __future__ import annotations

import numpy as np

from jaxllm.core.block_pool import NULL_BLOCK


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed_tokens = np.zeros(max_num_seqs, np.int32)
        self.block_table = np.full((max_num_seqs, max_blocks_per_seq), NULL_BLOCK, np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        self.row_of: dict[str, int] = {}
        self.req_id_of: list[str | None] = [None] * max_num_seqs
        # lowest rows first, so that live rows stay packed at the front
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
            block_ids: list[int], num_computed_tokens: int) -> int:
        if req_id in self.row_of:
            raise RuntimeError(f"request {req_id!r} already has a row")
        row = self._free_rows.pop()
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.block_table[row] = NULL_BLOCK
        self.append_blocks(row, block_ids)
        self.row_of[req_id] = row
        self.req_id_of[row] = req_id
        return row

    def remove(self, req_id: str) -> int | None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return None
        self.req_id_of[row] = None
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1
