"""The whole GPT under tensor (and sequence) parallelism equals the single-process model.

Two kinds of check:
- the full launch path (``run_training``) for tp2, tp4, tp2+sp and tp2 x dp2 logs the single
  process's per-step losses and grad norms over 10 steps (float64, 1e-9); with dropout on, the
  masks necessarily differ from one process's, so losses only stay close, and two runs from one
  seed are bit-identical;
- one spawn of 4 gloo ranks builds GPT variants at tp 2 and 4, with and without sequence
  parallelism, next to the TP=1 model, and checks per-rank parameter counts against a formula of
  the shape, the initial shards against the TP=1 weights (exactly), loss and every gradient
  against TP=1, the collectives of one block against the analytic count, and that dropout keeps
  replicated activations identical across TP ranks.
"""

from __future__ import annotations

import math

import pytest

from conftest import SMALL, assert_same_trajectory, compose_config, run_training, spawn_ranks

STEPS = 10
FP64 = [*SMALL, "precision=fp64", f"trainer.max_steps={STEPS}"]
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
LAYOUTS = {
    "tp2": ["parallel=tp2", "trainer.devices=2"],
    "tp4": ["parallel=tp4", "trainer.devices=4"],
    "tp2_sp": ["parallel=tp2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true", "trainer.devices=2"],
    "tp2_dp2": ["parallel=tp2", "trainer.devices=4"],
}
# Dropout masks under TP cannot be the single process's (attention dropout draws per TP rank from
# the sharded stream; under SP so does hidden dropout), so two layouts differ by the noise of two
# mask draws. Measured over these 10 steps (p=0.1): max relative loss difference to the single
# process 2.8e-4 (tp2), 4.3e-4 (tp4), 1.4e-3 (tp2+sp); dropout on vs off differs by 2.6e-3. So this
# tolerance only says that TP training with dropout follows the single-process trajectory; whether
# each region draws from the right stream is checked exactly by the model-level tests below.
DROPOUT_REL_TOL = 5e-3


# Full launch path ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_training(FP64, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_losses_equal_single_process(single, layout, tmp_path):
    rows = run_training([*FP64, *LAYOUTS[layout]], tmp_path)
    assert [r["step"] for r in rows] == [r["step"] for r in single] == list(range(STEPS))
    assert_same_trajectory(rows, single, rel=1e-9)
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.fixture(scope="module")
def single_dropout(tmp_path_factory):
    return run_training([*FP64, *DROPOUT], tmp_path_factory.mktemp("single_dropout"))


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_dropout_close_to_single_and_reproducible(single, single_dropout, layout, tmp_path):
    first = run_training([*FP64, *DROPOUT, *LAYOUTS[layout]], tmp_path / "a")
    again = run_training([*FP64, *DROPOUT, *LAYOUTS[layout]], tmp_path / "b")
    keys = ("loss", "grad_norm")
    assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in again]  # bit-identical
    assert_same_trajectory(first, single_dropout, rel=DROPOUT_REL_TOL, keys=("loss",))
    assert any(abs(ours["loss"] - off["loss"]) > 1e-6 for ours, off in zip(first, single))  # dropout is on


# Model-level checks on 4 ranks -------------------------------------------------------------------

VOCAB = 300  # padded to 384 at tp=1 but 512 at tp=2 and 4: the padding must not matter
VARIANTS = {
    "gelu": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, kv_channels=8,
                 ffn_hidden_size=128, seq_length=8, max_position_embeddings=16, vocab_size=VOCAB,
                 position_embedding="learned", normalization="layernorm", activation="gelu",
                 add_bias_linear=True, tie_embeddings=True, hidden_dropout=0.1, attention_dropout=0.1),
    "swiglu_gqa": dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, kv_channels=4,
                       ffn_hidden_size=96, seq_length=8, max_position_embeddings=8, vocab_size=VOCAB,
                       position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                       add_bias_linear=False, tie_embeddings=False, hidden_dropout=0.1, attention_dropout=0.1),
}
CASES = [f"{v}-tp{tp}{'-sp' if sp else ''}" for v in VARIANTS for tp in (2, 4) for sp in (False, True)]
BATCH = 2


def padded_vocab(vocab: int, tp: int) -> int:
    return 128 * tp * math.ceil(vocab / (128 * tp))


def expected_params_per_rank(v: dict, tp: int) -> int:
    """From the shape alone: the TP-sharded matrices (QKV with its query groups, attention
    output, MLP, vocabulary tables) divide by tp; norms, row-parallel biases and learned positions
    are replicated on every rank."""
    h, layers, d = v["hidden_size"], v["num_layers"], v["kv_channels"]
    heads, groups, ffn = v["num_attention_heads"], v["num_query_groups"], v["ffn_hidden_size"]
    mlp_in = 2 if v["activation"] == "swiglu" else 1  # gate and up projections
    vocab_tables = 1 if v["tie_embeddings"] else 2
    norm = 2 * h if v["normalization"] == "layernorm" else h
    sharded = layers * ((heads + 2 * groups) * d * h + heads * d * h + (mlp_in + 1) * ffn * h)
    sharded += vocab_tables * padded_vocab(v["vocab_size"], tp) * h
    replicated = (2 * layers + 1) * norm
    if v["add_bias_linear"]:
        sharded += layers * ((heads + 2 * groups) * d + mlp_in * ffn)
        replicated += layers * 2 * h  # attention output and fc2 biases, added after the reduction
    if v["position_embedding"] == "learned":
        replicated += v["max_position_embeddings"] * h
    return sharded // tp + replicated


def _gather(t, dim, group):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _logical(p, ps, tensor=None):
    """The full tensor behind this rank's shard (raw all_gather, not the code under test)."""
    t = p.detach() if tensor is None else tensor
    dim = getattr(p, "tp_partition_dim", None)
    return t if dim is None else _gather(t, dim, ps.tp_group)


def _same_rows(ours, ref):
    """Equal on the rows both have; rows only one has (vocab padding) are zero."""
    n = min(ours.shape[0], ref.shape[0])
    pad_zero = all(bool((t[n:] == 0).all()) for t in (ours, ref))
    return pad_zero, ours[:n], ref[:n]


def _rel(ours, ref) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _check_model(variant, tp, sp, ps):
    import torch

    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.config.transformer_config import TransformerConfig
    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.parallel.data_parallel import allreduce_sequence_parallel_grads
    from megatron_hydra.parallel.random import seed_model_parallel
    from megatron_hydra.parallel.state import ParallelState

    v = dict(VARIANTS[variant])
    cfg = TransformerConfig(**v, padded_vocab_size=padded_vocab(VOCAB, tp), sequence_parallel=sp,
                            params_dtype=torch.float64)
    ref_cfg = TransformerConfig(**v, padded_vocab_size=padded_vocab(VOCAB, 1), params_dtype=torch.float64)
    model, ref = GPTModel(cfg, ps), GPTModel(ref_cfg, ParallelState.single())
    init_weights(model, cfg, 1234, ps.tp_rank, ps.tp_size)
    init_weights(ref, ref_cfg, 1234, 0, 1)
    ref_params = dict(ref.named_parameters())
    out = {"params": sum(p.numel() for p in model.parameters())}

    init_ok = sorted(ref_params) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        pad_zero, ours, theirs = _same_rows(_logical(p, ps), ref_params[name].detach())
        init_ok &= pad_zero and torch.equal(ours, theirs)
    out["init_equal"] = init_ok

    # Loss and every gradient against TP=1 (dropout off: eval mode).
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, cfg.seq_length), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, cfg.seq_length), generator=gen)
    model.eval(), ref.eval()
    loss, ref_loss = model(tokens, labels), ref(tokens, labels)
    loss.mean().backward()
    ref_loss.mean().backward()
    allreduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
    out["loss"] = _rel(loss.detach(), ref_loss.detach())
    grad_err = 0.0
    for name, p in model.named_parameters():
        pad_zero, ours, theirs = _same_rows(_logical(p, ps, p.grad), ref_params[name].grad)
        grad_err = max(grad_err, _rel(ours, theirs) if pad_zero else math.inf)
    out["grads"] = grad_err

    # Collectives of one block: per direction, 2 all-reduces of the full activation without SP;
    # 2 all-gathers of the slice plus 2 reduce-scatters of the full activation with SP.
    x = torch.randn(BATCH, cfg.seq_length // (tp if sp else 1), cfg.hidden_size, dtype=torch.float64,
                    requires_grad=True)
    with C.count_comm() as counter:
        model.layers["0"](x).sum().backward()
    full = BATCH * cfg.seq_length * cfg.hidden_size * 8
    expected = ({"all_gather": 4 * full // tp, "reduce_scatter": 4 * full} if sp else {"all_reduce": 4 * full})
    out["block_comm"] = (dict(counter.bytes), expected)

    # Dropout: the replicated stream must give identical masks on every TP rank (without SP the
    # residual stream, and so the grads of replicated params, stay identical); a rerun from the
    # same seed is bit-identical.
    def train_step():
        seed_model_parallel(99, ps.tp_rank)
        model.train()
        model.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        allreduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_a, grads_a = train_step()
    loss_b, grads_b = train_step()
    out["dropout_reproducible"] = torch.equal(loss_a, loss_b) and all(map(torch.equal, grads_a, grads_b))
    out["dropout_active"] = not torch.equal(loss_a, loss.detach().mean())
    replicated = [g for p, g in zip(model.parameters(), grads_a) if getattr(p, "tp_partition_dim", None) is None]
    gathered = [_gather(g.unsqueeze(0), 0, ps.tp_group) for g in replicated]
    out["replicated_grads_identical"] = all(torch.equal(g[0], g[i]) for g in gathered for i in range(tp))
    return out


def _rng_streams(ps):
    """Hashes of the default and TP-sharded CPU generator states after seeding, gathered over TP."""
    import torch

    from megatron_hydra.parallel.random import TP_RNG, get_rng_tracker, seed_model_parallel

    seed_model_parallel(42, ps.tp_rank)
    default = torch.get_rng_state().double().sum().reshape(1)
    sharded = get_rng_tracker().states[TP_RNG]["cpu"].double().sum().reshape(1)
    return _gather(default, 0, ps.tp_group).tolist(), _gather(sharded, 0, ps.tp_group).tolist()


def _all_model_checks(rank, world):
    import torch

    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    results = {}
    for tp in (2, 4):
        ps = ParallelState.build(tp=tp, dp=world // tp)
        results[f"rng-tp{tp}"] = _rng_streams(ps)
        for case in CASES:
            variant, case_tp, *sp = case.split("-")
            if case_tp == f"tp{tp}":
                results[case] = _check_model(variant, tp, bool(sp), ps)
    return results


@pytest.fixture(scope="module")
def model_checks():
    results = spawn_ranks(_all_model_checks, 4)
    assert sorted(results) == [0, 1, 2, 3]
    return results


@pytest.mark.parametrize("case", CASES)
def test_params_per_rank_match_formula(model_checks, case):
    variant, tp = case.split("-")[0], int(case.split("-")[1][2:])
    expected = expected_params_per_rank(VARIANTS[variant], tp)
    assert [model_checks[r][case]["params"] for r in range(4)] == [expected] * 4


@pytest.mark.parametrize("case", CASES)
def test_init_shards_gather_to_tp1_weights(model_checks, case):
    assert all(model_checks[r][case]["init_equal"] for r in range(4))


@pytest.mark.parametrize("case", CASES)
def test_loss_and_grads_equal_tp1(model_checks, case):
    for r in range(4):
        assert model_checks[r][case]["loss"] < 1e-12 and model_checks[r][case]["grads"] < 1e-9, model_checks[r][case]


@pytest.mark.parametrize("case", CASES)
def test_block_collectives_match_analytic_volume(model_checks, case):
    measured, expected = model_checks[0][case]["block_comm"]
    assert measured == expected


@pytest.mark.parametrize("case", CASES)
def test_dropout_replicated_and_reproducible(model_checks, case):
    for r in range(4):
        c = model_checks[r][case]
        assert c["dropout_reproducible"] and c["dropout_active"] and c["replicated_grads_identical"], c


@pytest.mark.parametrize("tp", [2, 4])
def test_rng_streams_shared_or_per_tp_rank(model_checks, tp):
    default, sharded = model_checks[0][f"rng-tp{tp}"]
    assert len(set(default)) == 1  # replicated regions: one stream on every TP rank
    assert len(set(sharded)) == tp  # sharded regions: a different stream per TP rank


# Random streams in one process ---------------------------------------------------------------------

def test_fork_draws_from_its_own_stream_and_leaves_the_default_alone():
    import torch

    from megatron_hydra.parallel.random import get_rng_tracker, seed_model_parallel

    seed_model_parallel(3, tp_rank=1)
    with get_rng_tracker().fork():
        sharded = torch.rand(4)
    default = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(default, torch.rand(4))  # the fork did not advance the default stream
    assert torch.equal(sharded, torch.rand(4, generator=torch.Generator().manual_seed(3 + 2718 + 1)))
    with get_rng_tracker().fork():  # the sharded stream continues where it stopped
        assert torch.equal(torch.rand(4), torch.rand(8, generator=torch.Generator().manual_seed(3 + 2718 + 1))[4:])


def test_fork_without_seeding_names_the_fix():
    from megatron_hydra.parallel.random import RNGStatesTracker

    with pytest.raises(RuntimeError, match="seed_model_parallel"):
        with RNGStatesTracker().fork():
            pass


# Config ------------------------------------------------------------------------------------------

def test_tp_layouts_derive():
    from megatron_hydra.config import derive

    d = derive(compose_config(["parallel=tp2", "trainer.devices=4", "model.vocab_size=50257"]))
    assert (d.tp, d.dp, d.transformer.padded_vocab_size) == (2, 2, 50432)
    d = derive(compose_config(["parallel=tp4", "trainer.devices=4", "parallel.sequence_parallel=true"]))
    assert (d.tp, d.dp, d.transformer.sequence_parallel) == (4, 1, True)


@pytest.mark.parametrize("overrides,key", [
    (["parallel=tp4", "trainer.devices=2"], "trainer.devices"),
    (["parallel=tp4", "trainer.devices=4", "model.num_attention_heads=6", "model.hidden_size=60"],
     "model.num_attention_heads"),
    (["parallel=tp4", "trainer.devices=4", "model.num_query_groups=2"], "model.num_query_groups"),
    (["parallel=tp4", "trainer.devices=4", "model.ffn_hidden_size=1030"], "model.ffn_hidden_size"),
    (["parallel=tp4", "trainer.devices=4", "parallel.sequence_parallel=true", "model.seq_length=30"],
     "model.seq_length"),
])
def test_tp_config_errors_name_the_key(overrides, key):
    from megatron_hydra.config import derive
    from megatron_hydra.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        derive(compose_config(overrides))
    assert key in str(info.value) and "\n" not in str(info.value)
