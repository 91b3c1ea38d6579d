"""BERT: parity with Hugging Face's BertForMaskedLM / BertForPreTraining (weights converted by
``convert.bert``, and back); the convert CLI's import then export giving back transformers'
tensors exactly, and its printed fine-tune command running; tp2 x dp2 and pp2 (with full
recomputation) training equal to the single process over 6 steps in float64 (losses, grad norms,
validation), and a tp2 x dp2 checkpoint continued under pp2."""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, assert_reloads_bitwise, assert_same_trajectory, launch_py, run_training
from megatron_hydra.checkpoint.sharded import logical_shapes
from megatron_hydra.config import RunConfig, derive
from megatron_hydra.convert.bert import NAME_MAP, hf_config, model_config
from megatron_hydra.convert.mapping import HFWeights
from megatron_hydra.convert.name_map import export_weights, import_weights
from megatron_hydra.models.bert import BertModel
from megatron_hydra.models.init import VOCAB_TABLES
from megatron_hydra.parallel.state import ParallelState

try:
    import transformers
except ImportError:  # only the Hugging Face parity tests need it
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e .[hf])")

HF = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
          max_position_embeddings=40, type_vocab_size=2, hidden_act="gelu", hidden_dropout_prob=0.0,
          attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)


def load_logical(model: torch.nn.Module, tensors: dict) -> None:
    """Load logical (unpadded) tensors into a TP=1 model, zero-padding the vocabulary tables."""
    state = {}
    for name, p in model.named_parameters():
        t = tensors[name]
        if name in VOCAB_TABLES:
            t = torch.cat([t, t.new_zeros([p.shape[0] - t.shape[0], *t.shape[1:]])])
        state[name] = t
    assert set(tensors) == set(state)
    model.load_state_dict(state, strict=True)


def ours_from_hf(hf_model, binary_head: bool):
    cfg = RunConfig(model=model_config(HF, "bert_test", binary_head=binary_head), run_dir="unused")
    cfg.data.name = "indexed"
    tcfg = derive(cfg).transformer
    model = BertModel(tcfg, ParallelState.single()).eval()
    w = HFWeights(dict(hf_model.state_dict()), "test")
    load_logical(model, import_weights(NAME_MAP, w, tcfg, logical_shapes(model, 1, tcfg.vocab_size)))
    assert not w.unused(ignore=("position_ids", "token_type_ids"))
    return model


def spread(model: torch.nn.Module) -> None:
    """Replace transformers' init (norms at exactly one, biases at zero) by distinct random values,
    so that a mapping that swapped two tensors cannot pass an equality check."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, HF["vocab_size"], (3, 20), generator=g)
    types = (torch.arange(20) >= 9).long().expand(3, 20).clone()
    padding = torch.ones(3, 20, dtype=torch.long)
    padding[1, 14:] = 0
    padding[2, 5:] = 0
    return tokens, types, padding


@needs_transformers
def test_masked_lm_logits_equal_hf():
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**HF)).eval()
    ours = ours_from_hf(hf, binary_head=False)
    tokens, types, padding = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=tokens, token_type_ids=types, attention_mask=padding).logits
        got = ours(tokens, padding_mask=padding, token_types=types)[..., :HF["vocab_size"]]
    real = padding.bool()  # HF's padded positions attend like ours but are meaningless
    torch.testing.assert_close(got[real], ref[real], rtol=0, atol=1e-4)
    assert (got[real] - ref[real]).abs().max() < 1e-4


@needs_transformers
def test_pretraining_heads_equal_hf():
    torch.manual_seed(1)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**HF)).eval()
    ours = ours_from_hf(hf, binary_head=True)
    tokens, types, padding = _inputs(1)
    with torch.no_grad():
        out = hf(input_ids=tokens, token_type_ids=types, attention_mask=padding)
        hidden = ours.encode(tokens, padding, types)
        lm, sop = ours.lm_logits(hidden)[..., :HF["vocab_size"]], ours.binary_logits(hidden)
    real = padding.bool()
    torch.testing.assert_close(lm[real], out.prediction_logits[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(sop, out.seq_relationship_logits, rtol=0, atol=1e-4)


@needs_transformers
@pytest.mark.parametrize("binary_head", [False, True])
def test_export_inverts_import(binary_head):
    cls = transformers.BertForPreTraining if binary_head else transformers.BertForMaskedLM
    hf = cls(transformers.BertConfig(**HF))
    ours = ours_from_hf(hf, binary_head)
    logical = {n: p.detach()[:HF["vocab_size"]] if n in VOCAB_TABLES else p.detach() for n, p in ours.named_parameters()}
    exported = export_weights(NAME_MAP, logical, ours.cfg)
    reference = hf.state_dict()
    assert set(exported) == set(reference)  # the tied decoder weight and bias included, as HF holds them
    for name, t in exported.items():
        assert torch.equal(t, reference[name]), name
    # the exported config.json describes the same model: HF builds it and takes the weights strictly
    again = cls(transformers.BertConfig(**hf_config(ours.cfg)))
    again.load_state_dict(exported, strict=True)
    assert all(torch.equal(again.state_dict()[n], t) for n, t in reference.items())


# The convert CLI --------------------------------------------------------------------------------
def _convert(*argv: str) -> None:
    from megatron_hydra.convert.__main__ import main

    assert main(list(argv)) == 0


@needs_transformers
@pytest.mark.parametrize("arch", ["BertForMaskedLM", "BertForPreTraining"])
def test_cli_import_then_export_gives_back_the_tensors(arch, tmp_path):
    cls = getattr(transformers, arch)
    hf = cls(transformers.BertConfig(**HF))
    spread(hf)
    hf.save_pretrained(tmp_path / "hf")
    _convert("from_hf", f"input={tmp_path / 'hf'}", f"output={tmp_path / 'ckpt'}", "parallel=tp2")
    _convert("to_hf", f"input={tmp_path / 'ckpt'}", f"output={tmp_path / 'out'}")
    auto = transformers.AutoModelForPreTraining if arch == "BertForPreTraining" else transformers.AutoModelForMaskedLM
    back = auto.from_pretrained(tmp_path / "out")
    assert type(back) is cls
    assert_reloads_bitwise(hf, back)


@needs_transformers
def test_cli_import_then_printed_fine_tune_command(corpus, tmp_path, env_no_launcher, capsys):
    hf = transformers.BertForPreTraining(transformers.BertConfig(**HF))
    hf.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    _convert("from_hf", f"input={tmp_path / 'hf'}", f"output={ckpt}", "name=tiny_bert")
    command = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert command[:2] == ["python", "launch.py"] and "data=indexed_bert" in command
    blend = "data.blend=[path/to/corpus_text_document]"
    assert blend in command
    command[command.index(blend)] = f"data.blend=[{corpus}]"
    code = launch_py([*command[2:], "data.tokenizer.type=byte", "data.split=[90,10,0]", "model.seq_length=32",
                      "data.micro_batch_size=2", "data.global_batch_size=2", "trainer.max_steps=1",
                      "optim.warmup_steps=0", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"],
                     env_no_launcher)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert f"resumed from {ckpt} at step 0" in out.err + out.out


# Training: tp2 and pp2 equal the single process ------------------------------------------------

# Six steps: a mismatch in the layouts' forward, backward or sharded optimizer state shows in the first
# three (float64, 1e-9), and validation runs twice, at MIDDLE and at the end.
STEPS, MIDDLE = 6, 3


def bert_run(corpus: str, *extra: str):
    """No final checkpoint (``checkpoint.save_last=false``): only the tp2 run's mid-run one is read."""
    model = [o for o in SMALL if not o.startswith("data=")]
    return [*model, "model.arch=bert", "model.binary_head=true", "data=indexed_bert", f"data.blend=[{corpus}]",
            "data.tokenizer.type=byte", "data.split=[90,10,0]", "precision=fp64", f"trainer.max_steps={STEPS}",
            f"trainer.val_check_interval={MIDDLE}", "trainer.limit_val_batches=2", "checkpoint.save_last=false",
            *extra]


def train_rows(rows):
    return [r for r in rows if "loss" in r]


def val_losses(rows):
    return [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_bert_t5_data import write_corpus

    return write_corpus(tmp_path_factory.mktemp("bert_corpus"))


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    return run_training(bert_run(corpus), tmp_path_factory.mktemp("single"))


def _assert_equal_losses(rows, ref):
    assert_same_trajectory(train_rows(rows), train_rows(ref), rel=1e-9)


@pytest.fixture(scope="module")
def tp2(corpus, tmp_path_factory):
    """tp2 x dp2 (the layout of the README's BERT command), saving a checkpoint at step MIDDLE."""
    run_dir = tmp_path_factory.mktemp("tp2")
    ckpt = [f"checkpoint.every_n_steps={MIDDLE}", "checkpoint.keep_last=0"]
    return run_training(bert_run(corpus, "parallel=tp2", "trainer.devices=4", *ckpt), run_dir), run_dir


def test_tp2_dp2_losses_equal_single_process(single, tp2):
    rows, _ = tp2
    assert [r["step"] for r in train_rows(rows)] == list(range(STEPS))
    _assert_equal_losses(rows, single)
    assert train_rows(rows)[-1]["loss"] < train_rows(rows)[0]["loss"]
    assert len(val_losses(rows)) == 2 and val_losses(rows) == pytest.approx(val_losses(single), rel=1e-9)


def test_pp2_losses_equal_single_process(corpus, single, tmp_path):
    # with full recomputation of every layer, which must not change a bit of the numerics
    rows = run_training(bert_run(corpus, "parallel=pp2", "trainer.devices=2", "recompute.granularity=full"), tmp_path)
    assert [r["step"] for r in train_rows(rows)] == list(range(STEPS))
    _assert_equal_losses(rows, single)
    assert len(val_losses(rows)) == 2 and val_losses(rows) == pytest.approx(val_losses(single), rel=1e-9)


def test_tp2_dp2_checkpoint_resumes_under_pp2(corpus, single, tp2, tmp_path):
    # The masked-LM bias is a padded vocabulary table like the embedding: resharded by logical rows.
    _, run_dir = tp2
    ckpt = run_dir / "checkpoints" / f"step_{MIDDLE:07d}"
    rows = run_training(bert_run(corpus, "parallel=pp2", "trainer.devices=2", f"checkpoint.load={ckpt}"), tmp_path)
    assert [r["step"] for r in train_rows(rows)] == list(range(MIDDLE, STEPS))
    _assert_equal_losses(rows, train_rows(single)[MIDDLE:])
