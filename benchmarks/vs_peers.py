"""Training-step throughput of our GPT against its peers, side by side, at the same shapes.

    pip install megatron-core        # optional peer (no CUDA extras needed here)
    python benchmarks/vs_peers.py [layers=2] [steps=9] [warmup=3] [seqs=512,1024] [dtypes=float32,bfloat16] [threads=N]

The shapes, the training step (forward, loss, backward, AdamW) and the timing are
``vs_transformers.py``'s (torch's fused AdamW on every side, hidden 768, 12 heads, vocabulary
50257; this process's CPU time, the steps of all models interleaved round by round after
``warmup`` rounds; tokens per CPU-second of the median step, and our speedup as the median over
rounds of the peer's step time over ours in the same round). Peers, each in the
GPT-2 form (learned positions, LayerNorm, GELU, tied embeddings) and the Llama form (RoPE,
RMSNorm, SwiGLU with ffn 2048, untied head):

- Megatron-Core's ``GPTModel`` with its local (non-Transformer-Engine) layer spec, when
  ``megatron-core`` is installed. It runs on one gloo process with model parallelism 1. Four
  CUDA-only calls are replaced, here and only here: ``torch.cuda.current_device`` (its attention
  scratch buffer is allocated there) answers ``"cpu"``; its default causal mask is built on the
  CPU; its CUDA RNG tracker's ``fork`` around attention dropout is a no-op (dropout is off); its
  CUDA seeding is skipped. Its attention is the unfused softmax path of the local spec.
- Hugging Face transformers' ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (``vs_transformers``).

Prints tokens per CPU-second of each and our speedup over each; asserts nothing. Measured on a
2-core AVX2 CPU of a shared host (2 threads, the defaults: 9 rounds after 3; our speedup over
Megatron-Core / over transformers):

    fp32 GPT-2  s=512  1.10 / 1.19   s=1024  1.29 / 1.22
    bf16 GPT-2  s=512  1.06 / 1.19   s=1024  1.17 / 1.22
    fp32 Llama  s=512  1.14 / 1.21   s=1024  1.28 / 1.17
    bf16 Llama  s=512  1.04 / 1.15   s=1024  1.14 / 1.26

1.1x or more against both peers in all cells but bf16 at seq 512, where the lead over
Megatron-Core is 4-6%: there half of a step is the LM head's three matmuls, the same kernels on
every side. A
single step's time moves by up to 1.5x on such a host, and a cell by 0.05-0.1 between runs.
What the lead rests on, besides fused attention: the cross entropy allocates no [tokens x vocab]
tensor but the gradient of 16-bit logits, and with tied embeddings the two gradients of the table are summed in place
(the head runs vocabulary-major), so a step faults in fewer fresh pages (docs/hf_interop.md):
100k against Megatron-Core's 124k in fp32 GPT-2 at seq 512, 63k against 104k in bf16. torchtitan is not in
the table: its 0.3.0 wheel imports ``spmd_types``, which no index this project installs from
provides.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from typing import List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_transformers import HEADS, HIDDEN, LLAMA_FFN, VOCAB, adamw, ours, speedup, step_fn, theirs, timed  # noqa: E402


def _megatron_core_on_cpu():
    """Import Megatron-Core with its CUDA-only calls replaced (module docstring); None if absent."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return None
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core import parallel_state

    @functools.lru_cache(maxsize=None)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    class _NoFork:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    transformer_utils.get_default_causal_mask = causal_mask
    if hasattr(fused_softmax, "get_default_causal_mask"):
        fused_softmax.get_default_causal_mask = causal_mask
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: _NoFork()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    return megatron.core


def megatron_core(flavour: str, layers: int, seq: int, dtype: torch.dtype):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = flavour == "llama"
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        ffn_hidden_size=LLAMA_FFN if llama else 4 * HIDDEN, normalization="RMSNorm" if llama else "LayerNorm",
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu, add_bias_linear=not llama,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=cfg.normalization), vocab_size=VOCAB,
                     max_sequence_length=1024, position_embedding_type="rope" if llama else "learned_absolute",
                     share_embeddings_and_output_weights=not llama)
    return model.to(dtype).train()


def megatron_step(model, tokens: torch.Tensor, labels: torch.Tensor):
    opt = adamw(model)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(tokens, positions, None, labels=labels).mean().backward()  # per-token losses [b, s]
        opt.step()

    return step


def main(argv: List[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    layers, steps, warmup = int(args.get("layers", 2)), int(args.get("steps", 9)), int(args.get("warmup", 3))
    if "threads" in args:
        torch.set_num_threads(int(args["threads"]))
    seqs = [int(s) for s in args.get("seqs", "512,1024").split(",")]
    dtypes = args.get("dtypes", "float32,bfloat16").split(",")
    mcore = _megatron_core_on_cpu()
    torch.manual_seed(0)
    peers = ["megatron_core"] * (mcore is not None) + ["transformers"]
    print(f"threads={torch.get_num_threads()} layers={layers} hidden={HIDDEN} heads={HEADS} vocab={VOCAB} batch=1 "
          f"steps={steps}; tokens per CPU-second of the median step after {warmup} warm-up rounds; "
          "ratio: median over rounds of the peer's step time over ours"
          + ("" if mcore else "; megatron-core not installed"))
    print(f"{'model':<7}{'dtype':<10}{'seq':>5}{'ours':>8}" + "".join(f"{p:>15}{'ratio':>7}" for p in peers))
    for flavour in ("gpt2", "llama"):
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for seq in seqs:
                tokens = torch.randint(0, VOCAB, (1, seq))
                labels = torch.roll(tokens, -1, dims=1)  # next tokens; transformers shifts its own
                fns = {"ours": step_fn(ours(flavour, layers, seq, dtype), False, tokens, labels)}
                if mcore is not None:
                    fns["megatron_core"] = megatron_step(megatron_core(flavour, layers, seq, dtype), tokens, labels)
                fns["transformers"] = step_fn(theirs(flavour, layers, dtype), True, tokens, tokens)
                t = timed(fns, steps, warmup, time.process_time)
                line = f"{flavour:<7}{dtype_name:<10}{seq:>5}{seq / statistics.median(t['ours']):>8.0f}"
                for peer in peers:
                    line += f"{seq / statistics.median(t[peer]):>15.0f}{speedup(t, peer):>7.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
