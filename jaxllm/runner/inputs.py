"""A step's padded numpy inputs, prepared from the scheduler's output and the persistent
batch: token ids, attention metadata, logits indices, sampling metadata, and with
speculative decoding the verified positions; with LoRA each token's adapter slot.

Everything here is vectorised over persistent-batch rows: no per-request Python on the
decode path beyond building the row list.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from jaxllm.core.scheduler_output import SchedulerOutput
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.layers.attention_metadata import attention_metadata
from jaxllm.runner.block_table import split_writes, write_capacity
from jaxllm.runner.buckets import StepShapes
from jaxllm.runner.input_batch import InputBatch
from jaxllm.runner.outputs import DispatchedStep
from jaxllm.runner.rejection_sampler import VerifyMetadata, num_verify_rows
from jaxllm.runner.sampler import MAX_BANNED, SamplingMetadata
from jaxllm.sampling_params import GREEDY_EPS

# sampling metadata fields that are a batch column as they are (column: the field)
_COLUMN_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                  "min_p": "min_p", "seed": "seeds", "repetition_penalty": "repetition_penalty",
                  "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                  "min_tokens": "min_tokens", "has_bias": "has_bias"}


class InputPreparer:
    def __init__(self, batch: InputBatch, shapes: StepShapes, block_size: int,
                 q_tile: Callable[[int], int], max_num_seqs: int, max_model_len: int,
                 num_spec: int = 0, spec_probabilistic: bool = False, lora=None,
                 mm_width: int = 0):
        self.batch = batch
        self.shapes = shapes
        self.block_size = block_size
        self.q_tile = q_tile
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_spec = num_spec
        self.spec_probabilistic = spec_probabilistic
        self.lora = lora  # jaxllm.lora.slots.LoRASlots, or None
        # a vision-language model: every step also carries image features [T, mm_width] and
        # the mask of the tokens they replace (the step's last input)
        self.mm_width = mm_width
        self._view: _RowsView | None = None  # the last step's rows (rows_view)
        self._none_banned: dict = {}  # read-only constants per shape
        self._no_next_ids: dict = {}

    def prepare(self, out: SchedulerOutput, pick_shape: Callable[[int, int], tuple[int, int]]):
        """Padded numpy inputs of one step, vectorised over persistent-batch rows, in the
        shape `pick_shape` chooses. Positions and which rows sample come from the scheduler;
        a token the host does not know yet (sampled by the step still in flight) is -1,
        taken from the device. A multi-step call's inputs are those of its first pass: one
        token per request. The attention metadata's block_tables are the block-table entries
        made since the last step (TableWrites); those the step cannot hold come back as
        chunks to write before it. Returns (the step's record, its shape (T, S), its inputs,
        the chunks)."""
        batch = self.batch
        req_ids = list(out.num_scheduled_tokens)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int32, len(req_ids))
        if out.num_passes > 1:
            n = np.ones(len(req_ids), np.int32)
        else:
            n = np.fromiter((out.num_scheduled_tokens[r] for r in req_ids), np.int32, len(req_ids))
        start_of = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        start_of.update((d.req_id, d.num_computed_tokens) for d in out.scheduled_cached_reqs)
        starts = np.fromiter((start_of[r] for r in req_ids), np.int32, len(req_ids))
        if len(out.sampling_req_ids) == len(req_ids):  # (every decode step)
            final = np.ones(len(req_ids), np.bool_)
        else:
            final = np.fromiter((r in out.sampling_req_ids for r in req_ids), np.bool_, len(req_ids))
        spec = out.scheduled_spec_decode_tokens
        if spec:
            nd = np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int32, len(req_ids))
        else:
            nd = np.zeros(len(req_ids), np.int32)
        S_real, T_real = len(req_ids), int(n.sum())
        # a multi-step call takes the decode shape, compiled before serving (passes_shapes)
        T, S = (self.shapes.pick if out.num_passes > 1 else pick_shape)(T_real, S_real)
        num_blocks = np.zeros(S, np.int32)
        num_blocks[:S_real] = batch.num_blocks[rows]
        writes, chunks = split_writes(*batch.take_writes(),
                                      write_capacity(T, S, self.block_size), self.max_num_seqs,
                                      num_blocks)
        qt = self.q_tile(T)
        md = attention_metadata(starts, n, batch.block_table, T, S, self.block_size, qt,
                                rows=rows, on_device=writes,
                                num_tile_slots=self.shapes.tiles(T, S, qt))
        tok_rows = rows[md.token_seq_ids[:T_real]]
        pos = md.positions[:T_real]
        input_ids = np.zeros(T, np.int32)
        known = pos < batch.num_tokens[tok_rows]
        input_ids[:T_real] = np.where(known, batch.token_ids[tok_rows, np.where(known, pos, 0)], -1)
        logits_idx = np.zeros(S, np.int32)
        logits_idx[:S_real] = md.query_start_loc[1:S_real + 1] - 1
        smd = self.sampling_metadata(rows, n, starts, final, md, T, S, nd)
        inputs = (input_ids, md, logits_idx, smd)
        if self.num_spec:
            inputs += (self.verify_metadata(spec, req_ids, n, nd, md, smd, input_ids, T, S),)
        if self.mm_width:
            inputs += (self.image_features(rows, starts, n, md, T),)
        view = self._view  # (the rows' columns, as sampling_metadata read them)
        step = DispatchedStep(req_ids, rows, view.serials, starts, n, final, view.num_logprobs,
                              view.num_prompt_logprobs, view.num_prompt_tokens, nd)
        return step, (T, S), inputs, chunks

    def image_features(self, rows: np.ndarray, starts: np.ndarray, n: np.ndarray, md, T: int):
        """(features [T, width], mask [T]): the rows of each image's features whose tokens
        this step computes, at those tokens' places (prompt chunks cut images anywhere)."""
        embeds = np.zeros((T, self.mm_width), np.float32)
        mask = np.zeros(T, np.bool_)
        if self.batch.mm:  # (few rows have images: no loop over all rows)
            for i in np.nonzero(np.isin(rows, list(self.batch.mm)))[0].tolist():
                s, e = int(starts[i]), int(starts[i] + n[i])
                for off, length, _, feats in self.batch.mm[int(rows[i])]:
                    lo, hi = max(s, off), min(e, off + length)
                    if lo < hi:
                        at = int(md.query_start_loc[i]) + lo - s
                        embeds[at:at + hi - lo] = feats[lo - off:hi - off]
                        mask[at:at + hi - lo] = True
        return embeds, mask

    def token_slots(self, rows: np.ndarray, md: AttentionMetadata, T: int):
        """Each token's adapter slot (0: none), the step's adapters brought in first.
        Returns (the slots [T], {adapter: why it could not be brought in})."""
        keys = self.batch.lora_id[rows].tolist()
        slot_of, failures = self.lora.activate(keys)
        row_slots = np.fromiter((slot_of.get(k, 0) for k in keys), np.int32, len(rows))
        T_real = int(md.query_start_loc[-1])
        token_slots = np.zeros(T, np.int32)
        token_slots[:T_real] = row_slots[md.token_seq_ids[:T_real]]
        return token_slots, failures

    def verify_metadata(self, spec, req_ids, n, nd, md, smd, input_ids, T: int, S: int):
        """The proposals are the last nd[i] tokens of sequence i: put them in the input ids
        (from the host, or -2 - j for a draft model's proposal j held on the device), and
        list the positions that score them."""
        R = num_verify_rows(T, S, self.num_spec)
        S_real, R_real = len(req_ids), int(nd.sum())
        if R_real > R:
            raise RuntimeError(f"{R_real} proposals exceed the step's {R} verified positions")
        seq = np.repeat(np.arange(S_real, dtype=np.int32), nd)
        pos = np.arange(R_real, dtype=np.int32) - np.repeat(np.cumsum(nd) - nd, nd).astype(np.int32)
        first = md.query_start_loc[:S_real] + n - nd  # each sequence's first proposal
        if R_real:
            drafts = np.concatenate([spec[r] for r, m in zip(req_ids, nd) if m]).astype(np.int32)
            input_ids[first[seq] + pos] = np.where(drafts >= 0, drafts, -2 - pos)
        token_idx = np.zeros(R, np.int32)
        token_idx[:R_real] = first[seq] + pos - 1
        valid = np.zeros(R, np.bool_)
        valid[:R_real] = True
        nd_pad = np.zeros(S, np.int32)
        nd_pad[:S_real] = nd
        prob = (nd_pad > 0) & (smd.temperature >= GREEDY_EPS) & self.spec_probabilistic
        pad = np.zeros(R, np.int32)
        pad[:R_real] = seq
        pos_pad = np.zeros(R, np.int32)
        pos_pad[:R_real] = pos
        return VerifyMetadata(token_idx, pad, pos_pad, valid, nd_pad, prob, np.bool_(R_real > 0),
                              np.bool_(prob.any()))

    def rows_view(self, rows: np.ndarray, S: int) -> "_RowsView":
        """What the step's rows hold that changes only when a row is taken or freed: their
        sampling columns and the flags read from them, kept while the batch's rows and the
        step's rows stay the same (every decode step of a steady batch)."""
        key = (self.batch.version, S, rows.tobytes())
        view = self._view
        if view is None or view.key != key:
            view = self._view = _RowsView(self.batch, rows, S, self.max_num_seqs, key)
        return view

    def sampling_metadata(self, rows, n, starts, final, md, T: int, S: int,
                          num_draft=None) -> SamplingMetadata:
        batch = self.batch
        view = self.rows_view(rows, S)
        cols = view.cols
        S_real, T_real = len(rows), int(n.sum())
        # the output index of the token each row samples: its seed stream's position
        gen_index = np.zeros(S, np.int32)
        gen_index[:S_real] = starts + n - view.num_prompt_tokens
        any_min_tokens = False
        if view.any_min_tokens:
            # verified proposals are drawn at earlier output indices than the row's last token
            first_index = gen_index.copy()
            if num_draft is not None:
                first_index[:S_real] -= num_draft
            any_min_tokens = bool((cols["min_tokens"] > first_index).any())
        is_final = np.zeros(S, np.bool_)
        is_final[:S_real] = final
        banned, any_banned = _constant(self._none_banned, (S, MAX_BANNED), -1), False
        if batch.rows_with_bad_words:  # (few requests have them: no loop over all rows)
            for i in np.nonzero(np.isin(rows, list(batch.rows_with_bad_words)))[0].tolist():
                b = batch.banned_tokens(int(rows[i]))[:MAX_BANNED]
                if b:
                    if not any_banned:
                        banned = banned.copy()
                    banned[i, :len(b)] = b
                    any_banned = True
        next_ids = _constant(self._no_next_ids, (T,), 0)
        if view.any_prompt_logprobs:
            next_ids = np.zeros(T, np.int32)
            pos = md.positions[:T_real]
            tok_rows = rows[md.token_seq_ids[:T_real]]
            nxt = np.minimum(pos + 1, self.max_model_len - 1)
            in_prompt = pos + 1 < batch.num_prompt_tokens[tok_rows]
            next_ids[:T_real] = np.where(in_prompt, batch.token_ids[tok_rows, nxt], -1)
        return SamplingMetadata(
            **{field: cols[name] for name, field in _COLUMN_FIELDS.items()},
            gen_index=gen_index, rows=view.pad_rows, is_final=is_final, banned=banned,
            next_ids=next_ids, any_min_tokens=np.bool_(any_min_tokens),
            any_banned=np.bool_(any_banned), **view.flags)


def _constant(cache: dict, shape: tuple, fill: int) -> np.ndarray:
    """A read-only int32 array of `shape` filled with `fill`, made once."""
    x = cache.get(shape)
    if x is None:
        x = cache[shape] = np.full(shape, fill, np.int32)
        x.flags.writeable = False
    return x


class _RowsView:
    """A step's rows' sampling columns (padded rows: the empty row's values), their prompt
    lengths, serials and what they ask for, gathered once for a set of rows (read-only)."""

    def __init__(self, batch: InputBatch, rows: np.ndarray, S: int, spare: int, key):
        self.key = key
        S_real = len(rows)
        pad_rows = np.full(S, spare, np.int32)
        pad_rows[:S_real] = rows
        cols = batch.gather_cols(pad_rows)
        self.pad_rows, self.cols = pad_rows, cols
        self.num_prompt_tokens = batch.num_prompt_tokens[rows]
        self.serials = batch.serial[rows]
        self.num_logprobs = cols["num_logprobs"][:S_real]
        self.num_prompt_logprobs = cols["num_prompt_logprobs"][:S_real]
        for x in (pad_rows, self.num_prompt_tokens, self.serials, *cols.values()):
            x.flags.writeable = False
        random = cols["temperature"] >= GREEDY_EPS
        filtered = (cols["top_k"] > 0) | (cols["top_p"] < 1) | (cols["min_p"] > 0)
        penalised = ((cols["repetition_penalty"] != 1) | (cols["frequency_penalty"] != 0)
                     | (cols["presence_penalty"] != 0))
        self.any_min_tokens = bool((cols["min_tokens"] > 0).any())
        self.any_prompt_logprobs = bool((self.num_prompt_logprobs >= 0).any())
        self.flags = dict(any_random=np.bool_(random.any()),
                          any_filter=np.bool_((random & filtered).any()),
                          any_penalty=np.bool_(penalised.any()),
                          any_bias=np.bool_(cols["has_bias"].any()),
                          any_logprobs=np.bool_((cols["num_logprobs"] >= 0).any()),
                          any_prompt_logprobs=np.bool_(self.any_prompt_logprobs))
