"""Bytes a rank moves over the tensor-parallel group in one training step, measured vs analytic.

    python benchmarks/tp_comm.py [hydra overrides, e.g. model=gpt_125m data.micro_batch_size=1]

For tp = 2 and 4, with and without sequence parallelism, tp gloo ranks run one micro-batch
(forward + backward) of the GPT model under ``collectives.count_comm()``; each component (embedding,
one block, LM head, cross entropy) is also run alone, so the whole is checked against the sum of
its named parts. The optimizer step's TP traffic (SP gradient all-reduce, grad-norm all-reduce) is
listed on its own. Prints, does not assert.

Two conventions, both per rank, e = bytes per element, N = b*s*h elements of one activation:

- *counted*: what ``count_comm`` records, the size of the tensor each rank hands to the collective
  (all-reduce: N; all-gather: its N/tp slice; reduce-scatter: the full N). Per layer and step:
    no SP  forward 2 all-reduce(N), backward 2 all-reduce(N)                     = 4 N e
    SP     forward 2 all-gather(N/tp) + 2 reduce-scatter(N), backward the same   = 4 N e (1 + 1/tp)
- *ring wire*: bytes a rank sends with ring algorithms: all-reduce 2(tp-1)/tp x input, all-gather
  (tp-1) x input, reduce-scatter (tp-1)/tp x input. Then one all-gather + one reduce-scatter of an
  activation cost exactly one all-reduce, and SP moves the same 8 N e (tp-1)/tp per layer as no SP.
Outside the layers: the embedding's all-reduce(N) forward (SP: reduce-scatter(N) forward,
all-gather(N/tp) backward); the LM head's all-reduce(N) backward (SP: all-gather(N/tp) forward,
reduce-scatter(N) backward); the vocab-parallel cross entropy's 3 all-reduces of b*s (max, target
logit, sum of exponentials) forward.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def transformer_config(tp: int, sp: bool, overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatron_hydra.config import derive, register_configs
    from megatron_hydra.config.machine import resolve

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "run_dir=unused", f"parallel.tensor_parallel_size={tp}", f"trainer.devices={tp}",
            f"parallel.sequence_parallel={str(sp).lower()}", *overrides])
    cfg = resolve(OmegaConf.to_object(cfg), visible_gpus=0)
    return derive(cfg).transformer, cfg.data.micro_batch_size


def analytic(cfg, b: int, tp: int) -> dict:
    """Counted bytes per (component, kind), from the shape alone."""
    e = torch.empty((), dtype=cfg.params_dtype).element_size()
    n = b * cfg.seq_length * cfg.hidden_size * e
    loss_e = max(e, 4)  # the cross entropy works in at least float32
    sp, L = cfg.sequence_parallel, cfg.num_layers
    if sp:
        rows = {("embedding", "reduce_scatter"): n, ("embedding", "all_gather"): n // tp,
                ("blocks", "all_gather"): L * 4 * n // tp, ("blocks", "reduce_scatter"): L * 4 * n,
                ("lm_head", "all_gather"): n // tp, ("lm_head", "reduce_scatter"): n}
    else:
        rows = {("embedding", "all_reduce"): n, ("blocks", "all_reduce"): L * 4 * n, ("lm_head", "all_reduce"): n}
    rows[("cross_entropy", "all_reduce")] = 3 * b * cfg.seq_length * loss_e
    if sp:
        norm = cfg.hidden_size * (2 if cfg.normalization == "layernorm" else 1)
        sp_params = (2 * L + 1) * norm + (2 * L * cfg.hidden_size if cfg.add_bias_linear else 0)
        if cfg.position_embedding == "learned":
            sp_params += cfg.max_position_embeddings * cfg.hidden_size
        rows[("optimizer: SP grads", "all_reduce")] = sp_params * e
    rows[("optimizer: grad norm", "all_reduce")] = e
    return rows


def wire(kind: str, nbytes: float, tp: int) -> float:
    """Ring-algorithm bytes a rank sends for a collective whose per-rank input is ``nbytes``."""
    return {"all_reduce": 2 * (tp - 1) / tp, "all_gather": tp - 1, "reduce_scatter": (tp - 1) / tp}[kind] * nbytes


def _measure(rank: int, tp: int, port: int, overrides, sp: bool, queue) -> None:
    import torch.distributed as dist

    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_hydra.parallel.data_parallel import allreduce_sequence_parallel_grads
    from megatron_hydra.parallel.grad_clip import clip_grad_norm
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    cfg, b = transformer_config(tp, sp, overrides)
    ps = ParallelState.build(tp=tp)
    model = GPTModel(cfg, ps)
    init_weights(model, cfg, 1234, ps.tp_rank, tp)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=gen)
    measured = {}

    def count(component, fn):
        with C.count_comm() as c:
            out = fn()
        for kind, nbytes in c.bytes.items():
            measured[(component, kind)] = measured.get((component, kind), 0) + nbytes
        return out

    # Each part alone, backward fed a random upstream gradient (the collectives don't depend on it).
    x = count("embedding", lambda: model.embed(tokens))
    count("embedding", lambda: x.backward(torch.randn_like(x)))
    for block in model.layers.values():
        h = x.detach().requires_grad_()
        y = count("blocks", lambda: block(h))
        count("blocks", lambda: y.backward(torch.randn_like(y)))
    h = x.detach().requires_grad_()
    logits = count("lm_head", lambda: model.head(h))
    loss = count("cross_entropy", lambda: vocab_parallel_cross_entropy(logits, labels, ps.tp_group).mean())
    count("lm_head", loss.backward)  # the cross entropy's backward communicates nothing

    # The whole model at once, then the optimizer step's TP traffic.
    model.zero_grad()
    with C.count_comm() as whole:
        model(tokens, labels).mean().backward()
    params = list(model.parameters())
    count("optimizer: SP grads", lambda: allreduce_sequence_parallel_grads(params, ps.tp_group))
    count("optimizer: grad norm", lambda: clip_grad_norm(params, 1.0, ps))
    if rank == 0:
        queue.put((measured, dict(whole.bytes), cfg, b))
    dist.destroy_process_group()


def run(tp: int, sp: bool, overrides):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_measure, args=(tp, port, overrides, sp, queue), nprocs=tp, start_method="spawn")
    return queue.get()


def report(tp: int, sp: bool, overrides) -> None:
    measured, whole, cfg, b = run(tp, sp, overrides)
    expected = analytic(cfg, b, tp)
    print(f"\ntp={tp} sequence_parallel={sp}: b={b} s={cfg.seq_length} h={cfg.hidden_size} layers={cfg.num_layers} "
          f"{str(cfg.params_dtype).replace('torch.', '')}; counted bytes per rank (input of each collective)")
    print(f"  {'component':<22}{'collective':<16}{'measured':>14}{'analytic':>14}{'ratio':>8}")
    for key in sorted(set(measured) | set(expected), key=lambda k: list(expected).index(k) if k in expected else 99):
        m, a = measured.get(key, 0), expected.get(key, 0)
        ratio = f"{m / a:.4f}" if a else "-"
        print(f"  {key[0]:<22}{key[1]:<16}{m:>14,}{a:>14,}{ratio:>8}")
    step = [k for k in expected if not k[0].startswith("optimizer")]
    parts_total = sum(measured.get(k, 0) for k in set(measured) if not k[0].startswith("optimizer"))
    analytic_total = sum(expected[k] for k in step)
    whole_total = sum(whole.values())
    print(f"  {'forward+backward':<38}{whole_total:>14,}{analytic_total:>14,}{whole_total / analytic_total:>8.4f}"
          f"   (whole model in one pass; sum of the parts above: {parts_total:,})")
    wire_measured = sum(wire(kind, nbytes, tp) for kind, nbytes in whole.items())
    wire_analytic = sum(wire(key[1], expected[key], tp) for key in step)
    e = torch.empty((), dtype=cfg.params_dtype).element_size()
    n = b * cfg.seq_length * cfg.hidden_size * e
    per_layer = 4 * wire("all_reduce", n, tp)  # 2 all-reduces of N each way, whether or not SP
    print(f"  {'ring wire bytes fwd+bwd':<38}{wire_measured:>14,.0f}{wire_analytic:>14,.0f}"
          f"{wire_measured / wire_analytic:>8.4f}   (per layer: 8 N e (tp-1)/tp = {per_layer:,.0f} with or without SP)")


def main(argv) -> None:
    for tp in (2, 4):
        for sp in (False, True):
            report(tp, sp, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
