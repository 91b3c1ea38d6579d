"""Training-step throughput of our GPT against Hugging Face transformers at the same shapes.

    python benchmarks/vs_transformers.py [layers=2] [steps=9] [warmup=3] [batch=1] [seqs=512,1024] [dtypes=float32,bfloat16]
                                         [threads=N] [clock=cpu|wall]

One training step = forward, loss, backward and an AdamW step, on one process (this machine's
threads). Two pairs of models with the same shapes (gpt_125m-like width: hidden 768, 12 heads,
vocabulary 50257, a few layers so that it finishes in minutes on a small CPU):

- our GPT in GPT-2 form (learned positions, LayerNorm, tanh GELU, tied embeddings) against
  ``GPT2LMHeadModel``;
- our GPT in Llama form (RoPE, RMSNorm, SwiGLU with ffn 2048, untied head) against
  ``LlamaForCausalLM``.

bfloat16 casts both models' parameters to bfloat16 (the optimizer steps them in bfloat16), the
same treatment on both sides; both step with torch's fused AdamW (``adamw``). Steps of the two
models alternate, so that load from other processes hits both alike, timed by this process's CPU
time (``clock=cpu``, robust on a shared machine) or elapsed time (``clock=wall``), after
``warmup`` rounds. Prints tokens per second of that clock (median step) and ours / transformers:
the median over rounds of their step time over ours in the same round (``speedup``); asserts
nothing. Our side runs on a CPU, so it takes the CPU-only head and lookup (``parallel.host_memory``,
chosen by ``parallel.layers.kernels_for``). Measured grids: docs/hf_interop.md, docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from megatron_hydra.config.derive import padded_vocab_size
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel.state import ParallelState

HIDDEN, HEADS, VOCAB, LLAMA_FFN = 768, 12, 50257, 2048


def ours(flavour: str, layers: int, seq: int, dtype: torch.dtype) -> GPTModel:
    llama = flavour == "llama"
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=HEADS,
        kv_channels=HIDDEN // HEADS, ffn_hidden_size=LLAMA_FFN if llama else 4 * HIDDEN, seq_length=seq,
        max_position_embeddings=1024, vocab_size=VOCAB, padded_vocab_size=padded_vocab_size(VOCAB, 128, 1),
        position_embedding="rope" if llama else "learned", normalization="rmsnorm" if llama else "layernorm",
        activation="swiglu" if llama else "gelu_tanh", add_bias_linear=not llama, tie_embeddings=not llama,
        params_dtype=dtype,
    )
    model = GPTModel(cfg, ParallelState.single())
    init_weights(model, cfg, seed=0, tp_rank=0, tp_size=1)
    return model


def theirs(flavour: str, layers: int, dtype: torch.dtype):
    import transformers

    if flavour == "llama":
        cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=LLAMA_FFN, num_hidden_layers=layers,
                                       num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                                       max_position_embeddings=1024, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_embd=HIDDEN, n_layer=layers, n_head=HEADS, n_positions=1024, vocab_size=VOCAB,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    return model.to(dtype).train()


def adamw(model) -> torch.optim.Optimizer:
    """The same optimizer kernel for every model: torch's fused AdamW, which each side picks by
    default (ours: ``optim.impl=auto`` on CPU; transformers' Trainer: ``adamw_torch_fused``;
    Megatron-Core takes its fused Adam from Transformer Engine or apex, the fused kernels it was
    written for). torch's own CPU default, the per-tensor loop, would spend a quarter of the Llama
    form's step in the optimizer, alike on both sides, and blur the models' difference."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)


def step_fn(model, hf: bool, tokens: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    opt = adamw(model)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=labels).loss if hf else model(tokens, labels).mean()
        loss.backward()
        opt.step()

    return step


def timed(fns: Dict[str, Callable[[], None]], steps: int, warmup: int,
          clock: Callable[[], float]) -> Dict[str, List[float]]:
    """Seconds of each call of each function by ``clock``, per round: a round calls every function
    once, back to back, each round starting one function later than the last (so that none always
    runs right after the same other, which may leave the allocator's heap trimmed or the caches
    cold); ``warmup`` rounds first are not kept."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[name]
            start = clock()
            fn()
            if i >= warmup:
                times[name].append(clock() - start)
    return times


def speedup(times: Dict[str, List[float]], peer: str, ref: str = "ours") -> float:
    """The median over rounds of the peer's step time over ours in the same round. The machine's
    speed drifts between rounds on a shared host and hits both steps of a round alike, so pairing them within a round is steadier than a ratio of two medians."""
    return statistics.median(theirs / mine for theirs, mine in zip(times[peer], times[ref]))


def main(argv: List[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    layers, steps = int(args.get("layers", 2)), int(args.get("steps", 9))
    batch, warmup = int(args.get("batch", 1)), int(args.get("warmup", 3))
    if "threads" in args:
        torch.set_num_threads(int(args["threads"]))
    # cpu: this process's CPU seconds, which other processes' load on a shared machine barely
    # moves (wall-clock steps there vary widely); wall: elapsed time, for an idle machine.
    clock = time.process_time if args.get("clock", "cpu") == "cpu" else time.perf_counter
    seqs = [int(s) for s in args.get("seqs", "512,1024").split(",")]
    dtypes = args.get("dtypes", "float32,bfloat16").split(",")
    torch.manual_seed(0)
    print(f"clock={args.get('clock', 'cpu')} threads={torch.get_num_threads()} layers={layers} hidden={HIDDEN} heads={HEADS} vocab={VOCAB} "
          f"batch={batch} steps={steps} (median after {warmup} warm-up)")
    unit = "tok/cpu-s" if args.get("clock", "cpu") == "cpu" else "tok/s"
    print(f"{'model':<8}{'dtype':<10}{'seq':>6}{'ours ' + unit:>16}{'hf ' + unit:>16}{'ratio':>8}")
    for flavour in ("gpt2", "llama"):
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for seq in seqs:
                tokens = torch.randint(0, VOCAB, (batch, seq))
                # Our model predicts labels as given; transformers shifts its labels by one inside.
                labels = torch.roll(tokens, -1, dims=1)
                fns = {"ours": step_fn(ours(flavour, layers, seq, dtype), False, tokens, labels),
                       "hf": step_fn(theirs(flavour, layers, dtype), True, tokens, tokens)}
                t = timed(fns, steps, warmup, clock)
                ours_tps, hf_tps = (batch * seq / statistics.median(t[k]) for k in ("ours", "hf"))
                print(f"{flavour:<8}{dtype_name:<10}{seq:>6}{ours_tps:>16.0f}{hf_tps:>16.0f}{speedup(t, 'hf'):>8.2f}",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
