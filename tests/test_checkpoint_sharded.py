"""Sharded checkpoints reshard exactly: saved at tp2 x pp2 x dp2, loaded at other layouts.

The reference is independent of the checkpoint code: the full logical tensors are rebuilt in the
test from the saving ranks' own local shards (concatenated along their TP dim, padding dropped),
and the loading ranks' local shards, rebuilt the same way, must equal them bitwise, AdamW state
included. Replicated tensors must also agree between every rank that holds them.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, compose_config, spawn_ranks

VOCAB = 300  # padded to 384 at tp1 and 512 at tp2/tp4: the vocabulary tables change shape
MODEL = [*SMALL, "model.num_layers=4", f"model.vocab_size={VOCAB}", "precision=fp64", "data.global_batch_size=16"]


def build(layout, world):
    import torch.distributed as dist

    from megatron_hydra.config import derive
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    cfg = compose_config([*MODEL, f"trainer.devices={world}", *layout])
    derived = derive(cfg)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp) if dist.is_initialized() else ParallelState.single()
    module = LMModule(cfg, derived, ps)
    buffer = GradBuffer(module.model.parameters(), ps.dp_cp_group, cfg.parallel.grad_bucket_size)
    return derived, ps, module.model, module.build_optimizer(buffer)


def train_two_steps(model, opt, derived, ps):
    """Two AdamW steps with layout-independent gradients (a seeded logical tensor per name)."""
    from megatron_hydra.checkpoint.sharded import entries
    from megatron_hydra.models.init import logical_tensor

    for step in range(2):
        for e in entries(model):
            full = list(e.param.shape)
            if e.dim is not None:
                full[e.dim] *= ps.tp_size
            grad = logical_tensor(e.name, full, derived.transformer, seed=100 + step).to(e.param.dtype)
            if e.dim is not None:
                grad = grad.chunk(ps.tp_size, dim=e.dim)[ps.tp_rank]
            e.param.grad = grad.contiguous()
        opt.step()


def local_shards(model, opt, ps):
    from megatron_hydra.checkpoint.sharded import entries

    out = []
    for e in entries(model):
        state = opt.state[e.param]
        tensors = {"param": e.param.detach().clone()}
        tensors.update({k: state[k].clone() for k in ("exp_avg", "exp_avg_sq", "step")} if state else {})
        # numpy arrays travel back by value (tensors would be shared with a process about to exit)
        tensors = {k: t.numpy() for k, t in tensors.items()}
        out.append(dict(name=e.name, dim=e.dim, vocab=e.vocab, copy=e.copy, tp_rank=ps.tp_rank, tensors=tensors))
    return out


def reconstruct(results):
    """{(name, kind): full logical tensor} from every rank's local shards."""
    pieces = {}
    for shards in results.values():
        for s in shards:
            for kind, t in s["tensors"].items():
                t = torch.from_numpy(t)
                pieces.setdefault((s["name"], kind), []).append((s, t))
    full = {}
    for key, items in pieces.items():
        s0 = items[0][0]
        by_rank = {}
        for s, t in items:
            if s["tp_rank"] in by_rank:
                assert torch.equal(by_rank[s["tp_rank"]], t), f"replicas of {key} differ"
            by_rank[s["tp_rank"]] = t
        if s0["vocab"] and key[1] != "step":
            whole = torch.cat([by_rank[r] for r in sorted(by_rank)], dim=0)
            assert not whole[VOCAB:].any(), f"padding rows of {key} are not zero"
            full[key] = whole[:VOCAB]
        elif s0["dim"] is not None and key[1] != "step":
            full[key] = torch.cat([by_rank[r] for r in sorted(by_rank)], dim=s0["dim"])
        else:
            values = list(by_rank.values())
            assert all(torch.equal(values[0], v) for v in values), f"TP replicas of {key} differ"
            full[key] = values[0]
    return full


def _save_rank(rank, world, layout, path):
    from megatron_hydra.checkpoint.sharded import save

    derived, ps, model, opt = build(layout, world)
    train_two_steps(model, opt, derived, ps)
    save(path, model, opt, ps, VOCAB, {"step": 2, "consumed_samples": 2 * 16, "shapes": {}})
    return local_shards(model, opt, ps)


def _load_rank(rank, world, layout, path, with_optimizer):
    from megatron_hydra.checkpoint.sharded import load

    derived, ps, model, opt = build(layout, world)
    load(path, model, opt, ps, VOCAB, load_optimizer=with_optimizer)
    return local_shards(model, opt, ps)


def _load_layouts(rank, world, layouts, path, with_optimizer):
    """``_load_rank`` for each layout of this world size in turn, each into a freshly built model
    and optimizer (one process group for them all)."""
    return [_load_rank(rank, world, layout, path, with_optimizer) for layout in layouts]


def _save_then_load(rank, world, layout, path, load_layout):
    """Save at ``layout``; once every rank has, load at ``load_layout`` (same world size) into a
    freshly built model and optimizer."""
    import torch.distributed as dist

    shards = _save_rank(rank, world, layout, path)
    dist.barrier()
    return shards, _load_rank(rank, world, load_layout, path, True)


# The loads below, by world size: those at the saving world size (8) run in the saving ranks, after
# the save; the others share one process group per world size.
LOADS = {  # id -> layout
    "single": [],
    "tp4": ["parallel=tp4"],
    "pp4": ["parallel=pp4"],
    "pp2_dp4": ["parallel=pp2"],  # tp1 x pp2 x dp4
}


@pytest.fixture(scope="module")
def saved_and_loaded(tmp_path_factory):
    """The checkpoint's path, its full tensors rebuilt from the saving ranks' shards, and the same
    rebuilt from each layout of LOADS after loading it."""
    path = str(tmp_path_factory.mktemp("ckpt") / "step_0000002")
    results = spawn_ranks(_save_then_load, 8, ["parallel=tp2_pp2"], path, LOADS["pp2_dp4"])
    assert len(results) == 8
    full = reconstruct({rank: shards for rank, (shards, _) in results.items()})
    loaded = {"pp2_dp4": reconstruct({rank: shards for rank, (_, shards) in results.items()})}
    for world, names in ((1, ["single"]), (4, ["tp4", "pp4"])):
        per_rank = spawn_ranks(_load_layouts, world, [LOADS[n] for n in names], path, True)
        for i, name in enumerate(names):
            loaded[name] = reconstruct({rank: r[i] for rank, r in per_rank.items()})
    return path, full, loaded


@pytest.fixture(scope="module")
def saved(saved_and_loaded):
    path, full, _ = saved_and_loaded
    return path, full


def test_save_writes_a_complete_checkpoint(saved):
    from megatron_hydra.checkpoint import store

    path, full = saved
    assert store.is_complete(path) and store.validate(path)["has_optimizer"]
    assert full[("embedding.weight", "param")].shape == (VOCAB, 64)
    assert float(full[("layers.0.mlp.fc1.weight", "step")]) == 2.0


def test_every_rank_writes_only_its_own_pieces(saved):
    # Saved at tp2 x pp2 x dp2: each tensor is stored as chunks no larger than one rank's TP shard
    # split over its dp replicas, vocabulary tables included (no rank gathered a whole table), and
    # the chunks tile the logical tensor exactly.
    import math

    from megatron_hydra.checkpoint.safe_reader import read_metadata

    path, full = saved
    for key, md in read_metadata(path).state_dict_metadata.items():
        if len(md.size) == 0:
            continue
        numel = math.prod(md.size)
        assert sum(math.prod(c.sizes) for c in md.chunks) == numel, key
        if numel >= 64:  # big enough to be split at least over dp (weights) or tp x dp (tables)
            assert max(math.prod(c.sizes) for c in md.chunks) <= numel // 2, key
    table = read_metadata(path).state_dict_metadata["model/embedding.weight"]
    assert list(table.size) == [VOCAB, 64]
    assert max(c.offsets[0] + c.sizes[0] for c in table.chunks) == VOCAB  # padding rows are not written
    assert max(math.prod(c.sizes) for c in table.chunks) <= 256 * 64 // 2  # a TP shard's rows over dp2


@pytest.mark.parametrize("name", list(LOADS))
def test_any_layout_loads_it_bitwise(saved_and_loaded, name):
    path, full, loads = saved_and_loaded
    loaded = loads[name]
    assert set(loaded) == set(full)
    for key, ref in full.items():
        assert loaded[key].dtype == ref.dtype and torch.equal(loaded[key], ref), key


def test_model_only_load_leaves_fresh_optimizer(saved):
    path, full = saved
    loaded = reconstruct(spawn_ranks(_load_rank, 2, ["parallel=tp2"], path, False))
    params = {k: v for k, v in loaded.items() if k[1] == "param"}
    assert params and all(torch.equal(v, full[k]) for k, v in params.items())
    assert not any(k[1] == "exp_avg" for k in loaded)
