"""The engine's side of structured outputs: compiled grammars and the per-step bitmask.

Grammars are compiled against the engine's tokenizer on a thread of their own, once per
constraint (an LRU cache keyed by the constraint; the tokenizer is the engine's), so that
neither the engine loop nor the event loop waits for a compilation: a request whose grammar is
not ready waits outside the scheduler while other requests run. Each sequence advances a copy
of the compiled matcher. Each step, the rows that sample under a grammar get their allowed
tokens as a packed bitmask (32 tokens per int32 word), computed while the device runs the
step's forward pass and applied on the device before sampling.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.grammar import Grammar, validate

logger = logging.getLogger("jaxllm")

CACHE_SIZE = 512  # compiled grammars kept


@dataclass(frozen=True)
class GrammarSpec:
    """A validated constraint: its cache key, llguidance grammar and the field it came from."""
    key: tuple
    grammar: str
    field_name: str


def words(vocab_size: int) -> int:
    """int32 words of a packed bitmask over the vocabulary."""
    return -(-vocab_size // 32)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None,
                 cache_size: int = CACHE_SIZE, allow_additional_properties: bool = False):
        """allow_additional_properties: JSON Schema's permissive reading of objects that do
        not say whether other keys may follow (grammar.serialize); off: they may not."""
        self.tokenizer = tokenizer
        self.allow_additional_properties = allow_additional_properties
        self.vocab_size = vocab_size        # the model's: the device's bitmask width
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-grammar")
        self._lock = threading.RLock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._ll_tokenizer: Future | None = None
        self._executor = None
        self.num_compiled = 0
        self.num_masks = 0        # steps that computed a bitmask, and the host time it took
        self.mask_seconds = 0.0

    # compilation
    def prepare(self, params: StructuredOutputsParams) -> GrammarSpec:
        """Validate a constraint (cheap, no tokenizer): a ValueError names what is wrong."""
        if self.tokenizer is None:
            raise ValueError(f"{params.field_name} needs a tokenizer; this engine has none")
        return GrammarSpec(params.key(), validate(params, self.allow_additional_properties),
                           params.field_name)

    def warm(self) -> None:
        """Start building llguidance's view of the tokenizer (about a second, once)."""
        self._tokenizer()

    def _tokenizer(self) -> Future:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._pool.submit(self._build_tokenizer)
            return self._ll_tokenizer

    def _build_tokenizer(self):
        import llguidance.hf
        n_vocab = max(self.vocab_size, len(self.tokenizer))
        eos = self.eos_token_id if self.eos_token_id is not None else self.tokenizer.eos_token_id
        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab, eos_token=eos)

    def compile(self, spec: GrammarSpec) -> Future:
        """The compiled matcher of a constraint (a future): from the cache, or compiled on
        the grammar thread. A grammar that fails raises ValueError from the future."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            tokenizer = self._tokenizer()
            fut = self._pool.submit(self._compile, spec, tokenizer)
            self._cache[spec.key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: GrammarSpec, tokenizer: Future):
        import llguidance
        matcher = llguidance.LLMatcher(tokenizer.result(), spec.grammar, log_level=0)
        error = matcher.get_error()
        if error:  # cached like a success: the same grammar fails the same way
            raise ValueError(f"{spec.field_name}: the grammar does not compile: {error}")
        self.num_compiled += 1
        return matcher

    @staticmethod
    def grammar(compiled) -> Grammar:
        """A sequence's own matcher, at the start of the grammar."""
        return Grammar(compiled.deep_copy())

    # the per-step mask
    def bitmask(self, rows: list[tuple[int, Grammar]], num_rows: int) -> np.ndarray | None:
        """[num_rows, words] int32: the tokens each (row, grammar) may sample next; other rows
        allow everything. None when no row is constrained."""
        from llguidance.numpy import fill_next_token_bitmask_par
        import llguidance
        if not rows:
            return None
        start = time.perf_counter()
        n_vocab = self._tokenizer().result().vocab_size
        mask = np.full((num_rows, words(n_vocab)), -1, np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(g.matcher, i) for i, g in rows], mask)
        width = words(self.vocab_size)
        self.num_masks += 1
        self.mask_seconds += time.perf_counter() - start
        return mask if mask.shape[1] == width else np.ascontiguousarray(mask[:, :width])

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
