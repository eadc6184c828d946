"""LLaVA: the vision tower, projector and language model against HF on a tiny random
checkpoint, the checkpoint's image preprocessing against transformers', and images that do
not decode."""
import base64
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loader import load_model
from model_util import prefill_metadata

IMAGE_TOKEN = 100


def tiny_llava_config(feature_layer=-2, select="default"):
    import transformers
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, image_size=28, patch_size=14,
                                       projection_dim=32)
    tc = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  bos_token_id=1, eos_token_id=2)
    return transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN,
                                    vision_feature_layer=feature_layer,
                                    vision_feature_select_strategy=select)


def make_tiny_llava(path, seed=0, **kw):
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(tiny_llava_config(**kw)).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    d = tmp_path_factory.mktemp("llava")
    return str(d), make_tiny_llava(d)


def _merged(loaded):
    from flax import nnx
    return nnx.merge(loaded.graphdef, loaded.state)


@pytest.mark.parametrize("feature_layer,select", [(-2, "default"), ([-1, 1], "full")])
def test_image_features_match_hf(tmp_path, feature_layer, select):
    import torch
    hf = make_tiny_llava(tmp_path, feature_layer=feature_layer, select=select)
    model = _merged(load_model(str(tmp_path), jnp.float32, load_tokenizer=False))
    px = np.random.default_rng(0).standard_normal((2, 3, 28, 28)).astype(np.float32)
    ours = np.asarray(model.encode_images(jnp.asarray(px)))
    with torch.no_grad():
        ref = hf.get_image_features(torch.tensor(px), vision_feature_layer=feature_layer,
                                    vision_feature_select_strategy=select).pooler_output
    ref = torch.stack(list(ref)).numpy()
    assert ours.shape == ref.shape == (2, 4 + (select == "full"), 64)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


def test_logits_with_an_image_match_hf(tiny_llava):
    """The image's features take its placeholder tokens' places; the logits at every position
    equal HF's."""
    import torch

    from jaxllm.layers.attention_metadata import kv_cache_shape
    path, hf = tiny_llava
    loaded = load_model(path, jnp.float32, load_tokenizer=False)
    model = _merged(loaded)
    assert loaded.arch.vision["tokens_per_image"] == 4
    rng = np.random.default_rng(1)
    ids = [1, *rng.integers(3, 90, 5), *[IMAGE_TOKEN] * 4, *rng.integers(3, 90, 7)]
    px = rng.standard_normal((1, 3, 28, 28)).astype(np.float32)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(px)).logits[0].numpy()
    feats = np.asarray(model.encode_images(jnp.asarray(px)))[0]
    mask = np.array(ids) == IMAGE_TOKEN
    embeds = np.zeros((len(ids), 64), np.float32)
    embeds[mask] = feats
    md = jax.tree.map(jnp.asarray, prefill_metadata(len(ids)))
    kv = jnp.zeros(kv_cache_shape(loaded.arch, md.block_tables.shape[1] + 1, md.block_size), jnp.float32)
    hidden, _ = model(kv, jnp.asarray(ids, jnp.int32), md, mm=(jnp.asarray(embeds), jnp.asarray(mask)))
    ours = np.asarray(model.compute_logits(hidden))
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


def test_older_checkpoint_names_load_the_same(tmp_path, tiny_llava):
    """llava-hf's files name the tower vision_tower.vision_model.*; a tensor the model does
    not know is still an error."""
    from safetensors.numpy import save_file

    from jaxllm.loader.safetensors_io import read_safetensors
    path, _ = tiny_llava
    import shutil
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    tensors = {k.replace("vision_tower.", "vision_tower.vision_model."): np.array(v)
               for k, v in read_safetensors(f"{path}/model.safetensors").items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    px = jnp.asarray(np.random.default_rng(2).standard_normal((1, 3, 28, 28)), jnp.float32)
    a = _merged(load_model(path, jnp.float32, load_tokenizer=False)).encode_images(px)
    b = _merged(load_model(str(tmp_path), jnp.float32, load_tokenizer=False)).encode_images(px)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tensors["vision_tower.vision_model.head.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="head.weight is not used"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)


@pytest.mark.parametrize("size", [(50, 40), (40, 50), (20, 20), (28, 28)])
def test_preprocessing_matches_transformers(size):
    import transformers
    from PIL import Image

    from jaxllm.multimodal import ImageProcessor
    img = Image.fromarray(np.random.default_rng(3).integers(0, 255, (*size, 3), dtype=np.uint8))
    ref = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    want = ref(images=img, return_tensors="np")["pixel_values"][0]
    got = ImageProcessor.for_checkpoint(None, {"image_size": 28})(img)
    assert got.shape == want.shape == (3, 28, 28)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_images_that_do_not_decode():
    from PIL import Image

    from jaxllm.multimodal import load_image
    with pytest.raises(ValueError, match="does not decode"):
        load_image(b"not an image")
    with pytest.raises(ValueError, match="does not decode"):
        load_image("data:image/png;base64," + base64.b64encode(b"\x89PNG broken").decode())
    with pytest.raises(ValueError, match="not valid base64"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="not a data URL"):
        load_image("https://example.com/cat.png")
    bomb = io.BytesIO()  # a small file that decodes to more pixels than PIL allows
    Image.new("1", (20000, 20000)).save(bomb, format="PNG")
    with pytest.raises(ValueError, match="does not decode"):
        load_image(bomb.getvalue())
    buf = io.BytesIO()
    Image.new("L", (5, 3), 7).save(buf, format="PNG")
    image = load_image("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    assert image.mode == "RGB" and image.size == (5, 3)


@pytest.fixture(scope="module")
def llava_llm(tiny_llava):
    from jaxllm import LLM
    path, _ = tiny_llava
    # chunks of 8 tokens: an image's tokens can fall in two steps
    return LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_seqs=4, max_num_batched_tokens=8,
               max_model_len=128, block_size=4, warmup=False, token_buckets=[8], seq_buckets=[4],
               limit_mm_per_prompt={"image": 2})


def _image(seed, size=(40, 30)):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def _greedy(llm, prompt, images, n=6):
    from jaxllm import SamplingParams
    out = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}],
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
    return out


def test_engine_greedy_with_images_equals_hf(tiny_llava, llava_llm):
    """Two images, the first cut across two prefill chunks; the engine's greedy tokens equal
    HF's generate on the same pixels."""
    import torch

    from jaxllm.multimodal import ImageProcessor
    path, hf = tiny_llava
    prompt = [1, 5, 6, 7, 9, 11, IMAGE_TOKEN, 8, 9, IMAGE_TOKEN, 12]
    images = [_image(0), _image(1, (30, 60))]
    out = _greedy(llava_llm, prompt, images)
    px = np.stack([ImageProcessor.for_checkpoint(path, {"image_size": 28})(im) for im in images])
    ids = [1, 5, 6, 7, 9, 11, *[IMAGE_TOKEN] * 4, 8, 9, *[IMAGE_TOKEN] * 4, 12]
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(px), max_new_tokens=6,
                          do_sample=False, min_new_tokens=6)[0, len(ids):].tolist()
    assert list(out.outputs[0].token_ids) == ref


def test_images_key_the_prefix_cache_and_are_encoded_once(llava_llm):
    """The same image again: its blocks are prefix-cache hits and it is not encoded again;
    another image after the same tokens: only the blocks before it are hits, and the output
    follows the new image."""
    enc = llava_llm.llm_engine.encoder
    prompt = [1, 5, 6, 7, 9, 11, 13, 14, IMAGE_TOKEN, 8, 9, 10, 15, 16, 17, 18, 19]
    first = _greedy(llava_llm, prompt, _image(5))
    encoded = enc.images_encoded
    again = _greedy(llava_llm, prompt, _image(5))
    assert enc.images_encoded == encoded  # found by its hash
    # 20 prompt tokens: four full blocks of 4 (the fifth holds the last token, computed anew)
    assert again.num_cached_tokens == 16
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    other = _greedy(llava_llm, prompt, _image(6))
    assert enc.images_encoded == encoded + 1
    assert other.num_cached_tokens == 8  # the two blocks before the image
    assert list(other.outputs[0].token_ids) != list(first.outputs[0].token_ids)


def test_bad_image_inputs_are_refused(llava_llm, tiny_llm):
    from jaxllm import SamplingParams
    p = SamplingParams(max_tokens=2)
    cases = [
        ({"prompt_token_ids": [1, IMAGE_TOKEN, 5], "multi_modal_data": {"image": [_image(1)] * 3}},
         "3 images; at most 2 per prompt"),
        ({"prompt_token_ids": [1, IMAGE_TOKEN, 5], "multi_modal_data": {"image": [_image(1)] * 2}},
         "1 image placeholder tokens .* for 2 image"),
        ({"prompt_token_ids": [1, IMAGE_TOKEN, 5]}, "1 image placeholder tokens .* for 0 image"),
        ({"prompt_token_ids": [1, IMAGE_TOKEN, 5], "multi_modal_data": {"image": b"junk"}},
         "image does not decode"),
        ({"prompt_token_ids": [1, IMAGE_TOKEN, 5], "multi_modal_data": {"video": [1]}},
         "takes 'image' only"),
    ]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match):
            llava_llm.generate([prompt], p, use_tqdm=False)
    with pytest.raises(ValueError, match="text-only"):
        tiny_llm.generate([{"prompt": "hi", "multi_modal_data": {"image": _image(1)}}], p, use_tqdm=False)


def test_llava_hf_configs_list_only_what_differs():
    """llava-hf's config.json gives sparse text and vision configs; transformers' defaults
    fill in the rest (a Llama-2-7B language model, CLIP ViT-L/14 at 336 pixels)."""
    from jaxllm.models.registry import arch_from_hf
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000,
           "projector_hidden_act": "gelu", "vision_feature_layer": -2,
           "vision_feature_select_strategy": "default",
           "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                           "model_type": "llama", "rms_norm_eps": 1e-05, "vocab_size": 32064},
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768}}
    arch = arch_from_hf(cfg)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.intermediate_size) == (4096, 32, 32, 11008)
    assert arch.vocab_size == 32064 and arch.vision["tokens_per_image"] == 576
    assert arch.vision["layers"] == 24 and arch.vision["feature_layers"] == [23]
