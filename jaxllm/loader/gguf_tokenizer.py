"""A fast tokenizer built from a GGUF file's metadata, without torch.

A GGUF carries no tokenizer.json: the vocabulary, merges, token types, special ids and chat
template are metadata under llama.cpp's key names. The `gguf` package reads them and the
`tokenizers` library builds the tokenizer they describe. (transformers can do the same, but its
GGUF reader imports torch, which the runtime does not install.) Tests check that the result
encodes, decodes and templates exactly as transformers' own GGUF path does.
"""
from __future__ import annotations

from functools import lru_cache

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# Pre-tokenizer splits by `tokenizer.ggml.pre`; others use GPT-2's byte-level regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def read_tokenizer_metadata(reader) -> dict:
    """The `tokenizer.*` fields of a gguf.GGUFReader as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.")}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _merges(meta: dict, tokens: list[str]) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ", 1)) for m in merges]
    # sentencepiece files without merges: every split of a token into two vocabulary pieces,
    # best-scored tokens first (how sentencepiece's BPE ranks them)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF tokenizer has neither merges nor scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for tok, score in zip(tokens, scores):
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in vocab and b in vocab:
                ranked.append((-score, vocab[a], vocab[b], a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def _byte_level(meta: dict):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    tokens = meta["tokenizer.ggml.tokens"]
    # a few files store tokens as raw text instead of the byte alphabet
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, _merges(meta, tokens), fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece(meta: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, _merges(meta, tokens), byte_fallback=True, fuse_unk=True,
                               unk_token=tokens[unk] if unk is not None else None))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁",
                                                 prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok, None


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def tokenizer_from_gguf_metadata(meta: dict):
    """A transformers fast tokenizer (no torch) from `read_tokenizer_metadata`'s dict."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind not in BUILDERS:
        raise ValueError(f"GGUF tokenizer type {kind!r} is not supported; supported: "
                         f"{', '.join(sorted(BUILDERS))}")
    tok, alphabet = BUILDERS[kind](meta)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    # control tokens stay whole and are special; in a byte-level vocabulary a "control" token
    # spelled outside the byte alphabet is a mislabel llama.cpp makes, and is left alone
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types)
                            if ty == CONTROL and (alphabet is None or set(t) <= alphabet)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def special(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = special("bos_token_id"), special("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    ids = {t: tokens.index(t) for t in (bos, eos) if t is not None}
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair),
        special_tokens=[(t, ids[t]) for t in {bos, eos} if t is not None and t in ids
                        and ((t == bos and add_bos) or (t == eos and add_eos))])
    kwargs = dict(bos_token=bos, eos_token=eos, unk_token=special("unknown_token_id"),
                  pad_token=special("padding_token_id"), add_bos_token=add_bos,
                  add_eos_token=add_eos)
    template = meta.get("tokenizer.chat_template")
    if template:
        kwargs["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=tok,
                                   **{k: v for k, v in kwargs.items() if v is not None})


def gguf_tokenizer(path: str):
    from jaxllm.loader.gguf_loader import open_gguf
    return tokenizer_from_gguf_metadata(read_tokenizer_metadata(open_gguf(path)))
