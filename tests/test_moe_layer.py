"""The Mixture-of-Experts layer (``models.moe``) against a dense per-token reference.

- Router alone: the top-k choice and weights equal a per-token reference written with Python
  sorting (softmax; sigmoid with a selection bias that changes the choice, never the weights;
  ``norm_topk`` off); the load-balancing and z losses equal their formulas computed here from the
  routing; ``aux_loss_scale`` scales exactly the aux loss's part of the gradient.
- The expert-bias rule on a hand-computed example (loads 5, 1, 3, 3: the bias moves -r, +r, 0, 0).
- Initialisation: every expert slice, at any (ep, tp) and ep/tp rank, is its logical tensor's
  (``models.init.logical_tensor`` under the name ``expert_parameter_name`` gives), so every layout
  holds the same experts; expert and shared fc2 get the residual-projection std.
- The whole layer (router -> dispatch -> experts -> combine) equals, in float64 to 1e-12, a
  reference that loops over tokens: ``sum_j w_j * expert_{e_j}(x) (+ shared(x))`` with its own
  routing, capacity dropping (per expert, highest weight first, ties by token) and losses, run by
  every rank on the whole batch (one micro-batch per data-parallel rank). Forward output, the input
  gradient and every parameter's gradient of ``output . dout + aux + z``, on 1, 2 and 4 gloo ranks:
  ep 1/2/4, ep2 over dp4 (two ranks hold each expert), tp2 with and without sequence parallelism,
  ep2 x tp2, shared experts, biases, capacity dropping. Gradients are reduced as their tags say
  (``sequence_parallel``: summed over TP; expert params over the expert data-parallel group, the
  rest over dp) and compared with the reference's slice (expert range, TP shard). The stored
  aux/z values and tokens per expert are the micro-batch's; the expert-bias update summed over the
  ranks holding the layer equals the rule applied to the reference's loads; the CommCounter sees
  the layer's five expert-parallel exchanges (``ep_a2a``) per forward and backward.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from conftest import StubGroup, spawn_ranks, stub_groups
from megatron_hydra.config.transformer_config import MoESpec, TransformerConfig
from megatron_hydra.models import init
from megatron_hydra.models.moe import MoELayer, Router, expert_parameter_name, local_experts, router_losses
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.state import ParallelState


E, H, FFN, SHARED, B, S = 8, 8, 12, 6, 2, 8
SEED, TOL, RATE = 11, 1e-12, 0.01
F64 = torch.float64
BIAS = torch.linspace(-0.3, 0.3, E)  # a selection bias that changes some choices
ACT = {"swiglu": F.silu, "gelu": F.gelu, "relu": F.relu}


def tcfg() -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_query_groups=1, kv_channels=H,
                             ffn_hidden_size=FFN, seq_length=S, max_position_embeddings=S, vocab_size=8,
                             padded_vocab_size=8, init_std=0.3, params_dtype=F64)


def _rel(ours, ref) -> float:
    ours, ref = ours.detach(), ref.detach()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


# The reference: one token at a time ---------------------------------------------------------------
def ref_route(x, w_router, spec, bias):
    """(chosen experts, their weights, probs, logits) of one token, by Python sorting."""
    logits = w_router @ x
    scores = logits.softmax(-1) if spec.router == "softmax" else logits.sigmoid()
    select = [scores[e].item() + float(bias[e]) for e in range(E)]
    chosen = sorted(range(E), key=lambda e: -select[e])[:spec.top_k]
    weights = [scores[e] for e in chosen]
    if spec.norm_topk:
        weights = [w / sum(weights) for w in weights]
    probs = scores if spec.router == "softmax" else scores / scores.sum()
    return chosen, weights, probs, logits


def ref_mlp(x, P, prefix, activation):
    def lin(part, v):
        return P[f"{prefix}.{part}.weight"] @ v + P.get(f"{prefix}.{part}.bias", 0)

    h = lin("fc1", x)
    h = ACT[activation](lin("gate", x)) * h if activation == "swiglu" else ACT[activation](h)
    return lin("fc2", h)


def reference_params(spec, activation, bias, cfg):
    shapes = {"mlp.router.weight": (E, H)}
    experts = [(f"mlp.experts.{e}", FFN) for e in range(E)]
    if spec.shared_ffn_hidden_size:
        experts.append(("mlp.shared", SHARED))
    for prefix, f in experts:
        parts = ("fc1", "gate", "fc2") if activation == "swiglu" else ("fc1", "fc2")
        for part in parts:
            shapes[f"{prefix}.{part}.weight"] = (H, f) if part == "fc2" else (f, H)
            if bias:
                shapes[f"{prefix}.{part}.bias"] = (H,) if part == "fc2" else (f,)
    return {n: init.logical_tensor(n, s, cfg, SEED, F64).requires_grad_() for n, s in shapes.items()}


def reference_microbatch(X, P, spec, activation, bias):
    """Output [b, s, h], aux, z, routed counts [E] and dropped assignments of one micro-batch."""
    tokens = X.reshape(-1, H)
    T, k = tokens.shape[0], spec.top_k
    routes = [ref_route(t, P["mlp.router.weight"], spec, bias) for t in tokens]
    keep = {(t, j) for t in range(T) for j in range(k)}
    if spec.capacity_factor is not None:
        cap = math.ceil(spec.capacity_factor * T * k / E)
        for e in range(E):
            mine = sorted(((-routes[t][1][j].item(), t, j) for t in range(T) for j in range(k) if routes[t][0][j] == e))
            keep -= {(t, j) for _, t, j in mine[cap:]}
    outs = []
    for t in range(T):
        chosen, weights, _, _ = routes[t]
        out = sum((weights[j] * ref_mlp(tokens[t], P, f"mlp.experts.{chosen[j]}", activation)
                   for j in range(k) if (t, j) in keep), torch.zeros(H, dtype=F64))
        if spec.shared_ffn_hidden_size:
            out = out + ref_mlp(tokens[t], P, "mlp.shared", activation)
        outs.append(out)
    counts = torch.tensor([sum(r[0].count(e) for r in routes) for e in range(E)], dtype=F64)
    prob_mean = torch.stack([r[2] for r in routes]).mean(0)
    aux = spec.aux_loss_coeff * E * (counts / (T * k) * prob_mean).sum()
    z = spec.z_loss_coeff * torch.stack([r[3].logsumexp(-1) ** 2 for r in routes]).mean()
    return torch.stack(outs).view(X.shape), aux, z, counts, T * k - len(keep)


# One case of the whole layer on this rank ---------------------------------------------------------
def _spec(case) -> MoESpec:
    return MoESpec(num_experts=E, ffn_hidden_size=FFN, top_k=2, router=case.get("router", "softmax"),
                   aux_loss_coeff=0.01 if case.get("aux") else 0.0, z_loss_coeff=0.002 if case.get("aux") else 0.0,
                   capacity_factor=case.get("capacity"), shared_ffn_hidden_size=SHARED if case.get("shared") else 0,
                   expert_bias_rate=RATE if case.get("router") == "sigmoid" else 0.0)


def run_case(case, ps: ParallelState) -> dict:
    """Errors of this rank's output, gradients, stored losses and bias update against the reference."""
    from torch import nn

    spec, act, sp, bias = _spec(case), case["act"], case.get("sp", False), case.get("bias", False)
    holder = nn.Module()
    holder.mlp = MoELayer(spec, H, act, ps, F64, sp, bias=bias)
    init.init_weights(holder, tcfg(), SEED, ps.tp_rank, ps.tp_size)
    expert_bias = BIAS if spec.router == "sigmoid" else torch.zeros(E)
    if spec.router == "sigmoid":
        holder.mlp.router.expert_bias.copy_(BIAS)
    gen = torch.Generator().manual_seed(5)
    dp = ps.dp_size
    X, dout = torch.randn(2, dp, B, S, H, generator=gen, dtype=F64)

    P = reference_params(spec, act, bias, tcfg())
    Xr = X.clone().requires_grad_()
    refs = [reference_microbatch(Xr[d], P, spec, act, expert_bias) for d in range(dp)]
    sum((out * dout[d]).sum() + aux + z for d, (out, aux, z, _, _) in enumerate(refs)).backward()

    d, r, tp = ps.dp_rank, ps.tp_rank, ps.tp_size

    def seq(t):
        return t.chunk(tp, 1)[r] if sp else t

    x = seq(X[d]).clone().requires_grad_()
    with C.count_comm() as comm:
        y = holder.mlp(x)
        (y * seq(dout[d])).sum().backward()
    out_ref, aux_ref, z_ref, counts_ref, dropped_ref = refs[d]
    mlp = holder.mlp
    errors = {"out": _rel(y, seq(out_ref.detach())), "x_grad": _rel(x.grad, seq(Xr.grad[d])),
              "aux": abs(float(mlp.aux_loss) - aux_ref.item()), "z": abs(float(mlp.z_loss) - z_ref.item()),
              "tokens_per_expert": _rel(mlp.tokens_per_expert.double(), counts_ref)}
    for name, p in holder.named_parameters():
        expert = getattr(p, "expert_parallel", False)
        g = p.grad.clone()
        if p.sequence_parallel:
            C.all_reduce(g, ps.tp_group)
        C.all_reduce(g, ps.expert_dp_group if expert and ps.expert_dp_group is not None else ps.group("dp"))
        pieces = local_experts(name, p) if expert else [(name, p.detach(), p.tp_partition_dim)]
        for i, (logical, value, dim) in enumerate(pieces):
            ref_value = P[logical].detach()
            ref_grad = torch.zeros_like(ref_value) if P[logical].grad is None else P[logical].grad  # an idle expert
            if dim is not None:
                ref_value, ref_grad = ref_value.chunk(tp, dim)[r], ref_grad.chunk(tp, dim)[r]
            errors[f"value {logical}"] = _rel(value, ref_value)
            errors[f"grad {logical}"] = _rel(g[i] if expert else g, ref_grad)
    # Counts, tokens there and back in forward; the two token exchanges reversed in backward.
    errors["ep_a2a calls"] = float(comm.calls["ep_a2a"] != (5 if ps.ep > 1 else 0))
    if spec.capacity_factor is not None:  # the case drops something, and the same number
        errors["dropped"] = float(dropped_ref == 0 or mlp.dropped != dropped_ref)
    if spec.expert_bias_rate:
        mlp.update_expert_bias(ps.group("amax") if ps.groups else None)
        load = sum(c for _, _, _, c, _ in refs)
        expected = BIAS + RATE * torch.sign(load.mean() - load).float()
        errors["expert_bias"] = _rel(mlp.router.expert_bias, expected)
    return errors


CASES = {
    1: [dict(name="ep1-softmax-swiglu-aux", act="swiglu", aux=True),
        dict(name="ep1-sigmoid-gelu-capacity-shared-bias", act="gelu", router="sigmoid", capacity=1.0, shared=True,
             bias=True, aux=True)],
    2: [dict(name="ep2-softmax-swiglu-aux", ep=2, act="swiglu", aux=True),
        dict(name="ep2-sigmoid-relu-capacity-shared", ep=2, act="relu", router="sigmoid", capacity=1.0, shared=True),
        dict(name="tp2-softmax-swiglu-bias-aux", tp=2, act="swiglu", bias=True, aux=True),
        dict(name="tp2-sp-sigmoid-gelu-shared-aux", tp=2, sp=True, act="gelu", router="sigmoid", shared=True,
             aux=True),
        dict(name="tp2-whole-experts-softmax-swiglu-bias-aux", tp=2, etp=1, act="swiglu", bias=True, aux=True)],
    4: [dict(name="ep4-softmax-gelu-aux", ep=4, act="gelu", aux=True),
        dict(name="ep2-dp4-swiglu-capacity-aux", ep=2, act="swiglu", capacity=1.0, aux=True),
        dict(name="ep2-tp2-sp-sigmoid-swiglu-shared-capacity-bias-aux", ep=2, tp=2, sp=True, act="swiglu",
             router="sigmoid", shared=True, capacity=1.0, bias=True, aux=True),
        dict(name="ep2-tp2-softmax-gelu-bias", ep=2, tp=2, act="gelu", bias=True),
        # (no capacity: with whole experts each TP rank drops from its own slice, the reference from all)
        dict(name="ep2-tp2-sp-whole-experts-sigmoid-swiglu-shared-bias", ep=2, tp=2, etp=1, sp=True,
             act="swiglu", router="sigmoid", shared=True, bias=True, aux=True),
        dict(name="ep4-over-dp2-tp2-whole-experts-softmax-gelu-aux", ep=4, tp=2, etp=1, act="gelu", aux=True)],
}


def _worker(rank: int, world: int):
    torch.set_num_threads(1)
    results = {}
    for case in CASES[world]:
        tp = case.get("tp", 1)
        ps = ParallelState.build(tp=tp, dp=world // tp, ep=case.get("ep", 1), etp=case.get("etp"))
        results[case["name"]] = run_case(case, ps)
    return results


def _check(results: dict) -> None:
    for case, errors in results.items():
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"{case}: {bad}"


def test_layer_equals_the_per_token_reference_on_one_rank():
    _check({case["name"]: run_case(case, ParallelState.single()) for case in CASES[1]})


@pytest.mark.parametrize("world", [2, 4])
def test_layer_equals_the_per_token_reference_over_ranks(world):
    results = spawn_ranks(_worker, world)
    assert sorted(results) == list(range(world))
    for rank, per_rank in results.items():
        _check({f"rank {rank} {case}": errors for case, errors in per_rank.items()})


# The router alone -----------------------------------------------------------------------------------
def _router(**kw):
    spec = MoESpec(num_experts=E, ffn_hidden_size=FFN, **kw)
    router = Router(spec, H, F64)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(3))
    return spec, router


def test_router_choice_and_weights():
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(4), dtype=F64)
    for kw, bias in ((dict(top_k=2), None), (dict(top_k=3, norm_topk=False), None),
                     (dict(router="sigmoid", top_k=2), None), (dict(router="sigmoid", top_k=2), BIAS)):
        spec, router = _router(**kw)
        if bias is not None:
            router.expert_bias.copy_(bias)
        routing = router(x)
        for t in range(x.shape[0]):
            chosen, weights, probs, _ = ref_route(x[t], router.weight.detach(), spec,
                                                  torch.zeros(E) if bias is None else bias)
            assert routing.indices[t].tolist() == chosen
            assert _rel(routing.weights[t], torch.stack(weights)) < TOL
            assert _rel(routing.probs[t], probs) < TOL
    # The bias changed some choices (the last router above), but weights are the unbiased scores.
    unbiased = _router(router="sigmoid", top_k=2)[1](x)
    assert not torch.equal(routing.indices, unbiased.indices)
    scores = (x @ router.weight.detach().T).sigmoid().gather(-1, routing.indices)
    assert _rel(routing.weights, scores / scores.sum(-1, keepdim=True)) < TOL


def test_router_losses_equal_their_formulas():
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(6), dtype=F64)
    for router_kind in ("softmax", "sigmoid"):
        spec, router = _router(router=router_kind, top_k=2, aux_loss_coeff=0.03, z_loss_coeff=0.005)
        routing = router(x)
        loss, stats = router_losses(routing, spec)
        logits = x @ router.weight.detach().T
        f = torch.stack([(routing.indices == e).sum() for e in range(E)]).double() / (20 * 2)
        scores = logits.softmax(-1) if router_kind == "softmax" else logits.sigmoid()
        p = scores / scores.sum(-1, keepdim=True)
        aux = 0.03 * E * (f * p.mean(0)).sum()
        z = 0.005 * (logits.logsumexp(-1) ** 2).mean()
        assert abs(loss.item() - (aux + z).item()) < TOL
        assert abs(float(stats.aux_loss) - float(aux)) < TOL and abs(float(stats.z_loss) - float(z)) < TOL
        assert stats.tokens_per_expert.tolist() == (f * 40).long().tolist()


def test_aux_loss_scale_scales_only_the_aux_gradient():
    x = torch.randn(1, 16, H, generator=torch.Generator().manual_seed(8), dtype=F64)
    grads = {}
    for label, coeff, scale in (("none", 0.0, 1.0), ("one", 0.5, 1.0), ("three", 0.5, 3.0)):
        spec = MoESpec(num_experts=E, ffn_hidden_size=FFN, aux_loss_coeff=coeff, z_loss_coeff=coeff)
        layer = MoELayer(spec, H, "gelu", ParallelState.single(), F64)
        init.init_weights(layer, tcfg(), SEED, 0, 1)
        layer.aux_loss_scale = scale
        layer(x).sum().backward()
        grads[label] = layer.router.weight.grad
    assert _rel(grads["three"] - grads["none"], 3 * (grads["one"] - grads["none"])) < 1e-10
    assert (grads["one"] - grads["none"]).abs().max() > 1e-3


def test_expert_bias_update_by_hand():
    """Top-1 sigmoid routing made to pick experts 0,0,0,0,0,1,2,2,2,3,3,3 (a router weight of 10 x
    the identity and one-hot tokens): loads 5,1,3,3, mean 3, so the bias moves -r, +r, 0, 0; eval
    forwards are not counted; the count restarts after an update."""
    spec = MoESpec(num_experts=4, ffn_hidden_size=4, top_k=1, router="sigmoid", expert_bias_rate=0.25)
    layer = MoELayer(spec, 4, "relu", ParallelState.single(), F64)
    init.init_weights(layer, tcfg(), SEED, 0, 1)
    with torch.no_grad():
        layer.router.weight.copy_(10 * torch.eye(4))
    picks = [0, 0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 3]
    x = F.one_hot(torch.tensor(picks), 4).to(F64).view(1, 12, 4)
    layer(x)
    layer.eval()
    layer(x)
    layer.update_expert_bias()
    assert layer.router.expert_bias.tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert layer.tokens_per_expert.tolist() == [5, 1, 3, 3]
    layer.update_expert_bias()  # nothing counted since: every expert at the mean (0)
    assert layer.router.expert_bias.tolist() == [-0.25, 0.25, 0.0, 0.0]


# Initialisation and names ---------------------------------------------------------------------------


def test_logical_names():
    assert expert_parameter_name("layers.3.mlp.experts.fc1", 5) == "layers.3.mlp.experts.5.fc1.weight"
    assert expert_parameter_name("layers.3.mlp.experts.gate", 0) == "layers.3.mlp.experts.0.gate.weight"
    assert expert_parameter_name("dec.layers.0.mlp.experts.fc2_bias", 7) == "dec.layers.0.mlp.experts.7.fc2.bias"


def test_every_expert_layout_initialises_the_same_experts():
    """Built on meta and materialised at (ep, tp) = (1, 1), (2, 2), (4, 1), (1, 2), every rank's
    slices equal the logical tensors; the router and the biases follow the usual rules."""
    from torch import nn

    cfg = tcfg()
    spec = MoESpec(num_experts=E, ffn_hidden_size=FFN, router="sigmoid", shared_ffn_hidden_size=SHARED)
    logical = {"fc1": (FFN, H), "gate": (FFN, H), "fc2": (H, FFN),
               "fc1_bias": (FFN,), "gate_bias": (FFN,), "fc2_bias": (H,)}
    seen = set()
    for ep, tp in ((1, 1), (2, 2), (4, 1), (1, 2)):
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                ps = ParallelState(sizes={"pp": 1, "dp": ep, "cp": 1, "tp": tp}, rank=ep_rank * tp + tp_rank,
                                   groups={"tp": StubGroup(tp, tp_rank), "ep": StubGroup(ep, ep_rank)}, ep=ep)
                holder = nn.Module()
                with stub_groups():
                    holder.mlp = MoELayer(spec, H, "swiglu", ps, F64, device="meta", bias=True)
                init.materialize(holder, cfg, SEED, tp_rank, tp, "cpu")
                assert holder.mlp.router.expert_bias.tolist() == [0.0] * E
                for name, p in holder.mlp.experts.named_parameters():
                    for logical_name, value, dim in local_experts(f"mlp.experts.{name}", p):
                        full = init.logical_tensor(logical_name, logical[name], cfg, SEED, F64)
                        assert torch.equal(value, full if dim is None else full.chunk(tp, dim)[tp_rank])
                        seen.add(logical_name)
    assert len(seen) == E * len(logical)
    assert init._rule("mlp.experts.3.fc2.weight", cfg) == init._rule("mlp.shared.fc2.weight", cfg) == \
        ("normal", cfg.output_init_std)
    assert init._rule("mlp.router.weight", cfg) == init._rule("mlp.experts.3.fc1.weight", cfg) == \
        ("normal", cfg.init_std)
    assert init._rule("mlp.experts.3.fc2.bias", cfg)[0] == "zero"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run scripts/gpu_check.sh on a GPU")
def test_grouped_gemm_equals_the_loop_on_cuda():
    """bf16 on CUDA takes torch's grouped GEMM: output and grads equal the per-expert loop's to
    bf16's precision, with an expert that gets no token."""
    from megatron_hydra.models import moe

    experts = moe.Experts(4, 0, 4, 64, 128, "swiglu", bias=True, dtype=torch.bfloat16, device="cuda")
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    counts = [10, 0, 25, 5]
    assert moe._grouped(x, experts.fc1, experts.fc2)
    results = []
    for grouped in (True, False):
        with mock.patch.object(moe, "GROUPED_MM", grouped):
            xi = x.clone().requires_grad_()
            y = experts(xi, counts)
            y.float().square().sum().backward()
            results.append([y.float(), xi.grad.float()] + [p.grad.float() for p in experts.parameters()])
            experts.zero_grad()
    for a, b in zip(*results):
        assert _rel(a, b) < 2e-2
