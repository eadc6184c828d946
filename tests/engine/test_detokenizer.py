"""Incremental detokenization: multi-byte UTF-8 (byte-level BPE and SentencePiece byte
fallback), stop strings across token boundaries, and the streaming hold-back."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.engine.detokenizer import IncrementalDetokenizer, piece_table


@pytest.fixture(scope="module")
def bpe_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory):
    """A SentencePiece BPE trained here on ASCII text: anything else becomes <0xNN> tokens."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    d = tmp_path_factory.mktemp("sp")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox jumps over the lazy dog {i} times"
                                for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(d / "tokenizer"),
                                   vocab_size=330, byte_fallback=True, model_type="bpe",
                                   character_coverage=1.0, minloglevel=2)
    return LlamaTokenizer.from_pretrained(str(d))


def stream(tok, prompt_ids, ids, **kw):
    detok = IncrementalDetokenizer(tok, prompt_ids, **kw)
    texts, hit = [], None
    for t in ids:
        hit = detok.update([t])
        hit = hit and hit[0]
        texts.append(detok.get_text(finished=hit is not None))
        if hit is not None:
            break
    return detok, texts, hit


@pytest.mark.parametrize("text", ["Grüße aus Köln, 世界 🎉 done", "emoji 👩‍👩‍👧 family ok"])
def test_multibyte_characters_appear_whole(bpe_tokenizer, text):
    prompt = bpe_tokenizer.encode("Say:", add_special_tokens=False)
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok, texts, _ = stream(bpe_tokenizer, prompt, ids)
    assert all("\ufffd" not in t for t in texts)
    assert detok.output_text == bpe_tokenizer.decode(prompt + ids)[len(bpe_tokenizer.decode(prompt)):]


def test_byte_fallback_tokens(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    ids = tok.encode("fox 世界 é fox", add_special_tokens=False)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    prompt, rest = ids[:2], ids[2:]
    detok, texts, _ = stream(tok, prompt, rest)
    assert all("\ufffd" not in t for t in texts)
    assert detok.output_text == tok.decode(ids)[len(tok.decode(prompt)):]
    # text only ever grows by whole characters
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)


def test_stop_string_across_tokens_and_holdback(bpe_tokenizer):
    text = "The answer is forty-two. STOP HERE and nothing after"
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    stop = "STOP HERE"
    # the stop string spans several tokens
    assert len(bpe_tokenizer.encode(stop, add_special_tokens=False)) > 1
    detok, texts, hit = stream(bpe_tokenizer, [], ids, stop=[stop])
    assert hit == stop and detok.output_text == "The answer is forty-two. "
    # nothing streamed before the end shows a part of the stop string
    for t in texts:
        assert "S" not in t and detok.output_text.startswith(t)
    kept, _, _ = stream(bpe_tokenizer, [], ids, stop=[stop], include_stop_str_in_output=True)
    assert kept.output_text == "The answer is forty-two. STOP HERE"


def test_earliest_of_several_stop_strings(bpe_tokenizer):
    ids = bpe_tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    detok, _, hit = stream(bpe_tokenizer, [], ids, stop=["delta", "beta"])
    assert hit == "beta" and detok.output_text == "alpha "


def test_special_tokens_skipped_or_kept(bpe_tokenizer):
    eos = bpe_tokenizer.eos_token_id
    ids = bpe_tokenizer.encode("hi there", add_special_tokens=False) + [eos]
    skipped, _, _ = stream(bpe_tokenizer, [], ids, skip_special_tokens=True)
    kept, _, _ = stream(bpe_tokenizer, [], ids, skip_special_tokens=False)
    assert skipped.output_text == "hi there"
    assert kept.output_text == "hi there" + bpe_tokenizer.eos_token


class _CountingTokenizer:
    """A slow-path tokenizer wrapper that counts decode calls and the ids they decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.ids = tok, 0, 0

    def decode(self, ids, **kw):
        self.calls += 1
        self.ids += len(ids)
        return self.tok.decode(ids, **kw)


def test_long_stream_costs_linear_decoding(bpe_tokenizer):
    """4,000 tokens: at most one native decode per token on the fast path (plain text: one
    per distinct token, the table's); on the windowed path a bounded number of calls over a
    bounded window per token (not the whole text)."""
    plain = bpe_tokenizer.encode("Plain words only, over and over. " * 600,
                                 add_special_tokens=False)[:4000]
    assert len(plain) == 4000
    table = IncrementalDetokenizer(bpe_tokenizer, [1, 2, 3], stop=["NEVER"])
    for t in plain:
        table.update([t])
    assert table.num_decode_calls == len(set(plain)) < 20
    text = ("Streaming text, with some ünïcödé and 漢字 and numbers 12345, repeats. " * 300)
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)[:4000]
    assert len(ids) == 4000
    fast = IncrementalDetokenizer(bpe_tokenizer, [1, 2, 3], stop=["NEVER"])
    for t in ids:
        fast.update([t])
    # the characters split over tokens take a stream's steps, the rest the table
    assert len(set(ids)) < fast.num_decode_calls < 4000
    assert fast.output_text == bpe_tokenizer.decode([1, 2, 3] + ids)[len(bpe_tokenizer.decode([1, 2, 3])):]
    counting = _CountingTokenizer(bpe_tokenizer)
    slow = IncrementalDetokenizer(counting, [1, 2, 3], spaces_between_special_tokens=False)
    for t in ids:
        slow.update([t])
    assert counting.calls <= 2 * 4000 and counting.ids <= 2 * 8 * 4000
    assert slow.output_text == fast.output_text


def test_delta_outputs_send_each_character_once(bpe_tokenizer):
    """DELTA outputs of a 4,000-token sequence: joined, the deltas are exactly the whole text
    and the token ids (nothing is sent twice, nothing is lost)."""
    from jaxllm.core.request import Request, RequestStatus
    from jaxllm.engine.output_processor import OutputProcessor
    from jaxllm.sampling_params import RequestOutputKind, SamplingParams

    ids = bpe_tokenizer.encode("Deltas stay small, even for long answers. " * 400,
                               add_special_tokens=False)[:4000]
    params = SamplingParams(max_tokens=4000, stop=["xyz123"], output_kind=RequestOutputKind.DELTA)
    from jaxllm.core.kv_cache_manager import KVCacheManager
    from jaxllm.core.scheduler import Scheduler
    proc = OutputProcessor(bpe_tokenizer, Scheduler(KVCacheManager(16, 16), 1, 64, 128))
    req = Request("r", [1, 2], params, eos_token_id=None, seed=0)
    proc.add("r", None, [1, 2], params, [req], 0.0)
    texts, toks = [], []
    for i, t in enumerate(ids):
        req.append_output_token(t)
        proc.update(req, [t], None, 0.0)
        if i == len(ids) - 1:
            req.status = RequestStatus.FINISHED_LENGTH
        for out in proc.make_outputs(["r"]):
            texts.append(out.outputs[0].text)
            toks += out.outputs[0].token_ids
    assert toks == ids and "".join(texts) == bpe_tokenizer.decode([1, 2] + ids)[len(bpe_tokenizer.decode([1, 2])):]
    assert not proc.parents  # the finished request is gone


def test_stop_string_inside_a_multi_token_step(bpe_tokenizer):
    """A step that emits several tokens (speculative decoding) and completes a stop string
    with one of the first: the sequence ends at that token, as one token per step would end
    it. The later tokens are not in the output's token ids, logprobs or cumulative logprob.
    The scheduler ends it and frees its blocks."""
    from jaxllm.core.kv_cache_manager import KVCacheManager
    from jaxllm.core.request import Request, RequestStatus
    from jaxllm.core.scheduler import Scheduler
    from jaxllm.engine.output_processor import OutputProcessor
    from jaxllm.sampling_params import SamplingParams

    ids = bpe_tokenizer.encode("one two three STOP four five six", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids) + 1)
               if "STOP" in bpe_tokenizer.decode(ids[:i]))  # the token completing it
    assert cut < len(ids) - 1

    class LP:  # a sampled token's logprob as the runner reports it
        def __init__(self, v):
            self.logprob, self.rank, self.top_ids, self.top_logprobs = v, 1, [], []

    def run(steps):
        params = SamplingParams(max_tokens=50, stop=["STOP"], logprobs=0)
        sched = Scheduler(KVCacheManager(16, 16), 1, 64, 128)
        proc = OutputProcessor(bpe_tokenizer, sched)
        req = Request("r", [1, 2], params, eos_token_id=None, seed=0)
        proc.add("r", None, [1, 2], params, [req], 0.0)
        sched.add_request(req)
        sched.schedule()
        pos, finals = 0, []
        for k in steps:
            new = ids[pos:pos + k]
            for t in new:
                req.append_output_token(t)
            proc.update(req, new, [LP(-0.5 * (pos + j + 1)) for j in range(len(new))], 0.0)
            pos += k
            finals += [o for o in proc.make_outputs(["r"]) if o.finished]
            if req.status.finished:
                break
        (out,) = finals
        assert req.status == RequestStatus.FINISHED_STOPPED
        assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 15
        return out.outputs[0]

    one = run([1] * len(ids))
    # the stop string completes at the first, middle and last token of a 3-token step
    for offset in (0, 1, 2):
        first = cut - 1 - offset
        if first < 0:
            continue
        several = run([1] * first + [3] + [1] * len(ids))
        assert several.token_ids == one.token_ids == ids[:cut]
        assert several.text == one.text and several.stop_reason == "STOP"
        assert len(several.logprobs) == cut
        assert several.cumulative_logprob == one.cumulative_logprob


def _token_pool(tok):
    """Tokens that exercise the table and its streams: whole words, the pieces of characters
    split over several tokens, lone bytes (continuations, lead bytes), special tokens."""
    from jaxllm.loader.gguf_tokenizer import _byte_alphabet
    words = tok.encode(" the quick, brown\n fox 12345 jumps!", add_special_tokens=False)
    split = tok.encode("ünïcödé 漢字 🎉 👩‍👩‍👧 Köln", add_special_tokens=False)
    lone = tok.convert_tokens_to_ids([_byte_alphabet()[b] for b in (0x80, 0xA9, 0xC3, 0xE4, 0xF0)])
    special = [tok.eos_token_id] + [t for t in tok.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>"]) if t is not None and t != tok.unk_token_id]
    return sorted(set(words + split + lone + special))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_table_emits_what_a_stream_emits(bpe_tokenizer, data):
    """Token by token and step by step, the table-and-stream detokenizer shows exactly the
    text the tokenizers library's own DecodeStream shows (primed the same way), whatever the
    prompt ends with, for either skip_special_tokens. The table is shared across examples."""
    from tokenizers.decoders import DecodeStream

    from jaxllm.engine.detokenizer import PRIME_TOKENS, token_pieces_apply

    assert token_pieces_apply(bpe_tokenizer)
    pool = _token_pool(bpe_tokenizer)
    tokens = st.sampled_from(pool)
    prompt = data.draw(st.lists(tokens, max_size=8), "prompt")
    ids = data.draw(st.lists(tokens, min_size=1, max_size=40), "ids")
    skip = data.draw(st.booleans(), "skip_special_tokens")
    # the table filled token by token as they come, or all at once as the engine builds it
    if data.draw(st.booleans(), "prefilled table"):
        if skip not in _PREFILLED:
            _PREFILLED[skip] = piece_table(bpe_tokenizer, skip)
        pieces = _PREFILLED[skip]
    else:
        pieces = _SHARED_PIECES.setdefault(skip, {})
    ref = DecodeStream(ids=prompt[-PRIME_TOKENS:] or None, skip_special_tokens=skip)
    expected = [ref.step(bpe_tokenizer.backend_tokenizer, t) or "" for t in ids]
    detok = IncrementalDetokenizer(bpe_tokenizer, prompt, skip_special_tokens=skip, pieces=pieces)
    pos = 0
    while pos < len(ids):
        n = data.draw(st.integers(1, 4), "step")
        detok.update(ids[pos:pos + n])
        pos = min(pos + n, len(ids))
        assert detok.output_text == "".join(expected[:pos])


_SHARED_PIECES: dict = {}
_PREFILLED: dict = {}


def test_piece_table_holds_each_token_decoded_alone(bpe_tokenizer):
    """The engine's table, built in one batched decode, holds for every token what decoding
    it alone gives (None where that ends inside a character, and for added tokens); with it,
    plain text needs no native decode at all."""
    import random

    backend = bpe_tokenizer.backend_tokenizer
    added = set(backend.get_added_tokens_decoder())
    some = _token_pool(bpe_tokenizer) + random.Random(0).sample(range(backend.get_vocab_size()), 2000)
    for skip in (True, False):
        table = piece_table(bpe_tokenizer, skip)
        assert len(table) == backend.get_vocab_size()
        for t in some:
            alone = backend.decode([t], skip_special_tokens=skip)
            assert table[t] == (None if t in added or alone.endswith("\ufffd") else alone), t
    plain = bpe_tokenizer.encode("Plain words only, over and over. " * 600,
                                 add_special_tokens=False)[:4000]
    detok = IncrementalDetokenizer(bpe_tokenizer, [1, 2, 3], pieces=piece_table(bpe_tokenizer, True))
    for t in plain:
        detok.update([t])
    assert detok.num_decode_calls == 0
    assert detok.output_text == bpe_tokenizer.decode(plain)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("append"), st.text(max_size=12)),
    st.tuples(st.just("slice"), st.integers(0, 200), st.integers(0, 200)),
    st.tuples(st.just("truncate"), st.integers(0, 200)),
    st.tuples(st.just("whole"))), max_size=80))
def test_text_runs_hold_what_a_string_holds(ops):
    """The detokenizer's text (runs merged like a binary counter) reads, slices and truncates
    as one string would, and holds O(log n) runs, whatever the order of its pieces (up to 12
    characters each here)."""
    import math

    from jaxllm.engine.detokenizer import _Text
    text, ref = _Text(), ""
    for op, *args in ops:
        if op == "append":
            text.append(args[0])
            ref += args[0]
        elif op == "slice":
            start, end = sorted(args)
            assert text.slice(start, min(end, len(ref))) == ref[start:end]
        elif op == "truncate":
            n = min(args[0], len(ref))
            text.truncate(n)
            ref = ref[:n]
        else:
            assert text.whole() == ref
        assert text.length == len(ref) == sum(map(len, text.runs))
        assert len(text.runs) <= 2 * math.log2(len(ref) + 1) + 1


def test_long_text_is_kept_in_few_runs():
    """64,000 single-character appends leave at most log2(64,000) + 1 runs: an append copies
    what it merges, not the whole text."""
    from jaxllm.engine.detokenizer import _Text
    text = _Text()
    for i in range(64000):
        text.append("ab"[i % 2])
    assert len(text.runs) <= 17
    assert text.slice(63990, 64000) == "ab" * 5 and text.whole() == "ab" * 32000


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_end_where_a_search_of_the_whole_text_ends(bpe_tokenizer, data):
    """Stop strings found from a look-back window end the text exactly where searching the
    whole text after every token would: at the earliest match (the first listed stop string
    on a tie), cut before it or after it (include_stop_str_in_output), at the token that
    completes it, whatever the steps."""
    pieces = {t: bpe_tokenizer.convert_ids_to_tokens(t) for t in bpe_tokenizer.convert_tokens_to_ids(
        ["a", "b", "ab", "ba", "aa", "bb", "abc", "c"]) if t != bpe_tokenizer.unk_token_id}
    ids = data.draw(st.lists(st.sampled_from(sorted(pieces)), min_size=1, max_size=30), "ids")
    stops = data.draw(st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3), "stop")
    include = data.draw(st.booleans(), "include_stop_str_in_output")
    text, expected = "", None
    for n, t in enumerate(ids, start=1):
        text += pieces[t]
        found = [(text.find(s), j, s) for j, s in enumerate(stops) if s in text]
        if found:
            i, _, s = min(found)
            expected = (n, s, text[:i + len(s) if include else i])
            break
    detok = IncrementalDetokenizer(bpe_tokenizer, [], stop=stops, include_stop_str_in_output=include)
    pos = 0
    while pos < len(ids):
        k = data.draw(st.integers(1, 3), "step")
        hit = detok.update(ids[pos:pos + k])
        if hit is not None:
            assert expected is not None and (pos + hit[1], hit[0], detok.output_text) == expected
            return
        pos += k
    assert expected is None and detok.output_text == text
