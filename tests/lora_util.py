"""What LoRA tests share: a random PEFT adapter saved as PEFT saves it, our logits with an
adapter in a device slot, and HF + PEFT's greedy output."""
import jax
import jax.numpy as jnp
import numpy as np


def make_adapter(path, base_dir, seed: int = 0, **lora_kwargs):
    """A PEFT adapter of random non-zero A and B (PEFT starts B at zero) saved under `path`;
    returns the PEFT model (the reference)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs)).eval()
    with torch.no_grad():  # small enough that the adapted model stays a sane language model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    model.save_pretrained(path)
    return model


def logits_fn(loaded, num_slots: int, ids, scan_layers: bool = True):
    """f(slot weights, slot) -> our logits at every position of one prompt, every token run
    with device slot `slot` (0: none), the layers scanned (CPU) or unrolled (GPU); compiled
    once."""
    from flax import nnx
    from jaxllm.lora.ops import LoRAInputs
    from jaxllm.layers.attention_metadata import kv_cache_shape
    from model_util import prefill_metadata

    md = jax.tree.map(jnp.asarray, prefill_metadata(len(ids)))
    kv = jnp.zeros(kv_cache_shape(loaded.arch, md.block_tables.shape[1] + 1, md.block_size), jnp.float32)

    @jax.jit
    def run(state, weights, kv, ids, md, slot):
        model = nnx.merge(loaded.graphdef, state)
        model.scan_layers = scan_layers
        slots = jnp.full(ids.shape, slot, jnp.int32)
        lora = LoRAInputs.of(weights, slots, num_slots, loaded.arch.tp_size)
        hidden, _ = model(kv, ids, md, lora=lora)
        return model.compute_logits(hidden)

    tokens = jnp.asarray(ids, jnp.int32)
    return lambda weights, slot: np.asarray(run(loaded.state, weights, kv, tokens, md, jnp.int32(slot)))


def hf_greedy(model, ids, n):
    import torch
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
