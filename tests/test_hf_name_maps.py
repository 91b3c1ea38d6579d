"""Every family's name map, in both directions, for the variants the transformers parity tests do
not build (Llama with biases or tied, GPT-2 untied, ...): export then import gives back our tensors
bitwise, and what does not fit is one line naming the tensor. Needs neither transformers nor
files: the tables and their transforms alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hydra.checkpoint.sharded import logical_shapes
from megatron_hydra.config import RunConfig, derive
from megatron_hydra.convert import bert, gpt2, llama, mixtral, t5
from megatron_hydra.convert.mapping import HFConfig, HFWeights
from megatron_hydra.convert.name_map import export_weights, import_weights
from megatron_hydra.errors import CheckpointError, ConfigError
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.parallel.state import ParallelState

GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=50)
LLAMA = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=50, max_position_embeddings=16)
BERT = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=16)
MIXTRAL = dict(LLAMA, num_local_experts=4, num_experts_per_tok=2)
T5 = dict(vocab_size=50, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4)

VARIANTS = {
    "gpt2-tied": (gpt2, GPT2),
    "gpt2-untied": (gpt2, dict(GPT2, tie_word_embeddings=False)),
    "llama-gqa-untied": (llama, LLAMA),
    "llama-biases-tied": (llama, dict(LLAMA, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "bert-masked-lm": (bert, dict(BERT, architectures=["BertForMaskedLM"])),
    "bert-pretraining": (bert, dict(BERT, architectures=["BertForPreTraining"])),
    "mixtral-untied": (mixtral, MIXTRAL),
    "mixtral-tied": (mixtral, dict(MIXTRAL, tie_word_embeddings=True)),
    "t5-v1.0": (t5, T5),
    "t5-v1.1": (t5, dict(T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
}


def _model(family, hf: dict):
    """(TransformerConfig, our logical shapes, random logical tensors) for ``hf``'s config."""
    cfg = RunConfig(model=family.model_config(HFConfig(hf, "config.json"), "test"), run_dir="unused")
    if family.ARCH != "gpt":
        cfg.data.name = "indexed"
    tcfg = derive(cfg).transformer
    shapes = logical_shapes(ARCHS[tcfg.arch].build(tcfg, ParallelState.single(), device="meta"), 1, tcfg.vocab_size)
    gen = torch.Generator().manual_seed(0)
    return tcfg, shapes, {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


@pytest.mark.parametrize("with_tied", [True, False], ids=["state-dict", "files"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_then_import_gives_back_our_tensors(variant, with_tied):
    family, hf = VARIANTS[variant]
    tcfg, shapes, ours = _model(family, hf)
    theirs = export_weights(family.NAME_MAP, ours, tcfg, with_tied=with_tied)
    weights = HFWeights(dict(theirs), "test")
    back = import_weights(family.NAME_MAP, weights, tcfg, shapes)
    assert sorted(back) == sorted(ours)
    assert all(torch.equal(back[name], tensor) for name, tensor in ours.items())
    assert not weights.unused()
    tied = {n for rule in family.NAME_MAP.rules if rule.tied for _, names in rule.instances(tcfg) for n in names}
    assert (tied <= set(theirs)) if with_tied else not tied & set(theirs)


def _gpt2():
    tcfg, shapes, ours = _model(gpt2, GPT2)
    return tcfg, shapes, export_weights(gpt2.NAME_MAP, ours, tcfg)


def test_bare_gpt2_model_names_import():
    """GPT2Model's files name tensors without ``transformer.``."""
    tcfg, shapes, theirs = _gpt2()
    bare = {name.removeprefix("transformer."): t for name, t in theirs.items()}
    assert len(import_weights(gpt2.NAME_MAP, HFWeights(bare, "test"), tcfg, shapes)) == len(shapes)


def test_missing_and_leftover_tensors_are_one_line_naming_them():
    tcfg, shapes, theirs = _gpt2()
    missing = {n: t for n, t in theirs.items() if n != "transformer.h.1.mlp.c_fc.bias"}
    with pytest.raises(CheckpointError, match=r"input=test has no tensor transformer\.h\.1\.mlp\.c_fc\.bias, which "):
        import_weights(gpt2.NAME_MAP, HFWeights(missing, "test"), tcfg, shapes)
    extra = {**theirs, "transformer.h.0.attn.q_norm.weight": torch.ones(8), "transformer.h.0.attn.bias": torch.ones(1)}
    with pytest.raises(CheckpointError, match=r"tensor transformer\.h\.0\.attn\.q_norm\.weight has no place in a "
                                              "gpt2 model of this config; this variant is not supported"):
        import_weights(gpt2.NAME_MAP, HFWeights(extra, "test"), tcfg, shapes)  # .attn.bias: an ignored buffer


def test_a_table_that_misses_a_tensor_is_one_line_each_way():
    tcfg, shapes, theirs = _gpt2()
    rules = tuple(r for r in gpt2.NAME_MAP.rules if "ln_f" not in str(r.theirs))
    partial = dataclasses.replace(gpt2.NAME_MAP, rules=rules)
    with pytest.raises(CheckpointError, match=r"nothing maps to our tensor final_norm\.(weight|bias); this variant"):
        import_weights(partial, HFWeights(theirs, "test"), tcfg, shapes)
    ours = {name: torch.zeros(shape) for name, shape in shapes.items()}
    with pytest.raises(ConfigError, match="our tensor final_norm.bias has no place in a Hugging Face gpt2 model"):
        export_weights(partial, ours, tcfg)
    with pytest.raises(ConfigError, match="this model has no tensor position_embedding.weight"):
        export_weights(gpt2.NAME_MAP, {n: t for n, t in ours.items() if n != "position_embedding.weight"}, tcfg)


def test_mixtral_experts_by_name_and_the_refusals():
    """Each expert's w1 / w3 / w2 (the names of Mixtral's files) is our gate / fc1 / fc2; a
    sliding window is refused on import, and the GPT families' export checks tell MoE from dense."""
    tcfg, shapes, ours = _model(mixtral, MIXTRAL)
    theirs = export_weights(mixtral.NAME_MAP, ours, tcfg)
    layer = "model.layers.1.block_sparse_moe."
    for hf_name, our_name in (("experts.3.w1", "experts.3.gate"), ("experts.3.w3", "experts.3.fc1"),
                              ("experts.0.w2", "experts.0.fc2"), ("gate", "router")):
        assert torch.equal(theirs[f"{layer}{hf_name}.weight"], ours[f"layers.1.mlp.{our_name}.weight"])
    assert tcfg.moe.router == "softmax" and tcfg.moe.norm_topk and tcfg.moe_layers == (0, 1)
    with pytest.raises(ConfigError, match="Mixtral sliding_window=4096 is not supported"):
        mixtral.model_config(HFConfig(dict(MIXTRAL, sliding_window=4096), "config.json"), "test")
    dense, _, _ = _model(llama, LLAMA)
    assert llama.compatible(tcfg) and mixtral.compatible(dense) and not mixtral.compatible(tcfg)
