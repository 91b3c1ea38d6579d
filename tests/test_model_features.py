"""The architecture features of today's open models inside the one TransformerStack (float64):

- RoPE scaling (llama3, linear, yarn with its attention factor): inverse frequencies and cos/sin
  against transformers' own ``ROPE_INIT_FUNCTIONS`` and rotary module;
- ``masked_attention`` (sliding window, soft-capped scores, grouped-query attention, queries that
  continue a prefix, documents) against a naive per-head formula, gradients included;
- a GPT with every feature on at tp2 (with and without sequence parallelism, selective
  recompute) and split into pipeline stages, against the single-process model: logits to 1e-10,
  every gradient to 1e-9;
- KV-cache generation with a window shorter than the sequence against recomputing the whole
  sequence, the cache never holding more than the window.
"""

from __future__ import annotations

import math
import zlib
import pytest
import torch

from conftest import spawn_ranks
from megatron_hydra.config.transformer_config import RopeScaling, TransformerConfig
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.models.kv_cache import KVCache
from megatron_hydra.models.rope import RotaryEmbedding, inverse_frequencies
from megatron_hydra.parallel.document_masks import masked_attention
from megatron_hydra.parallel.state import ParallelState

# RoPE scaling against transformers ----------------------------------------------------------------

SCALINGS = {
    "llama3": RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=1.0,
                          high_freq_factor=4.0),
    "linear": RopeScaling(type="linear", factor=4.0),
    "yarn": RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0),
    "yarn_untruncated": RopeScaling(type="yarn", factor=6.0, original_max_position_embeddings=48, beta_fast=24.0,
                                    beta_slow=2.0, truncate=False),
    "yarn_attention_factor": RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                         attention_factor=1.3),
}


def hf_rope_parameters(s: RopeScaling, theta: float) -> dict:
    """The ``rope_parameters`` of a transformers config for ``s``."""
    params = {"rope_type": s.type, "rope_theta": theta, "factor": s.factor}
    if s.type == "llama3":
        params.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                      original_max_position_embeddings=s.original_max_position_embeddings)
    if s.type == "yarn":
        params.update(original_max_position_embeddings=s.original_max_position_embeddings, beta_fast=s.beta_fast,
                      beta_slow=s.beta_slow, truncate=s.truncate)
        if s.attention_factor is not None:
            params["attention_factor"] = s.attention_factor
    return params


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_scaling_equals_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from test_hf_families import Float64

    s, theta, head_dim, length = SCALINGS[name], 10000.0, 24, 40
    hf_cfg = LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=256,
                         rope_parameters=hf_rope_parameters(s, theta))
    with Float64():  # transformers' float32 requests as float64: its formulas to the last bits
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[s.type](hf_cfg)
        hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float64), torch.arange(length)[None])
    inv, factor = inverse_frequencies(head_dim, theta, s)
    assert hf_inv.dtype == torch.float64 and factor == pytest.approx(hf_factor, rel=1e-15)
    torch.testing.assert_close(inv, hf_inv, rtol=1e-13, atol=0)
    assert not torch.allclose(inv, inverse_frequencies(head_dim, theta)[0])  # the scaling changed something
    cfg = TransformerConfig(num_layers=1, hidden_size=96, num_attention_heads=4, num_query_groups=4,
                            kv_channels=head_dim, ffn_hidden_size=8, seq_length=length, max_position_embeddings=length,
                            vocab_size=8, padded_vocab_size=8, position_embedding="rope", rope_theta=theta,
                            rope_scaling=s, params_dtype=torch.float64)
    rope = RotaryEmbedding(cfg)
    torch.testing.assert_close(rope.cos, hf_cos[0], rtol=0, atol=1e-13)
    torch.testing.assert_close(rope.sin, hf_sin[0], rtol=0, atol=1e-13)


def test_windowed_layers_take_the_local_base_unscaled():
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2, kv_channels=8,
                            ffn_hidden_size=8, seq_length=8, max_position_embeddings=8, vocab_size=8,
                            padded_vocab_size=8, position_embedding="rope", rope_theta=1e6,
                            rope_scaling=SCALINGS["linear"], local_rope_theta=100.0, sliding_window=4,
                            window_layers=(0,), params_dtype=torch.float64)
    local, global_ = RotaryEmbedding(cfg, layer=0), RotaryEmbedding(cfg, layer=1)
    angles = torch.arange(8, dtype=torch.float64)[:, None] * inverse_frequencies(8, 100.0)[0]
    torch.testing.assert_close(local.cos[:, :4], angles.cos(), rtol=0, atol=1e-15)
    angles = torch.arange(8, dtype=torch.float64)[:, None] * inverse_frequencies(8, 1e6)[0] / 4.0
    torch.testing.assert_close(global_.cos[:, :4], angles.cos(), rtol=0, atol=1e-15)


# masked_attention against a naive formula ------------------------------------------------------------

def naive_attention(q, k, v, scale, causal, window, softcap, q_offset, document_ids=None):
    """Per head, per (query, key) pair: the scores, the cap, the mask written out as conditions on
    positions, softmax, weighted values."""
    b, heads, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    out = []
    for h in range(heads):
        g = h // (heads // groups)
        scores = q[:, h] @ k[:, g].transpose(-1, -2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        keep = torch.ones(b, sq, sk, dtype=torch.bool)
        for i in range(sq):
            for j in range(sk):
                pos = q_offset + i
                keep[:, i, j] &= not (causal and j > pos) and not (window is not None and pos - j >= window)
                if document_ids is not None:
                    keep[:, i, j] &= document_ids[:, pos] == document_ids[:, j]
        out.append(torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1) @ v[:, g])
    return torch.stack(out, dim=1)


ATTENTION_CASES = {  # sq, sk, heads, groups, causal, window, softcap, q_offset, documents
    "window": (9, 9, 4, 4, True, 3, None, None, False),
    "window_gqa_softcap": (9, 9, 6, 2, True, 4, 2.5, None, False),
    "softcap_only": (7, 7, 4, 2, True, None, 1.5, None, False),
    "cached_prefix_window_softcap": (3, 10, 6, 3, True, 5, 2.0, None, False),
    "explicit_offset": (4, 12, 4, 2, True, 6, None, 5, False),
    "one_new_token": (1, 8, 4, 1, True, 3, 3.0, None, False),
    "bidirectional_window": (6, 6, 2, 2, False, 3, None, None, False),
    "documents_window_softcap": (10, 10, 4, 2, True, 4, 2.0, None, True),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_masked_attention_equals_naive_formula(case):
    sq, sk, heads, groups, causal, window, softcap, offset, docs = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    q, k, v = (torch.randn(2, n, s, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for n, s in ((heads, sq), (groups, sk), (groups, sk)))
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]) if docs else None
    scale = 0.7
    ours = masked_attention(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap, q_offset=offset,
                            document_ids=ids)
    ref = naive_attention(q, k, v, scale, causal, window, softcap, sk - sq if offset is None else offset, ids)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    grad = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# The whole model with every feature on ------------------------------------------------------------

VOCAB = 301
FEATURES = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=12,
                ffn_hidden_size=48, seq_length=16, max_position_embeddings=16, vocab_size=VOCAB,
                position_embedding="rope", rope_theta=10000.0, rope_scaling=SCALINGS["llama3"],
                local_rope_theta=500.0, normalization="rmsnorm", norm_eps=1e-6, zero_centered_gamma=True,
                post_sublayer_norm=True, scale_embeddings=True, activation="geglu", add_bias_linear=False,
                qkv_bias=True, qk_norm=True, sliding_window=5, window_layers=(0, 2), attn_logit_softcapping=4.0,
                final_logit_softcapping=3.0, tie_embeddings=True, init_std=0.3, softmax_scale=20.0 ** -0.5,
                params_dtype=torch.float64)


def features_config(tp: int = 1, **overrides) -> TransformerConfig:
    padded = 128 * tp * math.ceil(VOCAB / (128 * tp))
    return TransformerConfig(**{**FEATURES, **overrides}, padded_vocab_size=padded)


def build(cfg: TransformerConfig, ps: ParallelState, **stage) -> GPTModel:
    """The model at ``ps``'s layout, initialised (layout-free), its norm weights and biases (zero
    at init) set to values of their own, the same logical values at every layout."""
    model = GPTModel(cfg, ps, **stage)
    init_weights(model, cfg, 77, ps.tp_rank, ps.tp_size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                shape = list(p.shape)
                dim = getattr(p, "tp_partition_dim", None)
                if dim is not None:
                    shape[dim] *= ps.tp_size
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = 0.3 * torch.randn(shape, generator=gen, dtype=p.dtype)
                p.copy_(full if dim is None else full.chunk(ps.tp_size, dim)[ps.tp_rank])
    return model


def batch():
    gen = torch.Generator().manual_seed(3)
    return (torch.randint(0, VOCAB, (2, FEATURES["seq_length"]), generator=gen),
            torch.randint(0, VOCAB, (2, FEATURES["seq_length"]), generator=gen))


def logits_and_grads(model: GPTModel, ps: ParallelState, training: bool = False):
    """Logits over the real vocabulary (gathered over TP), whether the padded entries are -inf,
    and every parameter's logical gradient after the loss's backward (TP sums applied)."""
    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.parallel.data_parallel import allreduce_sequence_parallel_grads

    tokens, labels = batch()
    model.train(training)
    with torch.no_grad():
        logits = model(tokens)
    if ps.tp_size > 1:
        logits = C.all_gather(logits.contiguous(), -1, ps.tp_group)
    padded_masked = bool((logits[..., VOCAB:] == -math.inf).all())
    model(tokens, labels).mean().backward()
    allreduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
    grads = {}
    for name, p in model.named_parameters():
        dim = getattr(p, "tp_partition_dim", None)
        grads[name] = p.grad if dim is None or ps.tp_size == 1 else C.all_gather(p.grad.contiguous(), dim, ps.tp_group)
    return logits[..., :VOCAB], padded_masked, grads


def _tp_ranks(rank, world):
    torch.set_num_threads(1)
    ps = ParallelState.build(tp=world)
    out = {}
    for name, overrides, training in (("tp2_sp", dict(sequence_parallel=True), False),
                                      ("tp2_selective", dict(recompute_granularity="selective"), True)):
        cfg = features_config(world, **overrides)
        logits, masked, grads = logits_and_grads(build(cfg, ps), ps, training)
        out[name] = (logits, masked, {n: g[:VOCAB] if "embedding" in n else g for n, g in grads.items()})
    return out


@pytest.fixture(scope="module")
def tp_results():
    return spawn_ranks(_tp_ranks, 2)


@pytest.fixture(scope="module")
def single():
    cfg = features_config()
    logits, masked, grads = logits_and_grads(build(cfg, ParallelState.single()), ParallelState.single())
    assert masked
    return logits, {n: g[:VOCAB] if "embedding" in n else g for n, g in grads.items()}


def assert_grads_close(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    for name in ref:
        err = float((ours[name] - ref[name]).abs().max() / ref[name].abs().max())
        assert err < 1e-9, (name, err)


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2_selective"])
def test_every_feature_at_tp2_equals_single_process(tp_results, single, layout):
    ref_logits, ref_grads = single
    for rank in (0, 1):
        logits, masked, grads = tp_results[rank][layout]
        assert masked
        assert float((logits - ref_logits).abs().max()) < 1e-10
        assert_grads_close(grads, ref_grads)
    assert all(g.abs().max() > 0 for g in ref_grads.values())  # every parameter is used


def test_every_feature_in_pipeline_stages_equals_whole_model(single):
    """Stages built from their global layer indices pick the same windows and RoPE bases."""
    ref_logits, ref_grads = single
    ps, cfg = ParallelState.single(), features_config()
    first, last = build(cfg, ps, layers=[0, 1], post_process=False), build(cfg, ps, layers=[2], pre_process=False)
    tokens, labels = batch()
    with torch.no_grad():
        logits = last(first(tokens))
    assert float((logits[..., :VOCAB] - ref_logits).abs().max()) < 1e-10
    hidden = first(tokens)
    sent = hidden.detach().requires_grad_()
    last(sent, labels).mean().backward()
    hidden.backward(sent.grad)
    grads = {n: p.grad for n, p in (*first.named_parameters(), *last.named_parameters())}
    grads["embedding.weight"] = first.embedding.weight.grad + last.embedding.weight.grad  # the tied copies
    assert_grads_close({n: g[:VOCAB] if "embedding" in n else g for n, g in grads.items()}, ref_grads)


def test_features_change_the_model(single):
    """Each feature is live: switching it off changes the logits."""
    ref_logits = single[0]
    tokens, _ = batch()
    for off in (dict(sliding_window=None, window_layers=(), local_rope_theta=None), dict(attn_logit_softcapping=None),
                dict(final_logit_softcapping=None), dict(rope_scaling=None), dict(local_rope_theta=None),
                dict(scale_embeddings=False), dict(post_sublayer_norm=False), dict(zero_centered_gamma=False)):
        model = build(features_config(**off), ParallelState.single()).eval()
        with torch.no_grad():
            assert float((model(tokens)[..., :VOCAB] - ref_logits).abs().max()) > 1e-6, off


# KV-cache generation with a window --------------------------------------------------------------

def test_windowed_cache_generates_as_recomputation_and_keeps_only_the_window():
    cfg = features_config(seq_length=32, max_position_embeddings=32, sliding_window=4)
    model = build(cfg, ParallelState.single()).eval()
    windowed = [b.attention for i, b in model.layers.items() if int(i) in cfg.window_layers]
    tokens = batch()[0][:1, :6]
    cache, step, chunks = KVCache(), tokens, [3, 1, 1, 2, 1] + [1] * 16  # several new tokens at once too
    with torch.no_grad():
        for n in chunks:
            cached = model(step, kv_cache=cache)[..., :VOCAB]
            full = model(tokens)[..., :VOCAB]
            assert float((cached - full[:, -step.shape[1]:]).abs().max()) < 1e-10
            assert all(cache.held(a) <= cfg.sliding_window - 1 for a in windowed)
            assert cache.offset == tokens.shape[1]
            # the next n tokens: greedy from the full model's logits, fed together
            new = full[:, -1:].argmax(-1)
            for _ in range(n - 1):
                new = torch.cat([new, (new[:, -1:] * 7 + 3) % VOCAB], dim=1)
            tokens, step = torch.cat([tokens, new], dim=1), new
    assert tokens.shape[1] > 4 * cfg.sliding_window
    global_ = [b.attention for i, b in model.layers.items() if int(i) not in cfg.window_layers]
    assert all(cache.held(a) == cache.offset for a in global_)  # a global layer keeps everything


def test_greedy_tokens_with_and_without_cache():
    from megatron_hydra.generate import SamplingConfig, generate

    cfg = features_config(seq_length=32, max_position_embeddings=32, sliding_window=3)
    model = build(cfg, ParallelState.single())
    prompt = batch()[0][0, :5].tolist()
    greedy = SamplingConfig(greedy=True)
    with_cache = generate(model, prompt, 20, greedy, use_cache=True)
    assert with_cache == generate(model, prompt, 20, greedy, use_cache=False)
    assert len(with_cache) == 20
