"""T5: parity with Hugging Face's T5ForConditionalGeneration (v1.0 ReLU and v1.1 gated-GELU,
weights converted by ``convert.t5``), the convert CLI's import then export giving back
transformers' tensors exactly, the bucket function against HF's, and tp2 training equal
to the single process over 5 steps (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SMALL, assert_reloads_bitwise, assert_same_trajectory, run_training
from megatron_hydra.checkpoint.sharded import logical_shapes
from megatron_hydra.config import RunConfig, derive
from megatron_hydra.convert.mapping import HFWeights
from megatron_hydra.convert.name_map import export_weights, import_weights
from megatron_hydra.convert.t5 import NAME_MAP, hf_config, model_config
from megatron_hydra.models.t5 import T5Model, relative_position_bucket
from megatron_hydra.parallel.state import ParallelState
from test_bert import load_logical, spread

try:
    import transformers
except ImportError:  # only the Hugging Face parity tests need it
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e .[hf])")

HF = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
          relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
          layer_norm_epsilon=1e-6, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def ours_from_hf(hf_model, hf_cfg):
    cfg = RunConfig(model=model_config(hf_cfg, "t5_test"), run_dir="unused")
    cfg.data.name = "indexed"
    tcfg = derive(cfg).transformer
    model = T5Model(tcfg, ParallelState.single()).eval()
    w = HFWeights(dict(hf_model.state_dict()), "test")
    load_logical(model, import_weights(NAME_MAP, w, tcfg, logical_shapes(model, 1, tcfg.vocab_size)))
    assert not w.unused()  # the tied copies (embed_tokens, a tied lm_head) checked too
    return model


@needs_transformers
@pytest.mark.parametrize("ffn", ["relu", "gated-gelu"])
def test_logits_equal_hf(ffn):
    torch.manual_seed(0)
    hf_cfg = dict(HF, feed_forward_proj=ffn)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf_cfg)).eval()
    ours = ours_from_hf(hf, hf_cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 300, (3, 30), generator=g)  # longer than max_distance: log buckets in use
    padding = torch.ones(3, 30, dtype=torch.long)
    padding[1, 21:] = 0
    labels = torch.randint(2, 300, (3, 12), generator=g)
    decoder_tokens = torch.cat([torch.zeros(3, 1, dtype=torch.long), labels[:, :-1]], 1)  # HF's shift right
    with torch.no_grad():
        ref = hf(input_ids=tokens, attention_mask=padding, decoder_input_ids=decoder_tokens).logits
        got = ours(tokens, decoder_tokens=decoder_tokens, padding_mask=padding)[..., :300]
        hf_loss = hf(input_ids=tokens, attention_mask=padding, labels=labels).loss
        our_loss = ours(tokens, labels, decoder_tokens=decoder_tokens, padding_mask=padding).mean()
    assert (got - ref).abs().max() < 1e-4
    assert our_loss.item() == pytest.approx(hf_loss.item(), rel=1e-5)
    logical = {n: p.detach()[:300] if n == "embedding.weight" else p.detach() for n, p in ours.named_parameters()}
    exported, reference = export_weights(NAME_MAP, logical, ours.cfg), hf.state_dict()
    assert set(exported) == set(reference)
    assert all(torch.equal(t, reference[n]) for n, t in exported.items())
    again = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf_config(ours.cfg)))
    again.load_state_dict(exported, strict=True)
    assert all(torch.equal(again.state_dict()[n], t) for n, t in reference.items())


@needs_transformers
@pytest.mark.parametrize("ffn, tied", [("relu", True), ("gated-gelu", False)], ids=["v1.0", "v1.1"])
def test_cli_import_then_export_gives_back_the_tensors(ffn, tied, tmp_path, capsys):
    from megatron_hydra.convert.__main__ import main

    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**HF, feed_forward_proj=ffn,
                                                                       tie_word_embeddings=tied))
    spread(hf)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["from_hf", f"input={tmp_path / 'hf'}", f"output={tmp_path / 'ckpt'}", "parallel=tp2"]) == 0
    assert "data=indexed_t5" in capsys.readouterr().out
    assert main(["to_hf", f"input={tmp_path / 'ckpt'}", f"output={tmp_path / 'out'}"]) == 0
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out")
    assert_reloads_bitwise(hf, back)


@needs_transformers
@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_equal_hf(bidirectional):
    relative = torch.arange(-300, 300)
    ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(relative, bidirectional, 32, 128)
    assert torch.equal(relative_position_bucket(relative, bidirectional, 32, 128), ref)


# Training: tp2 equals the single process ------------------------------------------------------

# A tp2 mismatch in forward, backward or the optimizer step shows within the first steps (float64, 1e-9).
STEPS = 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_bert_t5_data import write_corpus

    return write_corpus(tmp_path_factory.mktemp("t5_corpus"))


def t5_run(corpus: str, *extra: str):
    """No final checkpoint (nothing reads it)."""
    model = [o for o in SMALL if not o.startswith("data=")]
    return [*model, "model.arch=t5", "model.position_embedding=relative", "model.normalization=rmsnorm",
            "model.activation=geglu", "model.add_bias_linear=false", "model.tie_embeddings=false",
            "model.num_decoder_layers=2", "model.decoder_seq_length=16", "model.relative_attention_num_buckets=8",
            "model.relative_attention_max_distance=16", "data=indexed_t5", f"data.blend=[{corpus}]",
            "data.tokenizer.type=byte", "data.split=[90,10,0]", "precision=fp64", f"trainer.max_steps={STEPS}",
            "checkpoint.save_last=false", *extra]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    return run_training(t5_run(corpus), tmp_path_factory.mktemp("single"))


def test_tp2_losses_equal_single_process(corpus, single, tmp_path):
    # with full recomputation of every layer (encoder and decoder), which must not change the numerics
    rows = run_training(t5_run(corpus, "parallel=tp2", "trainer.devices=2", "recompute.granularity=full"), tmp_path)
    assert [r["step"] for r in rows] == [r["step"] for r in single] == list(range(STEPS))
    assert_same_trajectory(rows, single, rel=1e-9)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert single[0]["loss"] == pytest.approx(math.log(500), rel=0.05)  # starts near uniform over the vocabulary


@pytest.mark.parametrize("overrides,key", [
    (["parallel=pp2", "trainer.devices=2"], "parallel.pipeline_parallel_size"),
    (["data=demo"], "data.name"),
    (["model.position_embedding=rope"], "model.position_embedding"),
    (["data=indexed_t5", "parallel=tp2", "parallel.sequence_parallel=true", "trainer.devices=2"], "parallel.sequence_parallel"),
])
def test_unsupported_settings_are_one_line_config_errors(overrides, key):
    from conftest import compose_config
    from megatron_hydra.errors import ConfigError

    cfg = compose_config(["model=t5_base", "data=indexed_t5", *overrides])
    with pytest.raises(ConfigError, match=key) as err:
        derive(cfg)
    assert "\n" not in str(err.value)


def test_flops_formula_counts_the_forward_matmuls():
    """3x the forward's matmul and attention FLOPs as torch's FlopCounterMode counts them (with
    attention in its math form, whose matmuls the counter sees whatever the shapes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_hydra.planning.flops import model_flops_per_step

    cfg = RunConfig(model=model_config(dict(HF, feed_forward_proj="gated-gelu"), "t5_test"), run_dir="unused")
    cfg.data.name = "indexed"
    cfg.model.seq_length, cfg.model.decoder_seq_length = 24, 10
    tcfg = derive(cfg).transformer
    model = T5Model(tcfg, ParallelState.single())
    batch = 2
    with FlopCounterMode(display=False) as counter, \
            sdpa_kernel(SDPBackend.MATH):
        model(torch.zeros(batch, 24, dtype=torch.long), decoder_tokens=torch.zeros(batch, 10, dtype=torch.long))
    assert model_flops_per_step(tcfg, batch) == pytest.approx(3 * counter.get_total_flops(), rel=1e-12)
