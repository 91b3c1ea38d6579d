"""The single-process GPT equals an independent reference (``tests/reference_gpt.py``) in float64:
same weights in, same loss and same gradient for every parameter out. Every layout test compares
a parallel run with the single-process one; this test anchors that single-process model to
something the package did not produce."""

from __future__ import annotations

import pytest
import torch

from megatron_hydra.config import derive
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel.state import ParallelState
from conftest import SMALL, compose_config
from reference_gpt import RefConfig, ReferenceGPT

FORMS = {
    "gpt2": [],  # learned positions, LayerNorm, GELU, biases, tied head
    "llama": ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
              "model.add_bias_linear=false", "model.tie_embeddings=false", "model.num_query_groups=2",
              "model.rope_theta=500000.0"],
}


def _models(form: str):
    cfg = compose_config(SMALL + ["precision=fp64", "model.num_layers=3", "model.vocab_size=300", *FORMS[form]])
    t = derive(cfg).transformer
    assert t.padded_vocab_size > t.vocab_size  # padding rows exist and must not matter
    ours = GPTModel(t, ParallelState.single())
    init_weights(ours, t, seed=1234, tp_rank=0, tp_size=1)
    ref = ReferenceGPT(RefConfig(
        vocab=t.vocab_size, padded_vocab=t.padded_vocab_size, hidden=t.hidden_size, layers=t.num_layers,
        heads=t.num_attention_heads, groups=t.num_query_groups, ffn=t.ffn_hidden_size,
        max_positions=t.max_position_embeddings, rope=t.position_embedding == "rope", rope_theta=t.rope_theta,
        rmsnorm=t.normalization == "rmsnorm", eps=t.norm_eps, swiglu=t.activation == "swiglu",
        bias=t.add_bias_linear, tied=t.tie_embeddings)).double()
    ours_sd = ours.state_dict()
    assert set(ours_sd) == set(ref.state_dict()), "parameter names differ from the reference's"
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(ours_sd[name])
            p.add_(torch.randn_like(p) * 0.02 * (name.endswith("bias")))  # non-zero biases are tested too
    ours.load_state_dict(ref.state_dict())
    return ours, ref, t


@pytest.mark.parametrize("form", sorted(FORMS))
def test_single_process_gpt_equals_the_reference_in_float64(form):
    torch.manual_seed(0)
    ours, ref, t = _models(form)
    tokens = torch.randint(0, t.vocab_size, (2, t.seq_length))
    labels = torch.randint(0, t.vocab_size, (2, t.seq_length))
    ours.train()
    loss = ours(tokens, labels).mean()
    ref_loss = ref(tokens, labels)
    loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        expected = ref_params[name].grad
        torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
    # Padding rows of the vocabulary tables see no gradient in either model.
    assert ours.embedding.weight.grad[t.vocab_size:].abs().max() == 0


def test_reference_detects_a_changed_model():
    """The comparison can fail: a one-ulp-scale change in one weight shows in the grads."""
    torch.manual_seed(0)
    ours, ref, t = _models("llama")
    with torch.no_grad():
        ref.layers["1"].mlp.gate.weight[0, 0] += 1e-3
    tokens = torch.randint(0, t.vocab_size, (2, t.seq_length))
    ours(tokens, tokens).mean().backward()
    ref(tokens, tokens).backward()
    diff = (ours.layers["1"].mlp.gate.weight.grad - ref.layers["1"].mlp.gate.weight.grad).abs().max()
    assert diff > 1e-9
