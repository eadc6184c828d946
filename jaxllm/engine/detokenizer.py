"""Incremental detokenization and stop strings.

Text is decoded from a short window of previous tokens so that spaces and merges come out as
the full decode would, and nothing is emitted while the window ends in an incomplete UTF-8
sequence (the replacement character) — multi-byte characters and byte-fallback tokens appear
whole. Until a request finishes, the last (longest stop string - 1) characters are held back,
so a stream never shows the start of a stop string that is then withheld.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - 5, 0)
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        kwargs = {}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, **kwargs)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string matched, if any (text is then truncated)."""
        for tok in new_token_ids:
            self.token_ids.append(tok)
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                before = len(self.output_text)
                self.output_text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                hit = self._check_stop(before)
                if hit is not None:
                    self.stopped = True
                    return hit
        return None

    def get_text(self, finished: bool) -> str:
        """The text so far, less the tail that could still turn out to start a stop string."""
        if finished or self.stopped or self._max_stop <= 1:
            return self.output_text
        return self.output_text[:max(0, len(self.output_text) - (self._max_stop - 1))]

    def _check_stop(self, new_from: int) -> str | None:
        if not self.stop:
            return None
        # a stop string may start in text emitted earlier: look back by its length
        start = max(0, new_from - self._max_stop + 1)
        best = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[: i + len(s) if self.include_stop else i]
        return s
