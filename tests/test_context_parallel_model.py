"""The whole GPT under context parallelism equals the single-process model.

Every run goes through the launch path (config -> launcher -> workers -> Lightning) in float64 for
10 steps and must log the single process's per-step losses and grad norms to 1e-9: cp alone at 2
and 4, and cp combined with tensor + sequence parallelism, pipeline parallelism (1F1B), data
parallelism with the distributed optimizer or FSDP (sharding over dp x cp), and all three (tp2 x cp2 x pp2 on 8 ranks). Between
them the runs cover both key/value exchanges (p2p ring and a2a), rotary and learned positions,
grouped-query attention, and selective and full recomputation. A cp2 checkpoint then resumes at
cp1 on the single run's trajectory, and loads in one process (the generation path) with the
single run's weights, generating its tokens. Bad configs fail in ``derive`` with one line.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, compose_config, run_training, spawn_ranks
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError

STEPS = 10
FP64 = [*SMALL, "precision=fp64", f"trainer.max_steps={STEPS}", "checkpoint.async_save=false"]
# The Llama form: rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied head.
LLAMA = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
         "model.num_query_groups=2", "model.add_bias_linear=false", "model.tie_embeddings=false"]


def cp(size: int, devices: int, comm: str = "p2p", *more: str):
    return [f"parallel.context_parallel_size={size}", f"trainer.devices={devices}", f"parallel.cp_comm_type={comm}",
            *more]


LAYOUTS = {  # name -> (model form, layout)
    "cp2": ("gpt", cp(2, 2)),
    "cp4_a2a": ("llama", cp(4, 4, "a2a")),
    "cp2_tp2_sp": ("llama", cp(2, 4, "p2p", "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
                               "parallel.tp_comm_overlap=true", "recompute.granularity=selective")),
    "cp2_pp2": ("gpt", cp(2, 4, "p2p", "parallel.pipeline_parallel_size=2", "recompute.granularity=full")),
    "cp2_dp2_distopt": ("llama", cp(2, 4, "a2a", "optim.distributed_optimizer=true")),
    "cp2_fsdp_dp2": ("gpt", cp(2, 4, "p2p", "parallel.data_parallel=fsdp")),
    "tp2_cp2_pp2": ("llama", cp(2, 8, "p2p", "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2",
                                "parallel.sequence_parallel=true")),
}
# The GPT-form runs also save at step 5, where a cp2 checkpoint resumes at cp1.
FORMS = {"gpt": ["checkpoint.every_n_steps=5", "checkpoint.keep_last=0"], "llama": LLAMA}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return {form: (run_training([*FP64, *extra], tmp_path_factory.mktemp(f"single_{form}")),
                   tmp_path_factory.getbasetemp() / f"single_{form}0")
            for form, extra in FORMS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_losses_equal_single_process(single, name, tmp_path):
    form, layout = LAYOUTS[name]
    rows = run_training([*FP64, *FORMS[form], *layout], tmp_path)
    reference = single[form][0]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert_same_trajectory(rows, reference, rel=1e-9)
    assert rows[-1]["loss"] < rows[0]["loss"]
    if name == "cp2":
        _check_loads_whole_like_the_single_run(tmp_path, single[form][1])
        resumed = run_training([*FP64, *FORMS[form], f"checkpoint.load={tmp_path}/checkpoints/step_0000005"],
                               tmp_path / "resumed_at_cp1")
        assert [r["step"] for r in resumed] == list(range(5, STEPS))
        assert_same_trajectory(resumed, reference[5:], rel=1e-9)


def _check_loads_whole_like_the_single_run(cp_dir, single_dir):
    """The cp2 run's last checkpoint, loaded in one process by the generation path, holds the
    single run's weights (1e-9) and generates the same tokens greedily."""
    from megatron_hydra.checkpoint.standalone import load_model
    from megatron_hydra.generate import generate
    from megatron_hydra.generate import SamplingConfig

    step = f"checkpoints/step_{STEPS:07d}"
    _, _, ours = load_model(str(cp_dir / step))
    _, _, theirs = load_model(str(single_dir / step))
    reference = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, reference[name], rtol=1e-9, atol=1e-12, msg=name)
    greedy = SamplingConfig(greedy=True)
    assert generate(ours, [1, 2, 3], 8, greedy) == generate(theirs, [1, 2, 3], 8, greedy)


@pytest.mark.parametrize("overrides, key", [
    (cp(2, 2, "p2p", "model.seq_length=34"), "model.seq_length"),
    (cp(2, 4, "p2p", "model.seq_length=36", "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"),
     "model.seq_length"),
    (cp(4, 4, "a2a", "model.num_attention_heads=2", "model.hidden_size=64"), "parallel.cp_comm_type"),
    (cp(2, 2, "p2p", "model=bert_base", "data=indexed_bert"), "model.arch"),
    (cp(2, 2, "p2p", "model.attention_dropout=0.1"), "model.attention_dropout"),
    (cp(2, 2, "p2p", "model.transformer_impl=transformer_engine"), "model.transformer_impl"),
], ids=["seq_not_2cp", "seq_not_2cp_tp_sp", "a2a_heads", "bert", "attention_dropout", "transformer_engine"])
def test_bad_cp_configs_fail_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as err:
        derive(compose_config([*SMALL, *overrides]))
    message = str(err.value)
    assert key in message and "\n" not in message


def _model_at_cp2(rank, world):
    """One cp2 model next to the same weights in one process: the rank's per-token losses are its
    chunks of the whole model's, and generation on one rank (the end-of-run sample) runs locally,
    without waiting for the other rank."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_hydra.data.sequence_shards import shard_batch
    from megatron_hydra.generate import SamplingConfig, generate
    from megatron_hydra.models.archs import ARCHS
    from megatron_hydra.models.init import materialize
    from megatron_hydra.parallel.state import ParallelState

    def build(ps, overrides):
        cfg = compose_config([*SMALL, *LLAMA, "precision=fp64", *overrides])
        tcfg = derive(cfg).transformer
        return materialize(ARCHS["gpt"].build(tcfg, ps, device="meta"), tcfg, 1234, 0, 1, "cpu")

    ps = ParallelState.build(cp=2, timeout=timedelta(seconds=20))
    ours = build(ps, cp(2, 2))
    whole = build(ParallelState.single(), [])
    tokens = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = shard_batch({"tokens": tokens, "labels": tokens.roll(-1, 1)}, 2, rank)
    local = ours(batch["tokens"], labels=batch["labels"], position_ids=batch["position_ids"])
    expected = shard_batch({"tokens": whole(tokens, labels=tokens.roll(-1, 1))}, 2, rank)["tokens"]
    error = (local - expected).abs().max().item()
    sample = generate(ours, [1, 2, 3], 6, SamplingConfig(greedy=True)) if rank == 0 else None
    dist.barrier(group=ps.cp_group)
    return error, sample, generate(whole, [1, 2, 3], 6, SamplingConfig(greedy=True))


def test_model_at_cp2_holds_its_chunks_of_the_whole_model():
    results = spawn_ranks(_model_at_cp2, 2)
    assert max(r[0] for r in results.values()) < 1e-12
    assert results[0][1] == results[0][2]
