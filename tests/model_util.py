"""What model tests share: our logits over a whole prompt in one step, HF's logits, and the
tokenizer comparison; shapes whose layer matrices the CPU kernels pack as panels."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention_metadata import attention_metadata, table_width


def prefill_metadata(num_tokens: int, block_size: int = 4):
    """One sequence of `num_tokens` fresh tokens in blocks 1, 2, ... (block 0 is the null block)."""
    width = table_width(num_tokens, block_size)
    table = np.zeros((1, width), np.int32)
    table[0, :-(-num_tokens // block_size)] = np.arange(1, 1 - (-num_tokens // block_size))
    return attention_metadata(np.zeros(1, np.int32), np.array([num_tokens], np.int32), table,
                              num_tokens, 1, block_size)


def all_logits(loaded, token_ids: list[int], scan_layers: bool = True) -> np.ndarray:
    """Our logits at every position of one prompt, computed in a single step, the layers
    under a scan (as on a CPU) or unrolled (as on a GPU)."""
    from flax import nnx
    from jaxllm.layers.attention_metadata import kv_cache_shape

    T = len(token_ids)
    md = prefill_metadata(T)
    kv = jnp.zeros(kv_cache_shape(loaded.arch, md.block_tables.shape[1] + 1, md.block_size),
                   jnp.float32)
    model = nnx.merge(loaded.graphdef, loaded.state)
    model.scan_layers = scan_layers
    md = jax.tree.map(jnp.asarray, md)
    hidden, _ = model(kv, jnp.asarray(token_ids, jnp.int32), md)
    logits = model.compute_logits(hidden)
    return np.asarray(logits)


TOKENIZER_TEXTS = ["Hello, world!", "  spaces\tand\nnewlines", "Grüße 世界 🎉", "<|im_start|>user",
                   "It's 12345 o'clock!!", "\n\n\n  x", "a" * 40, "<think>hmm</think>", "",
                   "def f(x):\n    return x ** 2  # comment", "ÅÄÖ ñ ß ﬁ ẞ"]


def assert_same_tokenizer(ours, ref, texts=TOKENIZER_TEXTS):
    for t in texts:
        ids = ref.encode(t)
        assert ours.encode(t) == ids, t
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    if ref.chat_template:
        msgs = [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]
        for gen in (True, False):
            assert (ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                    == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "eos_token_id", "bos_token_id"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert len(ours) == len(ref) and ours.all_special_tokens == ref.all_special_tokens


def hf_logits(hf, ids):
    import torch
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


# widths whose layer matrices are whole 48-column panels (K a multiple of 32): the loader
# packs them (jaxllm.kernels.cpu.panels.to_panels)
PANEL_SHAPES = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                    intermediate_size=96)
