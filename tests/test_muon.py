"""optim=muon equals a reference Muon written here from the published algorithm, at every layout.

The reference (float64, one process, plain tensors keyed by logical name) follows Keller Jordan's
Muon with Moonlight's update scaling for the hidden matrices and the AdamW formula for the rest,
after global-norm clipping. The package's optimizer runs on the real model at tp1 (here) and at
tp2 x dp2, pp2 x dp2, tp2 x pp2 with split QKV and MoE at tp2 x ep2 (four gloo ranks started once), on
the same synthetic gradients (a function of each logical name and step), and must equal it. Which
optimizer stepped each parameter is read from its state, so a silently disabled Muon path fails.
A checkpoint of the tp2 x dp2 run loads bitwise into one process and continues exactly.
"""

from __future__ import annotations

import logging
import re
import zlib

import pytest
import torch

from conftest import SMALL, compose_config, spawn_ranks

# Single-process save/load through DCP says so; it is what these tests do on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS = 3
LR, ADAM_LR, WD, CLIP = 2e-2, 5e-3, 0.1, 1.0
BETAS, EPS, MU = (0.9, 0.95), 1e-8, 0.95
BASE = [*SMALL, "precision=fp64", "optim=muon", "model.activation=swiglu", "model.num_query_groups=2",
        f"optim.lr={LR}", f"optim.muon_adam_lr={ADAM_LR}", f"optim.weight_decay={WD}", f"optim.clip_grad={CLIP}"]
MOE = ["model=moe_tiny", *(o for o in SMALL if o.startswith("model.")), "model.num_query_groups=2",
       "model.ffn_hidden_size=64", "model.moe.num_experts=4", "model.moe.ffn_hidden_size=32"]
LAYOUTS = {  # name: (overrides, extra reference switches)
    "tp2_dp2": (["parallel.tensor_parallel_size=2", "trainer.devices=4"], {}),
    "pp2_dp2": (["parallel.pipeline_parallel_size=2", "trainer.devices=4"], {}),
    "tp2_pp2_split_qkv": (["parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2", "trainer.devices=4",
                           "optim.muon_split_qkv=true", "optim.muon_nesterov=false"],
                          {"split_qkv": True, "nesterov": False}),
    "tp2_ep2_moe": (["parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2", "trainer.devices=4", *MOE],
                    {}),
}
VOCAB, VOCAB_TABLES = 500, ("embedding.weight", "output_weight")
HIDDEN = re.compile(r"^layers\.\d+\.(attention\.(qkv|proj)|mlp\.(experts\.\d+\.)?(fc1|gate|fc2))\.weight$")


# The reference ------------------------------------------------------------------------------
def synthetic(name: str, shape, salt: int) -> torch.Tensor:
    """A tensor for logical ``name`` at step ``salt``; a vocabulary table's padding rows are zero,
    as in training (checkpoints keep only the real rows)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 7 + salt)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    if name in VOCAB_TABLES:
        t[VOCAB:] = 0
    return t


def ns5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz quintic iteration (Keller Jordan's coefficients) toward the polar factor."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def moonlight(u: torch.Tensor) -> torch.Tensor:
    return ns5(u) * 0.2 * max(u.shape) ** 0.5


class Reference:
    def __init__(self, shapes: dict, heads_per_group: int, kv: int, split_qkv=False, nesterov=True):
        self.p = {n: synthetic(n, s, 0) * 0.02 for n, s in shapes.items()}
        self.m = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
        self.v = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
        self.hpg, self.kv, self.split, self.nesterov, self.t = heads_per_group, kv, split_qkv, nesterov, 0

    def orthogonal(self, name: str, u: torch.Tensor) -> torch.Tensor:
        if self.split and name.endswith("qkv.weight"):
            q = self.hpg * self.kv
            sizes = [q, self.kv, self.kv] * (u.shape[0] // (q + 2 * self.kv))
            return torch.cat([moonlight(b) for b in u.split(sizes)])
        return moonlight(u)

    def step(self):
        self.t += 1
        grads = {n: synthetic(n, p.shape, self.t) for n, p in self.p.items()}
        norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
        coef = min(1.0, CLIP / (norm.item() + 1e-6))
        for n, g in grads.items():
            g = g * coef
            if HIDDEN.match(n):
                self.m[n] = MU * self.m[n] + g
                u = g + MU * self.m[n] if self.nesterov else self.m[n]
                self.p[n] = self.p[n] * (1 - LR * WD) - LR * self.orthogonal(n, u)
                continue
            b1, b2 = BETAS
            self.m[n] = b1 * self.m[n] + (1 - b1) * g
            self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
            mhat, vhat = self.m[n] / (1 - b1 ** self.t), self.v[n] / (1 - b2 ** self.t)
            wd = WD if self.p[n].ndim >= 2 else 0.0
            self.p[n] = self.p[n] * (1 - ADAM_LR * wd) - ADAM_LR * mhat / (vhat.sqrt() + EPS)


# The package's run --------------------------------------------------------------------------
def build(overrides, ps):
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.training.module import LMModule

    cfg = compose_config([*BASE, *overrides])
    module = LMModule(cfg, derive(cfg), ps)
    buffer = GradBuffer(module.model.parameters(), ps.dp_cp_group, cfg.parallel.grad_bucket_size,
                        expert_dp_group=ps.expert_dp_group)
    return module, module.build_optimizer(buffer)


def local_part(e, logical: torch.Tensor, ps) -> torch.Tensor:
    return logical if e.dim is None else logical.chunk(ps.tp_size, e.dim)[ps.tp_rank]


def logical_shape(e, ps):
    shape = list(e.param.shape)
    if e.dim is not None:
        shape[e.dim] *= ps.tp_size
    return shape


@torch.no_grad()
def run(module, opt, ps, steps: int, first: int = 1, init: bool = True):
    """``steps`` optimizer steps on the synthetic gradients; the entries' local shards after them."""
    from megatron_hydra.checkpoint.sharded import entries

    es = entries(module.model)
    if init:
        for e in es:
            e.param.copy_(local_part(e, synthetic(e.name, logical_shape(e, ps), 0) * 0.02, ps))
    for t in range(first, first + steps):
        for e in es:
            e.part(e.owner.main_grad).copy_(local_part(e, synthetic(e.name, logical_shape(e, ps), t), ps))
        for group in opt.param_groups:
            group["lr"] = LR
        opt.step()
    return es


def stepped_by(opt, e) -> str:
    """Which optimizer holds state for ``e``'s parameter, read from the state itself."""
    pc = next(pc for pc in opt.pieces if pc.param is e.owner)
    if opt.muon is not None and pc.main in opt.muon.state:
        return f"muon{int(opt.muon.state[pc.main]['step'])}"
    return f"adamw{int(opt.inner.state[pc.main]['step'])}" if pc.main in opt.inner.state else "none"


def snapshot(es, opt, ps):
    out = {}
    for e in es:
        if e.copy:
            continue
        pc = next(pc for pc in opt.pieces if pc.param is e.owner)
        mom = opt.muon.state[pc.main]["momentum_buffer"] if pc.main in getattr(opt.muon, "state", {}) else None
        out[e.name] = {"param": e.param.detach().clone(), "dim": e.dim, "tp_rank": ps.tp_rank,
                       "momentum": None if mom is None else e.part(mom).clone(), "by": stepped_by(opt, e)}
    return out


def _layouts(rank, world, ckpt_dir):
    from megatron_hydra.checkpoint.sharded import save
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.collectives import count_comm
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    results = {}
    for name, (overrides, _) in LAYOUTS.items():
        d = derive(compose_config([*BASE, *overrides]))
        ps = ParallelState.build(tp=d.tp, pp=d.pp, dp=d.dp, ep=d.ep, etp=d.etp)
        module, opt = build(overrides, ps)
        with count_comm() as comm:
            es = run(module, opt, ps, STEPS)
        results[name] = {"state": snapshot(es, opt, ps), "gather_bytes": comm.bytes["muon_tp_gather"],
                         "tp_rank": ps.tp_rank}
        if name == "tp2_dp2":
            save(ckpt_dir, module.model, opt, ps, module.derived.transformer.vocab_size,
                 {"step": STEPS, "consumed_samples": 0, "shapes": {}}, rng_states=False)
    from test_muon_distributed import distributed_layouts  # the same ranks: one start for both modules

    results["distributed"] = distributed_layouts(rank, world, f"{ckpt_dir}_zero1")
    return results


_SPAWNED: dict = {}


def spawned(tmp_path_factory):
    """The four ranks' results (this module's layouts and ``test_muon_distributed``'s), started
    once for both modules, and the directory of their checkpoints."""
    if not _SPAWNED:
        ckpt = tmp_path_factory.mktemp("muon") / "ckpt"
        _SPAWNED["value"] = spawn_ranks(_layouts, 4, str(ckpt)), ckpt
    return _SPAWNED["value"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawned(tmp_path_factory)


def single(overrides=()):
    from megatron_hydra.parallel.state import ParallelState

    ps = ParallelState.single()
    module, opt = build(list(overrides), ps)
    return module, opt, ps


def reference_for(module, switches=None):
    from megatron_hydra.checkpoint.sharded import entries

    shapes = {e.name: tuple(e.param.shape) for e in entries(module.model) if not e.copy}
    cfg = module.derived.transformer
    return Reference(shapes, cfg.num_attention_heads // cfg.num_query_groups, cfg.kv_channels, **(switches or {}))


def logical(per_rank: dict, name: str, key: str = "param") -> torch.Tensor:
    """One logical tensor from the ranks' snapshots (each TP shard once)."""
    shards = {}
    for r in per_rank.values():
        if name in r["state"]:
            shards[r["state"][name]["tp_rank"]] = r["state"][name]
    dim = next(iter(shards.values()))["dim"]
    parts = [shards[k][key] for k in sorted(shards)]
    return parts[0] if dim is None else torch.cat(parts, dim)


# The tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [[], MOE], ids=["dense", "moe"])
def test_single_process_equals_reference(overrides):
    module, opt, ps = single(overrides)
    ref = reference_for(module)
    state = snapshot(run(module, opt, ps, STEPS), opt, ps)
    for _ in range(STEPS):
        ref.step()
    assert set(state) == set(ref.p)
    assert any(n.startswith("layers.0.mlp.experts.") for n in state) == bool(overrides)
    for name, s in state.items():
        assert s["by"] == (f"muon{STEPS}" if HIDDEN.match(name) else f"adamw{STEPS}"), name
        torch.testing.assert_close(s["param"], ref.p[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_reference(ranks, layout):
    results, _ = ranks
    per_rank = {r: res[layout] for r, res in results.items()}
    overrides, switches = LAYOUTS[layout]
    module, _, _ = single([o for o in overrides if o.startswith("model")])
    ref = reference_for(module, switches)
    for _ in range(STEPS):
        ref.step()
    names = set().union(*(r["state"] for r in per_rank.values()))
    assert names == set(ref.p)
    worst = 0.0
    for name in names:
        kinds = {r["state"][name]["by"] for r in per_rank.values() if name in r["state"]}
        assert kinds == {f"muon{STEPS}" if HIDDEN.match(name) else f"adamw{STEPS}"}, (name, kinds)
        worst = max(worst, (logical(per_rank, name) - ref.p[name]).abs().max().item())
    assert worst < 1e-9, worst


def test_tp_gather_bytes_follow_the_formula(ranks):
    # Each TP-sharded Muon matrix is all-gathered once per step: the logical matrix's bytes.
    results, _ = ranks
    module, _, _ = single()
    from megatron_hydra.checkpoint.sharded import entries

    per_step = sum(e.param.numel() * 8 for e in entries(module.model) if HIDDEN.match(e.name) and e.dim is not None)
    assert all(res["tp2_dp2"]["gather_bytes"] == STEPS * per_step for res in results.values())


def test_checkpoint_resumes_bitwise_at_another_layout(ranks):
    from megatron_hydra.checkpoint.sharded import load

    results, ckpt = ranks
    per_rank = {r: res["tp2_dp2"] for r, res in results.items()}
    module, opt, ps = single()
    load(str(ckpt), module.model, opt, ps, module.derived.transformer.vocab_size)
    state = snapshot(run(module, opt, ps, 0, init=False), opt, ps)
    for name, s in state.items():
        assert torch.equal(s["param"], logical(per_rank, name)), name
        if HIDDEN.match(name):
            assert torch.equal(s["momentum"], logical(per_rank, name, "momentum")), name
    ref = reference_for(module)
    for _ in range(STEPS + 1):
        ref.step()
    state = snapshot(run(module, opt, ps, 1, first=STEPS + 1, init=False), opt, ps)
    for name, s in state.items():
        torch.testing.assert_close(s["param"], ref.p[name], rtol=0, atol=1e-9, msg=name)


@pytest.mark.parametrize("saved,loaded,phrase", [
    (["optim=adamw"], [], "momentum at zero"),
    ([], ["optim=adamw"], "moments and step count at zero"),
], ids=["adamw_into_muon", "muon_into_adamw"])
def test_switching_optimizer_says_what_starts_afresh(tmp_path, caplog, saved, loaded, phrase):
    from megatron_hydra.checkpoint.sharded import load, save

    module, opt, ps = single(saved)
    run(module, opt, ps, 1)
    save(str(tmp_path / "c"), module.model, opt, ps, module.derived.transformer.vocab_size,
         {"step": 1, "consumed_samples": 0, "shapes": {}}, rng_states=False)
    other, other_opt, _ = single(loaded)
    with caplog.at_level(logging.WARNING):
        load(str(tmp_path / "c"), other.model, other_opt, ps, module.derived.transformer.vocab_size)
    lines = [r.getMessage() for r in caplog.records if "checkpoint from optim=" in r.getMessage()]
    assert len(lines) == 1 and phrase in lines[0], lines
    for name, p in other.model.named_parameters():
        state = (other_opt.muon.state if other_opt.muon is not None and p in other_opt.muon.state
                 else other_opt.inner.state)[p]
        fresh = bool(HIDDEN.match(name))  # the matrices the two optimizers step differently
        assert (int(state["step"]) == 0) == fresh, name
        assert all(not t.any() for k, t in state.items() if k != "step") == fresh, name


@pytest.mark.parametrize("override,key", [
    ("parallel.data_parallel=fsdp", "parallel.data_parallel=fsdp"),
    ("optim.muon_momentum=1.0", "optim.muon_momentum"),
    ("peft=lora", "optim=muon with peft=lora"),
    ("model.transformer_impl=transformer_engine", "model.transformer_impl=transformer_engine"),
])
def test_refused_combinations_name_the_key(override, key):
    from megatron_hydra.config import derive
    from megatron_hydra.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(key)):
        derive(compose_config([*BASE, override]))
