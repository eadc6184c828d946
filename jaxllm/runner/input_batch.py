"""The persistent batch: one row per running request, kept across steps.

A request keeps its row from the step it is scheduled until it finishes or is preempted, so
per-step input preparation is a handful of vectorised numpy gathers over rows instead of a
Python loop over requests, and on-device per-row state (penalty counts, biases) has a stable
index.

The batch's token rows mirror the tokens of the requests it holds (jaxllm.core.request owns
them): filled from a new request's NewRequestData and extended by the tokens each step
samples. A request whose tokens are taken back is finished by the scheduler, which frees its
row, so a live row never holds a token its request does not. Per-request facts (logprobs,
bad words) come from the scheduler's output as decided by the request.
"""
from __future__ import annotations

import itertools

import numpy as np

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.scheduler_output import NewRequestData

# per-row sampling columns: name -> (dtype, value for an empty row)
COLUMNS = {
    "temperature": (np.float32, 0.0),
    "top_k": (np.int32, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "seed": (np.uint32, 0),
    "repetition_penalty": (np.float32, 1.0),
    "frequency_penalty": (np.float32, 0.0),
    "presence_penalty": (np.float32, 0.0),
    "min_tokens": (np.int32, 0),
    "has_bias": (np.bool_, False),
    "num_logprobs": (np.int32, -1),         # -1: no logprobs
    "num_prompt_logprobs": (np.int32, -1),
}


_NO_WRITES = (np.zeros(0, np.int32),) * 3


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)  # the tokens the host knows
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.block_table = np.full((max_num_seqs, max_blocks_per_seq), NULL_BLOCK, np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        # the block-table entries made since the last step, (row, first column, blocks) in
        # order: the device's copy of the table is changed by them (jaxllm.runner.block_table)
        self._writes: list[tuple[int, int, tuple[int, ...]]] = []
        # the columns of one dtype side by side in one table, whose spare last row holds the
        # empty row's values: a step gathers each table once, its padded rows from the spare
        self._tables = []
        self.cols = {}  # name -> the column (a view of its table), [max_num_seqs + 1]
        for dtype in dict.fromkeys(d for d, _ in COLUMNS.values()):
            names = [n for n, (d, _) in COLUMNS.items() if d is dtype]
            table = np.empty((max_num_seqs + 1, len(names)), dtype)
            table[:] = [COLUMNS[n][1] for n in names]
            self._tables.append((names, table))
            self.cols.update((n, table[:, j]) for j, n in enumerate(names))
        self.bad_words: list[list[list[int]] | None] = [None] * max_num_seqs  # multi-token only
        self.rows_with_bad_words: set[int] = set()
        self.lora_id = np.zeros(max_num_seqs, np.int64)  # the row's adapter key; 0: none
        self.mm: dict[int, list] = {}  # row -> its images (Request.mm), rows with any only
        self.row_of: dict[str, int] = {}
        self.version = 0  # changes whenever a row is taken or freed (and so its columns)
        # which request holds a row: a step's results for an earlier holder (finished while the
        # step ran, its id perhaps reused since) must not land in it
        self.serial = np.zeros(max_num_seqs, np.int64)
        self._next_serial = 0
        # lowest rows first, so that live rows stay packed at the front
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add_request(self, new: NewRequestData) -> int:
        """A row for a request the scheduler sends in full; returns the row."""
        row = self._add(new.req_id, new.token_ids, new.num_prompt_tokens, new.block_ids,
                        new.sampling_params, new.seed, new.num_logprobs,
                        new.num_prompt_logprobs, new.multi_token_bad_words, new.lora_id)
        if new.mm:
            self.mm[row] = new.mm
        return row

    def _add(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
             block_ids: list[int], params, seed: int, num_logprobs: int,
             num_prompt_logprobs: int, multi_token_bad_words: list[list[int]] | None,
             lora_id: int | None) -> int:
        if req_id in self.row_of:
            raise RuntimeError(f"request {req_id!r} already has a row")
        row = self._free_rows.pop()
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_blocks[row] = 0
        self.block_table[row] = NULL_BLOCK
        self.append_blocks(row, block_ids)
        c = self.cols
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty", "min_tokens"):
            c[name][row] = getattr(params, name)
        c["seed"][row] = seed
        c["has_bias"][row] = params.has_bias
        c["num_logprobs"][row] = num_logprobs
        c["num_prompt_logprobs"][row] = num_prompt_logprobs
        self.bad_words[row] = multi_token_bad_words
        if multi_token_bad_words:
            self.rows_with_bad_words.add(row)
        self.lora_id[row] = lora_id or 0
        self.row_of[req_id] = row
        self.version += 1
        self._next_serial += 1
        self.serial[row] = self._next_serial
        return row

    def remove(self, req_id: str) -> int | None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        self.bad_words[row] = None
        self.rows_with_bad_words.discard(row)
        self.mm.pop(row, None)
        self.lora_id[row] = 0
        for name, (_, fill) in COLUMNS.items():
            self.cols[name][row] = fill
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)
        return row

    def gather_cols(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Every column at `rows` (max_num_seqs: the empty row's values), one gather per
        dtype."""
        out = {}
        for names, table in self._tables:
            got = table[rows]
            out.update((n, got[:, j]) for j, n in enumerate(names))
        return out

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
        self._writes.append((row, start, tuple(block_ids)))  # (a copy: lists may grow later)

    def take_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block-table entries made since the last call, in order: (rows, columns,
        blocks)."""
        writes, self._writes = self._writes, []
        if not writes:
            return _NO_WRITES
        k = len(writes)
        lens = np.fromiter((len(b) for _, _, b in writes), np.int32, k)
        first = np.cumsum(lens) - lens
        rows = np.repeat(np.fromiter((r for r, _, _ in writes), np.int32, k), lens)
        cols = (np.arange(int(lens.sum()), dtype=np.int32)
                + np.repeat(np.fromiter((c for _, c, _ in writes), np.int32, k) - first, lens))
        blocks = np.fromiter(itertools.chain.from_iterable(b for _, _, b in writes), np.int32,
                             len(rows))
        return rows, cols, blocks

    def banned_tokens(self, row: int) -> list[int]:
        """Last tokens of multi-token bad words whose other tokens end the output so far."""
        words = self.bad_words[row]
        if not words:
            return []
        start, end = self.num_prompt_tokens[row], self.num_tokens[row]
        out = self.token_ids[row, start:end]
        banned = []
        for w in words:
            k = len(w) - 1
            if len(out) >= k and list(out[len(out) - k:]) == w[:-1]:
                banned.append(w[-1])
        return banned
