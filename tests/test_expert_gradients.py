"""Expert parallelism on the gradient side: a model with dense layers and a layer of experts split
over ep ranks (tokens of the whole ep group dispatched to each expert's holder) trains exactly as
one process does on every rank's data, with and without the distributed optimizer.

The reference is plain torch: the logical model (every expert whole) on the union of the ranks'
data, ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``, in float64.
"""

from __future__ import annotations

import pytest
import torch

from conftest import spawn_ranks

H, F, E, N = 4, 6, 4, 5  # hidden size, expert hidden size, experts, tokens per rank and micro-batch
MICRO, STEPS = 2, 3
LR, BETAS, EPS, WD = 0.05, (0.9, 0.95), 1e-8, 0.1
CLIP = 0.1  # below every step's norm (asserted), so clipping is active throughout
NAMES = ("w_in", "b_in", "w1", "b1", "w2", "b2", "w_out")
EXPERT = {"w1": 2, "b1": 1, "w2": 1, "b2": None}  # stacked expert tensors: their TP partition dim
DECAY = ("w_in", "w_out", "w1", "w2")  # each expert's biases are vectors: no weight decay
LAYOUTS = {  # name: ParallelState.build sizes
    "dp4_ep2": dict(dp=4, ep=2),
    "dp2_cp2_ep2": dict(dp=2, cp=2, ep=2),
    "tp2_dp2_ep2": dict(tp=2, dp=2, ep=2),  # one holder per expert (expert dp of 1), TP-sharded experts
    "cp4": dict(cp=4),  # ep 1: the experts are dense parameters
}


def initial_weights():
    g = torch.Generator().manual_seed(1)
    shapes = {"w_in": (H, H), "b_in": (H,), "w1": (E, H, F), "b1": (E, F), "w2": (E, F, H), "b2": (E, H),
              "w_out": (H, H)}
    return {k: 0.5 * torch.randn(shapes[k], generator=g, dtype=torch.float64) for k in NAMES}


def batches(shards: int):
    """Per step: x, y [shards, MICRO, N, H] and each token's expert [shards, MICRO, N]."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        x = torch.randn(shards, MICRO, N, H, generator=g, dtype=torch.float64)
        y = torch.randn(shards, MICRO, N, H, generator=g, dtype=torch.float64)
        out.append((x, y, torch.randint(0, E, (shards, MICRO, N), generator=g)))
    return out


def reference(shards: int):
    """The logical model on every shard's tokens at once: weights, norms and Adam state per step."""
    w = {k: torch.nn.Parameter(v.clone()) for k, v in initial_weights().items()}
    opt = torch.optim.AdamW([{"params": [w[k] for k in DECAY], "weight_decay": WD},
                             {"params": [w[k] for k in NAMES if k not in DECAY], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    norms = []
    for x, y, route in batches(shards):
        x, y, route = x.reshape(-1, H), y.reshape(-1, H), route.reshape(-1)
        h = torch.tanh(x @ w["w_in"].T + w["b_in"])
        inner = torch.tanh(torch.einsum("th,thf->tf", h, w["w1"][route]) + w["b1"][route])
        z = torch.einsum("tf,tfh->th", inner, w["w2"][route]) + w["b2"][route]
        loss = (((h + z) @ w["w_out"].T - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(w.values()), CLIP)))
        opt.step()
    state = {k: {s: opt.state[w[k]][s] for s in ("exp_avg", "exp_avg_sq")} for k in NAMES}
    return {k: v.detach() for k, v in w.items()}, norms, state


# The distributed side --------------------------------------------------------------------------
class _ToHolders(torch.autograd.Function):
    """Every ep rank's tokens, concatenated in ep-rank order; backward: each rank's slice of the
    gradients summed over the ep group (the dispatch's adjoint)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * n:(r + 1) * n], None


class _FromHolders(torch.autograd.Function):
    """Each holder's outputs (zero for tokens of other holders' experts) summed over the ep group,
    this rank's tokens kept; backward: every rank's gradients gathered."""

    @staticmethod
    def forward(ctx, partial, group):
        import torch.distributed as dist

        ctx.group = group
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        n = total.shape[0] // dist.get_world_size(group)
        r = dist.get_rank(group)
        return total[r * n:(r + 1) * n]

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class Experts(torch.nn.Module):
    """This rank's E/ep experts, stacked and split over TP along the expert hidden size (w1's
    columns, w2's rows; b2 is added after the TP sum, so every TP rank holds it whole)."""

    def __init__(self, weights, ps):
        from megatron_hydra.parallel import collectives as C

        super().__init__()
        self.ps, self.local = ps, E // ps.ep
        experts = slice(ps.ep_rank * self.local, (ps.ep_rank + 1) * self.local)
        for name, dim in EXPERT.items():
            value = weights[name][experts]
            if dim is not None:
                value = value.chunk(ps.tp_size, dim)[ps.tp_rank]
            p = torch.nn.Parameter(value.clone())
            p.tp_partition_dim, p.sequence_parallel = dim, False
            p.expert_parallel, p.num_experts = True, E
            setattr(self, name, p)
        self.tp_size = C.group_size(ps.tp_group)

    def forward(self, h, route):
        import torch.distributed as dist

        from megatron_hydra.parallel import mappings as M

        group = self.ps.ep_group
        if self.ps.ep > 1:
            h = _ToHolders.apply(h, group)
            routes = [torch.empty_like(route) for _ in range(self.ps.ep)]
            dist.all_gather(routes, route, group=group)
            route = torch.cat(routes)
        h = M.copy_to_tp(h, self.ps.tp_group)
        partial = torch.zeros_like(h)
        bias = torch.zeros_like(h)
        for i in range(self.local):
            rows = (route == self.ps.ep_rank * self.local + i).nonzero().squeeze(1)
            inner = torch.tanh(h[rows] @ self.w1[i] + self.b1[i])
            partial = partial.index_add(0, rows, inner @ self.w2[i])
            bias = bias.index_add(0, rows, self.b2[i].expand(len(rows), H))
        out = M.reduce_from_tp(partial, self.ps.tp_group) + bias
        return _FromHolders.apply(out, group) if self.ps.ep > 1 else out


class Toy(torch.nn.Module):
    def __init__(self, weights, ps):
        from megatron_hydra.parallel.layers import replicated

        super().__init__()
        self.inp = replicated(torch.nn.Linear(H, H, dtype=torch.float64))
        self.experts = Experts(weights, ps)
        self.out = replicated(torch.nn.Linear(H, H, bias=False, dtype=torch.float64))
        with torch.no_grad():
            self.inp.weight.copy_(weights["w_in"])
            self.inp.bias.copy_(weights["b_in"])
            self.out.weight.copy_(weights["w_out"])

    def forward(self, x, route, y):
        h = torch.tanh(self.inp(x))
        return ((self.out(h + self.experts(h, route)) - y) ** 2).mean()

    def by_name(self):
        return {"w_in": self.inp.weight, "b_in": self.inp.bias, "w_out": self.out.weight,
                **{k: getattr(self.experts, k) for k in EXPERT}}


def _logical(name, p, ps):
    """The whole logical tensor of ``p``: TP shards, then ep ranks' experts, gathered."""
    import torch.distributed as dist

    value = p.detach().clone()
    dim = p.tp_partition_dim
    if dim is not None and ps.tp_size > 1:
        parts = [torch.empty_like(value) for _ in range(ps.tp_size)]
        dist.all_gather(parts, value, group=ps.tp_group)
        value = torch.cat(parts, dim)
    if name in EXPERT and ps.ep > 1:
        parts = [torch.empty_like(value) for _ in range(ps.ep)]
        dist.all_gather(parts, value, group=ps.ep_group)
        value = torch.cat(parts)
    return value


def _state_pieces(opt, model, ps):
    """This rank's Adam state as ``(name, expert or None, start, end, local shape, partition dim,
    tp rank, step, tensors)``: flat ranges of one expert's (or a dense parameter's) TP-local tensor."""
    from megatron_hydra.parallel.optimizer import expert_ranges

    names = {p: k for k, p in model.by_name().items()}
    out = []
    for piece in opt.checkpoint_pieces():
        name, p = names[piece.param], piece.param
        tensors = {k: v.clone() for k, v in piece.tensors.items()}
        if name in EXPERT:
            dim = None if p.tp_partition_dim is None else p.tp_partition_dim - 1
            for expert, start, end in expert_ranges(p, piece.lo, piece.hi, ps.ep_rank):
                at = (expert - ps.ep_rank * p.shape[0]) * (p.numel() // p.shape[0]) - piece.lo
                out.append((name, expert, start, end, tuple(p.shape[1:]), dim, ps.tp_rank, float(piece.step),
                            {k: v[at + start:at + end] for k, v in tensors.items()}))
        else:
            out.append((name, None, piece.lo, piece.hi, tuple(p.shape), None, 0, float(piece.step), tensors))
    return out


def _train(layout, distributed):
    import torch.distributed as dist

    from megatron_hydra.parallel.data_parallel import GradBuffer, is_expert
    from megatron_hydra.parallel.optimizer import MegatronOptimizer
    from megatron_hydra.parallel.state import ParallelState

    ps = ParallelState.build(**LAYOUTS[layout])
    model = Toy(initial_weights(), ps)
    buffer = GradBuffer(model.parameters(), ps.dp_cp_group, 20, distributed=distributed,
                        expert_dp_group=ps.expert_dp_group)
    opt = MegatronOptimizer(model, buffer, ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, clip_grad=CLIP)
    # Experts' gradients in buckets of their own, reduced over the ranks holding the same experts.
    split = ps.expert_dp_group is not None
    own_buckets = all(b.group is (ps.expert_dp_group if split and is_expert(p) else ps.dp_cp_group)
                      for b in buffer.buckets for p in b.params)
    shard = ps.dp_rank * ps.cp_size + ps.cp_rank
    norms, launched = [], []
    for x, y, route in batches(ps.dp_size * ps.cp_size):
        buffer.zero()
        for m in range(MICRO):
            buffer.sync_enabled = m == MICRO - 1
            (model(x[shard, m], route[shard, m], y[shard, m]) / MICRO).backward()
        # Every bucket, dense and expert, was launched during backward (overlapped).
        launched.append(all(b.handle is not None for b in buffer.buckets))
        buffer.finish()
        opt.step()
        norms.append(float(opt.last_grad_norm))
    opt.finish_param_gather()
    weights = {k: _logical(k, p, ps) for k, p in model.by_name().items()}
    pieces = _state_pieces(opt, model, ps)
    opt.close()
    buffer.close()
    dist.barrier()
    return dict(weights=weights, norms=norms, launched=launched, pieces=pieces, own_buckets=own_buckets,
                shards=ps.dp_size * ps.cp_size)


def _run(rank, world, cases):
    torch.set_num_threads(1)
    return {case: _train(*case) for case in cases}


def _assemble(pieces, shapes):
    """Logical Adam state from every rank's pieces (every element covered, replicas equal), how
    many ranks hold each element, and the step counts."""
    state = {k: {s: torch.full(shapes[k], float("nan"), dtype=torch.float64) for s in ("exp_avg", "exp_avg_sq")}
             for k in NAMES}
    held = {k: torch.zeros(shapes[k], dtype=torch.int64) for k in NAMES}
    steps = set()
    for name, expert, start, end, local, dim, tp_rank, step, tensors in pieces:
        steps.add(step)
        index = list(torch.unravel_index(torch.arange(start, end), local))
        if dim is not None:
            index[dim] = index[dim] + tp_rank * local[dim]
        if expert is not None:
            index = [torch.full_like(index[0], expert)] + index
        held[name][tuple(index)] += 1
        for key in ("exp_avg", "exp_avg_sq"):
            target, values = state[name][key], tensors[key]
            seen = target[tuple(index)]
            done = ~seen.isnan()
            torch.testing.assert_close(seen[done], values[done], rtol=1e-13, atol=0, msg=f"replicas of {name} disagree")
            target[tuple(index)] = values
    for name in NAMES:
        for key, value in state[name].items():
            assert not value.isnan().any(), f"{name} {key}: not every element is held by some rank"
    return state, held, steps


CASES = [(layout, distributed) for layout in LAYOUTS for distributed in (False, True)]


@pytest.fixture(scope="module")
def results():
    per_rank = spawn_ranks(_run, 4, CASES)
    assert sorted(per_rank) == [0, 1, 2, 3]
    return per_rank


@pytest.mark.parametrize("layout,distributed", CASES, ids=[f"{c[0]}-{'zero1' if c[1] else 'plain'}" for c in CASES])
def test_expert_parallel_training_equals_one_process(results, layout, distributed):
    shards = results[0][(layout, distributed)]["shards"]
    weights, norms, ref_state = reference(shards)
    assert min(norms) > CLIP  # clipping scaled every step
    pieces = []
    for rank, by_case in results.items():
        r = by_case[(layout, distributed)]
        assert all(r["launched"]), f"rank {rank}: a bucket waited for the end of backward"
        assert r["own_buckets"], f"rank {rank}: a gradient is reduced over the wrong group"
        assert r["norms"] == pytest.approx(norms, rel=1e-12, abs=0)
        for k in NAMES:
            torch.testing.assert_close(r["weights"][k], weights[k], rtol=1e-12, atol=1e-13, msg=lambda m: f"{k}: {m}")
        pieces += r["pieces"]
    state, held, steps = _assemble(pieces, {k: v.shape for k, v in weights.items()})
    assert steps == {float(STEPS)}
    if distributed:  # sharded: one rank holds each element's state (per TP replica)
        tp = LAYOUTS[layout].get("tp", 1)
        for k in NAMES:
            assert (held[k] == (1 if EXPERT.get(k) is not None else tp)).all(), k
    for k in NAMES:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[k][key], ref_state[k][key], rtol=1e-11, atol=1e-15,
                                       msg=lambda m: f"{k} {key}: {m}")

