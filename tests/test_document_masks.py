"""Documents inside GPT samples (data.eod_mask_loss, data.reset_position_ids,
data.reset_attention_mask): the batch fields against hand-built streams and a plain loop, a packed
sequence against its documents run one by one (fp64), context-parallel attention with documents
against the full masked attention, and training runs under TP+SP, CP (ring and Ulysses), PP and
recompute against the single process (fp64, 1e-9)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL, assert_same_trajectory, compose_config, run_training, spawn_ranks
from megatron_hydra.config import derive
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.data.gpt_dataset import GPTDataset
from megatron_hydra.data.indexed import IndexedDataset, IndexedDatasetWriter
from megatron_hydra.data.packed_documents import DocumentFlags
from megatron_hydra.errors import ConfigError
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel.context_parallel import context_parallel_attention, shard_sequence
from megatron_hydra.parallel.random import seed_model_parallel
from megatron_hydra.parallel.state import ParallelState

EOD = 256  # the byte tokenizer's
ALL = DocumentFlags(EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)


def megatron_loop(tokens, eod):
    """Megatron-LM's per-sample loop, written out: (loss mask, positions, document of each token)."""
    n = len(tokens)
    loss_mask, positions, documents = [1.0] * n, list(range(n)), [0] * n
    prev = 0
    for i in [j for j in range(n) if tokens[j] == eod]:
        loss_mask[i] = 0.0
        for j in range(i + 1, n):
            positions[j] -= i + 1 - prev
            documents[j] += 1
        prev = i + 1
    return loss_mask, positions, documents


def test_fields_of_a_hand_built_stream():
    tokens = torch.tensor([5, 6, EOD, 7, 8, 9, EOD, EOD, 3])
    got = ALL.fields(tokens)
    assert got["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 0, 1]
    assert got["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0]
    assert got["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3]
    only_loss = DocumentFlags(EOD, eod_mask_loss=True).fields(tokens)
    assert set(only_loss) == {"loss_mask"}
    assert set(DocumentFlags(EOD, reset_position_ids=True).fields(tokens)) == {"loss_mask", "position_ids"}
    assert DocumentFlags(EOD, reset_attention_mask=True).fields(tokens)["loss_mask"].tolist() == [1] * 9


def make_corpus(prefix, n_docs=60, seed=0):
    """Documents of 2..17 random bytes, each ending with EOD (as preprocess writes them)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(prefix), np.uint16) as w:
        for _ in range(n_docs):
            w.add_document(np.append(rng.integers(0, 256, int(rng.integers(2, 18))), EOD))
    return str(prefix)


def test_gpt_dataset_fields_follow_the_eods(tmp_path):
    indexed = IndexedDataset(make_corpus(tmp_path / "c"))
    plain = GPTDataset(indexed, np.arange(60), 20, 32, 5, str(tmp_path / "cache"))
    flagged = GPTDataset(indexed, np.arange(60), 20, 32, 5, str(tmp_path / "cache"), flags=ALL)
    eods = 0
    for i in range(20):
        item, ref = flagged[i], plain[i]
        assert torch.equal(item["tokens"], ref["tokens"]) and torch.equal(item["labels"], ref["labels"])
        loss_mask, positions, documents = megatron_loop(item["tokens"].tolist(), EOD)
        assert item["loss_mask"].tolist() == loss_mask
        assert item["position_ids"].tolist() == positions and item["document_ids"].tolist() == documents
        eods += int((item["tokens"] == EOD).sum())
    assert eods > 20  # samples run across several documents


LLAMA = dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", num_query_groups=2,
             add_bias_linear=False, tie_embeddings=False)


@pytest.mark.parametrize("form", ["gpt", "llama_selective_recompute"])
def test_packed_sequence_equals_its_documents_alone(form):
    """Per-token losses and parameter grads of one packed sequence (reset positions and attention)
    equal the documents' run one at a time through the same model (grads summed), in fp64."""
    extra = dict(LLAMA, recompute_granularity="selective") if form != "gpt" else dict(num_query_groups=4)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8, ffn_hidden_size=64,
                            seq_length=16, max_position_embeddings=16, vocab_size=300, padded_vocab_size=384,
                            params_dtype=torch.float64, **extra)
    seed_model_parallel(1, 0)
    model = GPTModel(cfg, ParallelState.single())
    init_weights(model, cfg, 3, 0, 1)
    model.train()
    lengths = [5, 7, 4]  # three documents, each ending with EOD except the last (cut by the sample)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, 16), generator=gen)
    tokens[0, 4], tokens[0, 11] = EOD, EOD
    labels = torch.randint(0, 256, (1, 16), generator=gen)
    fields = DocumentFlags(EOD, reset_position_ids=True, reset_attention_mask=True).fields(tokens)
    packed = model(tokens, labels, position_ids=fields["position_ids"], document_ids=fields["document_ids"])
    packed.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone, start = [], 0
    for n in lengths:
        alone.append(model(tokens[:, start:start + n], labels[:, start:start + n]))
        start += n
    torch.cat(alone, 1).sum().backward()
    assert (packed - torch.cat(alone, 1)).abs().max() < 1e-12
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).abs().max() < 1e-10, name


def test_eod_positions_carry_no_loss():
    """With data.eod_mask_loss the loss is the mean over non-EOD inputs only: changing the label
    after an EOD changes nothing."""
    from megatron_hydra.models.archs import masked_mean

    tokens = torch.tensor([[5, EOD, 7, 8, EOD, 9]])
    mask = DocumentFlags(EOD, eod_mask_loss=True).fields(tokens)["loss_mask"]
    per_token = torch.tensor([[1.0, 100.0, 3.0, 4.0, 100.0, 6.0]], dtype=torch.float64)
    assert masked_mean(per_token, mask).item() == pytest.approx((1 + 3 + 4 + 6) / 4)


# Context-parallel attention with documents, against the full masked attention -------------------

LENGTHS = [3, 6, 2, 5]  # seq 16 at cp2: documents cross chunk edges, some ring blocks have empty rows


def _cp_worker(rank: int, world: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    seq, errors = sum(LENGTHS), {}
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)]).expand(2, seq)
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    for comm in ("p2p", "a2a"):
        gen = torch.Generator().manual_seed(3)
        q, k, v, dout = (torch.randn(2, n, seq, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2, 4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, attn_mask=allowed.unsqueeze(1), enable_gqa=True)
        ref.backward(dout)
        local = [shard_sequence(t, 2, world, rank).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, group, comm, True, None, shard_sequence(ids, 1, world, rank))
        out.backward(shard_sequence(dout, 2, world, rank))
        errors[comm] = max(float((got - shard_sequence(want, 2, world, rank)).abs().max())
                           for got, want in zip([out.detach()] + [t.grad for t in local],
                                                [ref.detach()] + [t.grad for t in full]))
    return errors


def test_context_parallel_attention_with_documents():
    for rank, errors in spawn_ranks(_cp_worker, 2).items():
        assert max(errors.values()) < 1e-10, (rank, errors)


# Training runs: layouts equal the single process with documents on ------------------------------

STEPS = 3


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    corpus = make_corpus(tmp_path_factory.mktemp("corpus") / "docs", n_docs=200)
    model = [o for o in SMALL if not o.startswith("data=")]
    base = [*model, "data=indexed", f"data.blend=[{corpus}]", "data.tokenizer.type=byte", "data.split=[1,0,0]",
            "precision=fp64", f"trainer.max_steps={STEPS}", "data.eod_mask_loss=true",
            "data.reset_position_ids=true", "data.reset_attention_mask=true", "model.position_embedding=rope",
            "model.num_query_groups=2"]
    return base, run_training(base, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("layout", [
    ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true", "trainer.devices=2",
     "recompute.granularity=full"],
    ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p", "trainer.devices=2"],
    ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a", "parallel.pipeline_parallel_size=2",
     "trainer.devices=4", "recompute.granularity=selective"],
], ids=["tp2_sp_full_recompute", "cp2_p2p", "cp2_a2a_pp2_selective_recompute"])
def test_layouts_equal_the_single_process(corpus_run, layout, tmp_path):
    base, reference = corpus_run
    rows = run_training([*base, *layout], tmp_path)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert_same_trajectory(rows, reference, rel=1e-9)


@pytest.mark.parametrize("overrides, key", [
    (["data=synthetic", "data.reset_attention_mask=true"], "data.reset_attention_mask"),
    (["data=synthetic", "data.eod_mask_loss=true"], "data.eod_mask_loss"),
    (["data=indexed_bert", "data.reset_position_ids=true", "model.arch=bert", "model.position_embedding=learned"],
     "data.reset_position_ids"),
    (["data=demo", "data.reset_attention_mask=true", "model.transformer_impl=transformer_engine"],
     "model.transformer_impl=local"),
    (["data=demo", "data.reset_position_ids=true", "model.transformer_impl=transformer_engine"],
     "data.reset_position_ids=true: .* model.transformer_impl=local"),
    (["data=sft", "data.path=chat.jsonl", "model.transformer_impl=transformer_engine"],
     "data=sft .* model.transformer_impl=local"),
])
def test_bad_settings_are_one_line_errors(overrides, key):
    with pytest.raises(ConfigError, match=key) as err:
        derive(compose_config([o for o in SMALL if not o.startswith("data=")] + overrides))
    assert "\n" not in str(err.value)


def test_dry_run_batches_carry_the_document_fields():
    """mode=dry_run steps a GPU job with the fields the datasets yield, so the masked attention runs."""
    from megatron_hydra.training.dry_run import _fake_batch

    cfg = compose_config(["data=indexed", "data.blend=[unused]", "model=gpt_tiny", "data.reset_attention_mask=true",
                          "data.reset_position_ids=true", "parallel.context_parallel_size=2", "trainer.devices=2"])
    batch = _fake_batch(cfg, derive(cfg), ParallelState.single())
    assert batch["document_ids"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["document_ids"].shape == batch["tokens"].shape
