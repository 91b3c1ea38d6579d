"""The distributed optimizer (ZeRO-1) equals the plain one, holds 1/dp of its state, and its
checkpoints load into plain runs."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, run_training, spawn_ranks

STEPS = 10
NO_FINAL_SAVE = ["checkpoint.save_last=false"]  # for runs whose checkpoint nothing reads
LAYOUTS = {
    "dp2": ["trainer.devices=2"],
    "dp4": ["trainer.devices=4"],
    "tp2_dp2": ["trainer.devices=4", "parallel=tp2"],
    "pp2_dp2": ["trainer.devices=4", "parallel=pp2", "data.global_batch_size=16"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_equal_plain_optimizer(layout, tmp_path):
    # fp32 on both sides, the same layout: the only difference is where Adam runs and how grads
    # and params travel (reduce-scatter + all-gather instead of all-reduce).
    common = [*SMALL, *NO_FINAL_SAVE, f"trainer.max_steps={STEPS}", *LAYOUTS[layout]]
    plain = run_training(common, tmp_path / "plain")
    ours = run_training([*common, "optim.distributed_optimizer=true"], tmp_path / "zero1")
    assert len(ours) == len(plain) == STEPS
    assert_same_trajectory(ours, plain, rel=1e-6, keys=("loss",))
    assert_same_trajectory(ours, plain, rel=1e-5, keys=("grad_norm",))
    assert ours[-1]["loss"] < ours[0]["loss"]


def _one_step(cfg, derived, ps, distributed: bool):
    """The run's module, gradient buffer and optimizer after one step on constant gradients."""
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.training.module import LMModule

    module = LMModule(cfg, derived, ps)
    buffer = GradBuffer(module.model.parameters(), ps.dp_cp_group, cfg.parallel.grad_bucket_size, distributed=distributed)
    opt = module.build_optimizer(buffer)
    for p in module.model.parameters():
        p.main_grad.fill_(1e-3)
    buffer.finish()
    opt.step()
    opt.finish_param_gather()
    return module, buffer, opt


def _state_bytes(rank, world, distributed, dtype):
    from conftest import compose_config
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    prec = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    cfg = compose_config([*SMALL, f"trainer.devices={world}", f"precision={prec}", "parallel.grad_bucket_size=5000"])
    module, buffer, opt = _one_step(cfg, derive(cfg), ParallelState.build(dp=world), distributed)
    params = sum(p.numel() for p in module.model.parameters())
    return {"optimizer": opt.optimizer_bytes(), "main": opt.main_weight_bytes(), "params": params,
            "buckets": len(buffer.buckets), "order": _gather_order(module, buffer, opt) if distributed else None}


def _gather_order(module, buffer, opt):
    """One more step, recorded: the parameter all-gathers' bytes in the order they were issued
    (against each bucket's), and which had been waited for when the first module's forward began; then
    the same step with ``overlap_param_gather`` off: whether any gather was left for the forward."""
    from megatron_hydra.parallel import collectives as C

    first = module.model.embedding
    hook = first.register_forward_pre_hook(lambda m, a: C.mark("first_forward"))  # after the optimizer's wait
    tokens = torch.randint(0, 100, (2, 32))
    for p in module.model.parameters():
        p.main_grad.fill_(1e-3)
    buffer.finish()
    with C.record_comm() as rec:
        opt.step()
        module.model(tokens)
    hook.remove()
    gathers = [e for e in rec.events if e.kind == "dp_all_gather"]
    start = next(t for label, _, t in rec.marks if label == "first_forward")
    item = opt.param_buffer.element_size()
    own = next(i for i, b in enumerate(buffer.buckets) if any(p is first.weight for p in b.params))
    waited = [i for i, e in enumerate(gathers) if e.wait_start is not None and e.wait_start <= start]
    order = {"issued": [e.nbytes for e in gathers], "bucket_bytes": [(b.end - b.start) * item for b in buffer.buckets],
             "own": own, "waited": waited}
    opt.overlap_param_gather = False
    opt.step()
    return {**order, "left_without_overlap": len(opt._gathers)}


def _state_bytes_both(rank, world, dtype):
    """``_state_bytes`` of the plain and of the distributed optimizer, in one process group, and
    the distributed optimizer's gather order (``_gather_order``)."""
    return {distributed: _state_bytes(rank, world, distributed, dtype) for distributed in (False, True)}


@functools.lru_cache(maxsize=None)
def _spawned(dp, dtype):
    """The ranks of ``_state_bytes_both``, started once per layout for the tests that read them."""
    return spawn_ranks(_state_bytes_both, dp, dtype)


@pytest.mark.parametrize("dp,dtype", [(4, "float32"), (2, "bfloat16")])
def test_optimizer_state_is_one_dp_th(dp, dtype):
    both = _spawned(dp, dtype)
    plain = {rank: r[False] for rank, r in both.items()}
    sharded = {rank: r[True] for rank, r in both.items()}
    n = plain[0]["params"]
    # Plain: every rank holds Adam's two fp32 moments of every parameter (and fp32 main weights
    # for bf16); sharded: the ranks' shards partition them exactly.
    assert all(r["optimizer"] == 2 * 4 * n for r in plain.values())
    assert sum(r["optimizer"] for r in sharded.values()) == 2 * 4 * n
    # Each bucket is padded to a multiple of dp, so a shard exceeds n/dp by less than a bucket's padding.
    slack = 2 * 4 * sharded[0]["buckets"]
    for r in sharded.values():
        assert abs(r["optimizer"] - 2 * 4 * n / dp) <= slack
        if dtype == "bfloat16":
            assert plain[0]["main"] == 4 * n
            assert 4 * n / dp <= r["main"] <= 4 * math.ceil(n / dp) + 4 * sharded[0]["buckets"] * dp
        else:
            assert r["main"] == 0  # fp32 Adam updates the model's own (gathered) parameter buffer


@pytest.mark.parametrize("dp,dtype", [(4, "float32"), (2, "bfloat16")])
def test_param_gathers_run_in_the_order_the_forward_reads_them(dp, dtype):
    # Buckets hold the last layers first and a group completes its collectives in issue order:
    # the gathers are issued last bucket first, so the embedding (the first module of the next
    # forward) starts after its own bucket's gather alone. Without overlap none is left pending.
    both = _spawned(dp, dtype)
    for rank, r in both.items():
        order = r[True]["order"]
        sizes = order["bucket_bytes"]
        assert len(sizes) > 2 and order["own"] == len(sizes) - 1
        assert order["issued"] == sizes[::-1], rank
        assert order["waited"] == [0], rank  # the first issued: the embedding's bucket
        assert order["left_without_overlap"] == 0


CROSS = [*SMALL, "precision=fp64", "trainer.max_steps=6"]


@pytest.fixture(scope="module")
def whole_plain_dp2(tmp_path_factory):
    """The uninterrupted plain run both directions below are compared with."""
    return run_training([*CROSS, *NO_FINAL_SAVE, "trainer.devices=2"], tmp_path_factory.mktemp("whole"))


@pytest.mark.parametrize("first,saved_at,second,loaded_at", [("true", 4, "false", 2), ("false", 2, "true", 4)])
def test_checkpoint_loads_across_optimizers(whole_plain_dp2, first, saved_at, second, loaded_at, tmp_path):
    # ZeRO-1 at dp4 -> plain at dp2, and plain at dp2 -> ZeRO-1 at dp4 (whose shards differ from
    # any dp2 ones): each rank writes only its own pieces, described by their place in the logical
    # tensors, so the resumed steps equal an uninterrupted plain run.
    common, whole = CROSS, whole_plain_dp2
    ckpt = tmp_path / "ckpt"
    run_training([*common, f"trainer.devices={saved_at}", "trainer.max_steps=3", f"optim.distributed_optimizer={first}",
                  f"checkpoint.dir={ckpt}"], tmp_path / "first")
    resumed = run_training([*common, *NO_FINAL_SAVE, f"trainer.devices={loaded_at}",
                            f"optim.distributed_optimizer={second}", f"checkpoint.dir={ckpt}"], tmp_path / "second")
    assert [int(r["step"]) for r in resumed] == [3, 4, 5]
    assert_same_trajectory(resumed, whole[3:], rel=1e-9, keys=("loss", "grad_norm"))


# A model whose optimizer state dwarfs everything else a rank allocates: about 17M parameters,
# so gathering the fp32 state whole would add ~128 MiB per rank at dp4 (and ~96 MiB at tp2 x dp2,
# bf16), against a bound of ~60 MiB: the rank's shard of the checkpoint (its optimizer state and
# its 1/dp of the weights) plus one bucket.
BIG = ["model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8", "model.vocab_size=8000",
       "parallel.grad_bucket_size=1000000"]


def _save_load_peak(rank, world, path):
    import torch.distributed as dist

    from conftest import compose_config
    from megatron_hydra.checkpoint.sharded import load, save
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.memory_peak import resident_peak_added

    torch.set_num_threads(1)
    out = {}
    for name, layout in {"dp4_fp32": ["precision=fp32"], "tp2_dp2_bf16": ["precision=bf16", "parallel=tp2"]}.items():
        cfg = compose_config([*SMALL, *BIG, f"trainer.devices={world}", "optim.distributed_optimizer=true", *layout])
        derived = derive(cfg)
        ps = ParallelState.build(tp=derived.tp, dp=derived.dp)
        module, buffer, opt = _one_step(cfg, derived, ps, True)
        target = f"{path}/{name}"
        vocab = derived.transformer.vocab_size
        saving = resident_peak_added(lambda: save(target, module.model, opt, ps, vocab, {"step": 1, "consumed_samples": 0}))
        dist.barrier()
        loading = resident_peak_added(lambda: load(target, module.model, opt, ps, vocab))
        bucket = max(b.end - b.start for b in buffer.buckets) * 4
        weights = sum(p.numel() * p.element_size() for p in module.model.parameters())
        # The rank's shard of the checkpoint: its optimizer state and its 1/dp of the weights.
        shard = opt.optimizer_bytes() + opt.main_weight_bytes() + weights // ps.dp_size
        out[name] = dict(save=saving, load=loading, shard=shard, bucket=bucket,
                         full=buffer.buffer.numel() * 4 * (3 if opt.separate else 2))
    return out


def test_save_and_load_hold_no_more_than_the_shard_and_a_bucket(tmp_path):
    results = spawn_ranks(_save_load_peak, 4, str(tmp_path))
    for rank, layouts in results.items():
        for name, r in layouts.items():
            bound = r["shard"] + r["bucket"]
            assert bound < r["full"], "the model is too small for a gather to show"
            for phase in ("save", "load"):
                assert r[phase] <= bound, (f"rank {rank} {name}: {phase} raised peak memory by {r[phase] / 2**20:.1f} MiB,"
                                           f" more than its shard of the checkpoint + one bucket ({bound / 2**20:.1f} MiB)")
