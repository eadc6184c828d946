"""Incremental detokenization and stop strings, at constant work per token.

With a fast tokenizer, the `tokenizers` library's DecodeStream turns each new token into the
text it completes (one native call per token; it holds back incomplete UTF-8 sequences and
byte-fallback pieces, and is primed with the prompt's last tokens so that spaces and merges
come out as a full decode would). A byte-level BPE decoder (GPT-2's) decodes each token to its
own bytes, so once the text so far ends on a whole character, a token that is whole characters
by itself adds exactly its own text: those come from a table shared by all requests (a dict
lookup rather than a native call per token), and a stream takes over only from a token that
ends inside a character until the character is complete. Other tokenizers decode a short
window of recent tokens.
Stop strings are searched only in the text near the new tokens. Until a request finishes, the
last (longest stop string - 1) characters are held back, so a stream never shows the start of a
stop string that is then withheld.
"""
from __future__ import annotations

PRIME_TOKENS = 6  # prompt tokens the decoder sees before the first output token
_UNSEEN = object()


def token_pieces_apply(tokenizer) -> bool:
    """Whether a token's text in context is its text alone (after text that ends on a whole
    character): true of the byte-level decoder, which maps each token to bytes and decodes
    their concatenation; not of SentencePiece's, which strips a leading space at the start."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    from tokenizers import decoders
    return isinstance(backend.decoder, decoders.ByteLevel)


def piece_table(tokenizer, skip_special_tokens: bool) -> dict | None:
    """Every token's own text, from one batched native decode (once per tokenizer), so
    that the loop looks tokens up and never decodes one alone: None where a token's text ends
    inside a character, and for added tokens (the decoder may treat them apart). None where
    token_pieces_apply does not hold."""
    if not token_pieces_apply(tokenizer):
        return None
    backend = tokenizer.backend_tokenizer
    texts = backend.decode_batch([[i] for i in range(backend.get_vocab_size())],
                                 skip_special_tokens=skip_special_tokens)
    table = {i: None if t.endswith("\ufffd") else t for i, t in enumerate(texts)}
    table.update(dict.fromkeys(backend.get_added_tokens_decoder()))
    return table


class _Text:
    """Text that grows at its end, kept as runs whose lengths fall towards the end: an append
    merges the last runs while the last is at least as long as the one before (a binary
    counter). With pieces of bounded length (tokens' texts) there are O(log n) runs and a
    character is copied O(log n) times over the text's life, where a str += copies the whole
    text at every append; reading or cutting the end touches only the short runs there."""
    __slots__ = ("runs", "length")

    def __init__(self):
        self.runs: list[str] = []
        self.length = 0

    def append(self, text: str) -> None:
        runs = self.runs
        if runs and len(text) < len(runs[-1]):  # (most appends: a token's text after more)
            runs.append(text)
        elif text:
            runs.append(text)
            while len(runs) > 1 and len(runs[-1]) >= len(runs[-2]):
                last = runs.pop()
                runs[-1] += last
        self.length += len(text)

    def whole(self) -> str:
        if len(self.runs) > 1:
            self.runs = ["".join(self.runs)]
        return self.runs[0] if self.runs else ""

    def slice(self, start: int, end: int) -> str:
        """The text's [start:end], from the runs it spans, found from the end."""
        last = self.runs[-1] if self.runs else ""
        if start >= self.length - len(last):  # (a delta's text: within the last run)
            return last[start - self.length + len(last):end - self.length + len(last)]
        if start >= end:
            return ""
        parts, pos = [], self.length
        for run in reversed(self.runs):
            run_start = pos - len(run)
            if run_start < end:
                parts.append(run[max(start - run_start, 0):end - run_start])
            if run_start <= start:
                break
            pos = run_start
        return "".join(reversed(parts))

    def truncate(self, n: int) -> None:
        """Keep the first n characters."""
        while self.length > n:
            last = self.runs[-1]
            if self.length - len(last) >= n:
                self.runs.pop()
                self.length -= len(last)
            else:
                self.runs[-1] = last[:len(last) - (self.length - n)]
                self.length = n


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True, pieces: dict | None = None):
        """`pieces`: the table of tokens' texts to share with other requests of the same
        tokenizer and skip_special_tokens (used where token_pieces_apply)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._text = _Text()
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._recent = ""  # the text's last (longest stop string - 1) characters
        self.stopped = False
        self.num_decode_calls = 0  # native decodes: at most one per token
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._pieces = None
        # spaces_between_special_tokens only changes a slow tokenizer's decode
        if backend is not None and spaces_between_special_tokens:
            self._backend = backend
            prime = list(prompt_token_ids[-PRIME_TOKENS:])
            self._stream = None
            if token_pieces_apply(tokenizer):
                self._pieces = {} if pieces is None else pieces
                if not self._pieces:  # added tokens' text the decoder may treat apart: streamed
                    self._pieces.update(dict.fromkeys(backend.get_added_tokens_decoder()))
                # a prompt that ends inside a character starts with a stream
                if prime and backend.decode(
                        prime, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
                    self._stream = self._new_stream(prime)
            else:
                self._stream = self._new_stream(prime)
        else:
            self._stream = None
            # the window: tokens from prefix_offset on are decoded, those before read_offset
            # are already text
            self._window = list(prompt_token_ids[-PRIME_TOKENS:])
            self._read = len(self._window)

    def _new_stream(self, prime: list[int]):
        from tokenizers.decoders import DecodeStream
        return DecodeStream(ids=list(prime) or None, skip_special_tokens=self.skip_special_tokens)

    def _piece(self, token: int) -> str | None:
        """A token's own text, or None where it ends inside a character."""
        self.num_decode_calls += 1
        piece = self._backend.decode([token], skip_special_tokens=self.skip_special_tokens)
        if piece.endswith("\ufffd"):
            piece = None
        self._pieces[token] = piece
        return piece

    def _texts(self, tokens: list[int]) -> list[str]:
        """Each token's text: from the table while every piece is known and whole."""
        if self._pieces is not None and self._stream is None:
            texts = list(map(self._pieces.get, tokens))
            if None not in texts:
                return texts
        return [self._next_text(tok) for tok in tokens]

    def _next_text(self, token: int) -> str:
        if self._pieces is not None:
            if self._stream is None:
                piece = self._pieces.get(token, _UNSEEN)
                if piece is _UNSEEN:
                    piece = self._piece(token)
                if piece is not None:
                    return piece
                # the text so far ends on a whole character, so what comes before adds
                # nothing to this token's bytes: a stream needs no priming
                self._stream = self._new_stream([])
            self.num_decode_calls += 1
            text = self._stream.step(self._backend, token)
            if text:  # the text ends on a whole character again: back to the table
                self._stream = None
            return text or ""
        self.num_decode_calls += 1
        if self._stream is not None:
            return self._stream.step(self._backend, token) or ""
        self._window.append(token)
        kwargs = {} if self.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        decode = self.tokenizer.decode
        prefix = decode(self._window[:self._read], skip_special_tokens=self.skip_special_tokens, **kwargs)
        full = decode(self._window, skip_special_tokens=self.skip_special_tokens, **kwargs)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the rest
        self._window = self._window[self._read:]  # keep the window short
        self._read = len(self._window)
        return full[len(prefix):]

    def update(self, new_token_ids: list[int]) -> tuple[str, int] | None:
        """Append tokens; returns the stop string matched, if any, and how many of the new
        tokens it took to complete it (text is then truncated; a step that emitted several
        tokens must drop the ones after)."""
        if not self.stop:  # nothing to find: the step's pieces are joined once
            self._text.append("".join(self._texts(new_token_ids)))
            return None
        for i, text in enumerate(self._texts(new_token_ids)):
            if text:
                # a stop string may start in text emitted earlier: look back by its length
                window = self._recent + text
                start = self._text.length - len(self._recent)
                self._text.append(text)
                hit = self._check_stop(window, start)
                if hit is not None:
                    self.stopped = True
                    return hit, i + 1
                self._recent = window[-(self._max_stop - 1):] if self._max_stop > 1 else ""
        return None

    @property
    def output_text(self) -> str:
        """The whole text so far (O(its length): outputs that carry all of it)."""
        return self._text.whole()

    def visible_length(self, finished: bool) -> int:
        """Characters that may be shown: all but the tail that could still start a stop string."""
        n = self._text.length
        if finished or self.stopped or self._max_stop <= 1:
            return n
        return max(0, n - (self._max_stop - 1))

    def get_text(self, finished: bool) -> str:
        return self.output_text[:self.visible_length(finished)]

    def text_since(self, offset: int, finished: bool) -> str:
        """The visible text from `offset` on (what a delta output adds): O(its length)."""
        return self._text.slice(offset, self.visible_length(finished))

    def _check_stop(self, window: str, start: int) -> str | None:
        """The first stop string in `window`, the text's end from `start` on; the text is cut
        there (after it, with include_stop_str_in_output)."""
        best = None
        for s in self.stop:
            i = window.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._text.truncate(start + i + len(s) if self.include_stop else start + i)
        return s
