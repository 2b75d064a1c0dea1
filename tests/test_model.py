"""Qwen3 NNX model vs transformers/PyTorch: logits parity, greedy decode, save/load round trip."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import make_tiny_qwen3, torch_logits
from sparrow_jax.model import load_hf, save_hf

CONFIGS = {
    "tied_gqa2": dict(tie=True, heads=4, kv_heads=2, head_dim=16, hidden=48),
    "untied_mha": dict(tie=False, heads=4, kv_heads=4, head_dim=16, hidden=64),   # GQA ratio 1
    "tied_gqa4_odd_headdim": dict(tie=True, heads=8, kv_heads=2, head_dim=24, hidden=40),  # ratio 4, D != H/heads
}


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def _padded_batch(rng, vocab, lengths, total, left=False):
    tokens = np.zeros((len(lengths), total), np.int64)
    mask = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        sl = slice(total - n, total) if left else slice(0, n)
        tokens[i, sl] = rng.integers(3, vocab, n)
        mask[i, sl] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, mask, positions


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("left", [False, True])
def test_logits_match_pytorch(tmp_path, name, left):
    torch_model = make_tiny_qwen3(tmp_path, **CONFIGS[name])
    model = load_hf(tmp_path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    tokens, mask, positions = _padded_batch(rng, 96, [11, 7, 3], 11, left=left)
    ref = torch_logits(torch_model, tokens, mask, positions)
    ours = np.asarray(jax.jit(lambda t, p, m: model(t, p, m))(tokens, positions, mask))
    valid = mask.astype(bool)
    assert _rel_err(ours[valid], ref[valid]) <= 1e-4


def test_greedy_continuation_matches_pytorch(tmp_path):
    import torch
    torch_model = make_tiny_qwen3(tmp_path, **CONFIGS["tied_gqa2"])
    model = load_hf(tmp_path, dtype=jnp.float32)
    prompt = np.array([[5, 9, 17, 3, 44, 21]])
    with torch.no_grad():
        ref = torch_model.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0).numpy()[0, prompt.shape[1]:]
    fwd = jax.jit(lambda t: model(t))
    seq = list(prompt[0])
    for _ in range(32):  # uncached greedy decode: an independent path from the rollout engine
        seq.append(int(jnp.argmax(fwd(jnp.asarray([seq]))[0, -1])))
    assert seq[prompt.shape[1]:] == list(ref)


@pytest.mark.parametrize("tie", [True, False])
def test_save_roundtrip_loads_in_transformers(tmp_path, tie):
    from transformers import AutoModelForCausalLM
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tiny_qwen3(src, **{**CONFIGS["tied_gqa2"], "tie": tie})
    model = load_hf(src, dtype=jnp.float32)
    save_hf(model, dst)
    reloaded_torch = AutoModelForCausalLM.from_pretrained(str(dst)).eval()
    rng = np.random.default_rng(2)
    tokens, mask, positions = _padded_batch(rng, 96, [9, 9], 9)
    ours = np.asarray(model(tokens, positions, mask))
    np.testing.assert_array_equal(torch_logits(reloaded_torch, tokens, mask, positions).shape,
                                  ours.shape)
    assert _rel_err(torch_logits(reloaded_torch, tokens, mask, positions), ours) <= 1e-5
    again = load_hf(dst, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(again(tokens, positions, mask)), ours)


def test_sharded_checkpoint_and_bf16(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tiny_qwen3(src, **CONFIGS["untied_mha"])
    model = load_hf(src, dtype=jnp.float32)
    save_hf(model, dst, dtype=jnp.bfloat16, max_shard_bytes=20_000)
    assert (dst / "model.safetensors.index.json").exists()
    assert len(list(dst.glob("*.safetensors"))) > 1
    bf = load_hf(dst, dtype=jnp.bfloat16)
    assert bf.embed_tokens.embedding[...].dtype == jnp.bfloat16
    tokens = np.arange(3, 13)[None]
    a, b = np.asarray(model(tokens)), np.asarray(bf(tokens))
    assert _rel_err(b, a) < 5e-2


# -- error paths -------------------------------------------------------------------------------
def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tmp_path / "nope")


def test_unsupported_architecture(tmp_path):
    make_tiny_qwen3(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*llama"):
        load_hf(tmp_path)


def _rewrite_tensors(path, edit):
    from sparrow_jax.model.hf_io import read_safetensors, write_safetensors
    f = path / "model.safetensors"
    tensors = {n: np.array(a) for n, a in read_safetensors(f)}
    edit(tensors)
    write_safetensors(f, tensors)


def test_missing_tensor(tmp_path):
    make_tiny_qwen3(tmp_path)
    _rewrite_tensors(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.mlp\.up_proj"):
        load_hf(tmp_path)


def test_unexpected_tensor(tmp_path):
    make_tiny_qwen3(tmp_path)
    _rewrite_tensors(tmp_path, lambda t: t.update({"model.layers.9.foo.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensors.*layers\.9\.foo"):
        load_hf(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    make_tiny_qwen3(tmp_path)
    _rewrite_tensors(tmp_path, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 48), np.float32)}))
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(16, 48\).*\(32, 48\)"):
        load_hf(tmp_path)


def test_no_safetensors(tmp_path):
    make_tiny_qwen3(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf(tmp_path)


def test_rope_scaling_rejected(tmp_path):
    make_tiny_qwen3(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        load_hf(tmp_path)


def test_yarn_rope_scaling_beside_default_rope_parameters_is_refused():
    """Issue #45 list 7: transformers reads the YaRN rope_scaling even beside a default
    rope_parameters; sparrow trained plain RoPE under it without a word."""
    from sparrow_jax.model import Qwen3Config
    cfg = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80,
           "num_hidden_layers": 1, "num_attention_heads": 4,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="rope_scaling.rope_type='yarn' is not supported"):
        Qwen3Config.from_hf_dict(cfg)
    cfg["rope_scaling"] = {"type": "default"}
    assert Qwen3Config.from_hf_dict(cfg).rope_theta == 1e6


@pytest.mark.parametrize("chunk", [3, 8, 16, 64])   # 3: 13 chunks in 8 causal groups
@pytest.mark.parametrize("left_pad", [False, True])
def test_chunked_attention_equals_one_shot_values_and_grads(chunk, left_pad):
    from sparrow_jax.model import chunked_causal_attention, dense_causal_attention
    b, t, hq, hkv, d = 2, 37, 8, 2, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k = jax.random.normal(keys[1], (b, t, hkv, d))
    v = jax.random.normal(keys[2], (b, t, hkv, d))
    w = jax.random.normal(keys[3], (b, t, hq, d))        # a random linear read-out for grads
    real = np.ones((b, t), np.int32)
    if left_pad:
        real[1, :9] = 0
    else:
        real[1, -11:] = 0
    mask = jnp.asarray(real)
    positions = jnp.zeros((b, t), jnp.int32)
    chunked = chunked_causal_attention(chunk)

    def readout(fn):
        return lambda q, k, v: jnp.sum(w * fn(0, q, k, v, positions, mask) * mask[..., None, None])

    # Padding queries see no key; their (unused) outputs may differ, so compare real rows.
    keep = real.astype(bool)
    np.testing.assert_allclose(np.asarray(chunked(0, q, k, v, positions, mask))[keep],
                               np.asarray(dense_causal_attention(0, q, k, v, positions, mask))[keep],
                               rtol=1e-5, atol=1e-5)
    g_chunked = jax.grad(readout(chunked), argnums=(0, 1, 2))(q, k, v)
    g_dense = jax.grad(readout(dense_causal_attention), argnums=(0, 1, 2))(q, k, v)
    for a, e in zip(g_chunked, g_dense):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t, chunk", [(1024, 64), (1000, 64), (37, 8), (5, 8)])
def test_causal_chunks_skip_future_keys(t, chunk):
    """Query chunks i and n-1-i share one scan step over the n+1 key blocks they can see: every
    query sees exactly its causal prefix (zero queries: uniform attention, so the output is
    the mean of the prefix's values), one traced body (issue 40: the compile does not grow with
    the length), and the score work is the causal blocks, ~1/2 of the full T x T."""
    from sparrow_jax.model.attention import map_causal_query_chunks
    seen = []

    def visible(q_c, pos_c, q_idx, k_idx):
        seen.append(k_idx.shape)
        return jnp.ones((1, 1) + k_idx.shape[:1] + (q_c.shape[1],) + k_idx.shape[1:], bool)

    q = jnp.zeros((1, t, 1, 4))
    v = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None, None], (1, t, 1, 4))
    out = map_causal_query_chunks(visible, chunk, q, jnp.zeros((1, t, 1, 4)), v,
                                  jnp.zeros((1, t), jnp.int32))
    np.testing.assert_allclose(out[0, :, 0, 0], np.arange(t) / 2, rtol=1e-5)
    n = -(-t // chunk)
    n += n % 2
    assert seen == [(n + 1, chunk)] * 2                   # chunk a's and b's masks, traced once
    work = n // 2 * seen[0][0] * chunk * chunk            # score elements: n/2 steps x M blocks
    assert work <= t * t / 2 + 2 * chunk * t + 2 * chunk * chunk


def test_chunked_attention_gradient_needs_less_memory():
    """The point of chunking: the compiled gradient's temporaries grow linearly in T (one pair
    of query chunks' [B, Hq, n+1, chunk, chunk] blocks at a time), not quadratically like the
    one-shot [B, Hq, T, T]."""
    from sparrow_jax.model import chunked_causal_attention, dense_causal_attention
    b, hq, hkv, d = 1, 4, 2, 16

    def temp_bytes(fn, t):
        q, kv = jnp.ones((b, t, hq, d)), jnp.ones((b, t, hkv, d))
        mask, positions = jnp.ones((b, t), jnp.int32), jnp.zeros((b, t), jnp.int32)
        loss = lambda q, k, v: jnp.sum(fn(0, q, k, v, positions, mask))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunked = chunked_causal_attention(64)
    one_shot = {t: temp_bytes(dense_causal_attention, t) for t in (1024, 2048)}
    small = {t: temp_bytes(chunked, t) for t in (1024, 2048)}
    scores = b * hq * 1024 * 1024 * 4                      # one f32 [B, Hq, T, T] block
    assert one_shot[1024] >= scores
    # (1/6: the chunked form keeps K and V twice, as they are and reversed, with their
    # cotangents - `map_causal_query_chunks`; 6.5 MB of 50.9 with the former group scans)
    assert small[1024] < scores / 2 and small[1024] < one_shot[1024] / 6, (one_shot, small)
    assert one_shot[2048] > 3.8 * one_shot[1024] and small[2048] < 2.2 * small[1024], (
        one_shot, small)
    with pytest.raises(ValueError, match="query_chunk"):
        chunked_causal_attention(0)
