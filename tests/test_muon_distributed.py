"""optim=muon with the distributed optimizer equals the reference Muon of ``test_muon``.

The four gloo ranks of ``test_muon`` (started once for both modules) run the package's optimizer
at dp4, tp2 x dp2 and (MoE) ep2 x dp4 with ``optim.distributed_optimizer=true`` on
``test_muon``'s synthetic gradients; the result must equal the reference written there at 1e-9.
Which optimizer stepped each parameter is read from the state: every hidden matrix has exactly one
owner per TP rank holding its momentum, stepped by Muon, and no Adam state anywhere; every other
parameter is stepped by AdamW. The bytes the ownership costs are counted against the formula of
docs/muon.md, the plan's optimizer state against the busiest rank's, and a dp4 checkpoint resumes
bitwise at tp2 x dp2 (distributed) and in one process (plain Muon).
"""

from __future__ import annotations

import pytest
import torch

from conftest import compose_config
from test_muon import BASE, HIDDEN, MOE, STEPS, logical, reference_for, run, single, spawned

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DIST = ["optim.distributed_optimizer=true", "trainer.devices=4", "parallel.grad_bucket_size=20000"]
LAYOUTS = {"dp4": DIST, "tp2_dp2": [*DIST, "parallel.tensor_parallel_size=2"],
           "ep2_dp4_moe": [*DIST, "parallel.expert_parallel_size=2", *MOE]}  # experts owned over expert dp (2)


def build(overrides, ps):
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.training.module import LMModule

    cfg = compose_config([*BASE, *overrides])
    module = LMModule(cfg, derive(cfg), ps)
    buffer = GradBuffer(module.model.parameters(), ps.dp_cp_group, cfg.parallel.grad_bucket_size, distributed=True,
                        expert_dp_group=ps.expert_dp_group)
    return module, buffer, module.build_optimizer(buffer)


def snapshot(es, opt, ps):
    """Each logical tensor's local shard, its momentum where this rank owns it, and who stepped it."""
    opt.finish_param_gather()
    out = {}
    for e in es:
        if e.copy:
            continue
        adam = [int(opt.inner.state[pc.main]["step"]) for pc in opt.pieces
                if pc.param is e.owner and pc.main in opt.inner.state]
        owned = opt.muon.state.get(e.owner)
        out[e.name] = {"param": e.param.detach().clone(), "dim": e.dim, "tp_rank": ps.tp_rank, "adam": adam,
                       "muon": None if owned is None else int(owned["step"]),
                       "momentum": None if owned is None else e.part(owned["momentum_buffer"]).clone()}
    return out


def distributed_layouts(rank, world, ckpt_dir):
    """This module's part of the ranks ``test_muon`` starts (``test_muon.spawned``)."""
    from megatron_hydra.checkpoint.sharded import entries, load, save
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.collectives import count_comm
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    results = {}
    for name, overrides in LAYOUTS.items():
        d = derive(compose_config([*BASE, *overrides]))
        ps = ParallelState.build(tp=d.tp, dp=d.dp, ep=d.ep, etp=d.etp)
        module, buffer, opt = build(overrides, ps)
        with count_comm() as comm:
            es = run(module, opt, ps, STEPS)
        muon_ids = {id(p) for p in opt.muon.params}
        buckets = [b for b in buffer.buckets if any(id(p) in muon_ids for p in b.params)]
        results[name] = {"state": snapshot(es, opt, ps), "bytes": dict(comm.bytes), "tp_rank": ps.tp_rank,
                         "muon_buckets_bytes": sum((b.end - b.start) * buffer.buffer.element_size() for b in buckets),
                         "momentum_bytes": opt.muon.state_bytes(), "optimizer_bytes": opt.optimizer_bytes()}
        if name == "dp4":
            save(ckpt_dir, module.model, opt, ps, module.derived.transformer.vocab_size,
                 {"step": STEPS, "consumed_samples": 0, "shapes": {}}, rng_states=False)
            results["from_adamw"] = from_adamw(overrides, ps, f"{ckpt_dir}_adamw")
        elif name == "tp2_dp2":  # the dp4 checkpoint at tp2 x dp2, distributed too
            module, _, opt = build(overrides, ps)
            load(ckpt_dir, module.model, opt, ps, module.derived.transformer.vocab_size)
            results["resumed"] = {"state": snapshot(entries(module.model), opt, ps), "tp_rank": ps.tp_rank}
    return results


def from_adamw(overrides, ps, ckpt_dir):
    """A one-step AdamW checkpoint loaded by Muon under the distributed optimizer: each Muon
    matrix's step count and each other parameter's on this rank."""
    from megatron_hydra.checkpoint.sharded import load, save

    module, _, opt = build([*overrides, "optim=adamw"], ps)
    run(module, opt, ps, 1)
    save(ckpt_dir, module.model, opt, ps, module.derived.transformer.vocab_size,
         {"step": 1, "consumed_samples": 0, "shapes": {}}, rng_states=False)
    module, _, opt = build(overrides, ps)
    load(ckpt_dir, module.model, opt, ps, module.derived.transformer.vocab_size)
    muon = {name: int(opt.muon.step_of(p)) for name, p in module.model.named_parameters() if p in opt.muon.owner}
    adam = {id(pc.param): int(opt.inner.state[pc.main]["step"]) for pc in opt.pieces if pc.main in opt.inner.state}
    named = {name: adam[id(p)] for name, p in module.model.named_parameters() if id(p) in adam}
    return {"muon": muon, "adam": named}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results, ckpt = spawned(tmp_path_factory)
    return {r: res["distributed"] for r, res in results.items()}, f"{ckpt}_zero1"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_reference(ranks, layout):
    results, _ = ranks
    per_rank = {r: res[layout] for r, res in results.items()}
    module, _, _ = single([o for o in LAYOUTS[layout] if o.startswith("model")])
    ref = reference_for(module)
    for _ in range(STEPS):
        ref.step()
    tp = 2 if layout.startswith("tp2") else 1
    worst = 0.0
    for name in ref.p:
        held = [r["state"][name] for r in per_rank.values() if name in r["state"]]  # an expert: its ep rank's
        if HIDDEN.match(name):  # one owner per TP rank, Muon's momentum there only, no Adam anywhere
            owners = [s for s in held if s["muon"] is not None]
            assert sorted(s["tp_rank"] for s in owners) == list(range(tp)), name
            assert all(s["muon"] == STEPS for s in owners) and not any(s["adam"] for s in held), name
            momentum = logical({i: {"state": {name: s}} for i, s in enumerate(owners)}, name, "momentum")
            worst = max(worst, (momentum - ref.m[name]).abs().max().item())
        else:
            assert all(s["muon"] is None for s in held) and all(set(s["adam"]) <= {STEPS} for s in held), name
            assert any(s["adam"] for s in held), name
        worst = max(worst, (logical(per_rank, name) - ref.p[name]).abs().max().item())
    assert worst < 1e-9, worst


def test_momentum_is_split_over_the_owners(ranks):
    # Momentum only on owners: the ranks of one TP position hold Muon's momentum once between them.
    results, _ = ranks
    module, opt, ps = single()
    run(module, opt, ps, 1)
    whole = opt.muon.state_bytes()
    per_rank = [res["dp4"]["momentum_bytes"] for res in results.values()]
    assert sum(per_rank) == whole and max(per_rank) < whole


def test_plan_counts_the_busiest_rank(ranks):
    # The plan's optimizer state is the busiest rank's: Adam over the rest of its shards, and the
    # momentum of the matrices it owns; its momentum alone, the busiest owner's.
    from megatron_hydra.config import derive
    from megatron_hydra.planning import muon

    results, _ = ranks
    for layout, (tp, dp) in {"dp4": (1, 4), "tp2_dp2": (2, 2)}.items():
        cfg = compose_config([*BASE, *LAYOUTS[layout]])
        tc = derive(cfg).transformer
        chunks = [(range(tc.num_layers), True, True)]
        worst = max(res[layout]["momentum_bytes"] for res in results.values())
        assert worst == muon.owned_elements(muon.rank_matrices(tc, chunks), tp, dp) * 8, layout
        plan = muon.distributed_optimizer_state(tc, chunks, tp, dp, cfg.parallel.grad_bucket_size, 8)
        assert plan == max(res[layout]["optimizer_bytes"] for res in results.values()), layout


def test_ownership_bytes_follow_the_formula(ranks):
    # docs/muon.md: per step each rank all-gathers, then reduce-scatters, every bucket holding a
    # Muon matrix once (2 x its bytes), beyond ZeRO-1's own reduce-scatter and all-gather.
    from megatron_hydra.planning.muon import ownership_bytes

    results, _ = ranks
    for res in results.values():
        for layout in LAYOUTS:
            r = res[layout]
            assert r["muon_buckets_bytes"] > 0
            assert r["bytes"]["muon_grad_gather"] == r["bytes"]["muon_update_scatter"], layout
            total = r["bytes"]["muon_grad_gather"] + r["bytes"]["muon_update_scatter"]
            assert total == STEPS * ownership_bytes(r["muon_buckets_bytes"]), layout


def test_checkpoint_resumes_bitwise_at_another_layout(ranks):
    from megatron_hydra.checkpoint.sharded import load

    results, ckpt = ranks
    saved = {r: res["dp4"] for r, res in results.items()}
    resumed = {r: res["resumed"] for r, res in results.items()}
    module, opt, ps = single()
    load(str(ckpt), module.model, opt, ps, module.derived.transformer.vocab_size)
    plain = run(module, opt, ps, 0, init=False)
    for name in saved[0]["state"]:
        want = logical(saved, name)
        assert torch.equal(logical(resumed, name), want), name
        assert torch.equal(dict((e.name, e.param) for e in plain)[name], want), name
        if HIDDEN.match(name):
            owners = lambda per: {i: {"state": {name: r["state"][name]}} for i, r in per.items()  # noqa: E731
                                  if r["state"][name]["momentum"] is not None}
            want = logical(owners(saved), name, "momentum")
            assert torch.equal(logical(owners(resumed), name, "momentum"), want), name
            pc = next(pc for pc in opt.pieces for e in plain if e.name == name and pc.param is e.owner)
            assert torch.equal(opt.muon.state[pc.main]["momentum_buffer"], want), name
    ref = reference_for(module)
    for _ in range(STEPS + 1):
        ref.step()
    es = run(module, opt, ps, 1, first=STEPS + 1, init=False)
    for e in es:
        if not e.copy:
            torch.testing.assert_close(e.param, ref.p[e.name], rtol=0, atol=1e-9, msg=e.name)


def test_adamw_checkpoint_starts_every_muon_step_count_at_zero(ranks):
    """AdamW -> Muon with the distributed optimizer: every rank, owner or not, starts each Muon
    matrix's step count at zero (the checkpoint has no momentum for it) and keeps AdamW's for
    the rest, so the ranks' step counts agree."""
    results, _ = ranks
    for r, res in results.items():
        switched = res["from_adamw"]
        assert switched["muon"] and set(switched["muon"].values()) == {0}, r
        assert switched["adam"] and set(switched["adam"].values()) == {1}, r
