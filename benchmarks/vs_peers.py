"""Training-step throughput of our GPT against its peers, side by side, at the same shapes.

    pip install megatron-core        # optional peer (no CUDA extras needed here)
    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing   # optional peer, then
    pip install tyro torchdata einops triton                                           # what its import needs
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
- torchtitan's ``Llama3Model`` (Llama form only: torchtitan has no GPT-2 form), when
  ``torchtitan`` is installed, in its own eager form as its bare training loop runs it: fused QKV
  projection, complex-number RoPE, separate w1/w3 matmuls, and its ``cross_entropy_loss`` (fp32
  logits, summed, divided by the token count). Its language-model configs accept only flex or
  varlen attention, which need block masks built from document positions; the benchmark swaps
  in torchtitan's own ``ScaledDotProductAttention`` module (causal SDPA, the attention of every
  other side). It is installed without its dependency set: that pins a ``datasets`` which takes
  ``huggingface_hub`` below what transformers 5 needs. ``triton`` is needed only to import it
  (its MoE kernels); the dense model never calls it.
- Hugging Face transformers' ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (``vs_transformers``).

Prints tokens per CPU-second of each and our speedup over each; asserts nothing. The grids
measured so far, and what the lead rests on, are in docs/benchmarks.md. Our side runs on a CPU,
so it takes the CPU-only head and lookup (``parallel.host_memory``, chosen by
``parallel.layers.kernels_for``); an accelerator takes torch's own ``F.linear`` and ``F.embedding``.
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


def _torchtitan_llama3():
    """torchtitan's Llama 3 package; None if torchtitan is absent or fails to import (another
    version than 0.3.0, whose private builders this benchmark calls, may)."""
    try:
        import torchtitan.models.llama3 as llama3
    except Exception:
        return None
    return llama3


def torchtitan_llama(llama3, layers: int, seq: int, dtype: torch.dtype):
    """torchtitan's Llama3Model at the Llama form's shapes, with causal SDPA (module docstring)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    blocks = llama3._build_llama3_layers(
        n_layers=layers, dim=HIDDEN, n_heads=HEADS, hidden_dim=LLAMA_FFN, attn_backend="varlen",
        rope=ComplexRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=seq, theta=10000.0))
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = llama3.Llama3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB, layers=blocks,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB,
                              param_init=llama3._output_linear_init(HIDDEN)))
    model = cfg.build()
    model.init_states()
    for param in model.parameters():  # its rotary table stays complex (``Module.to`` would drop the imaginary part)
        param.data = param.data.to(dtype)
    return model.train()


def torchtitan_step(model, tokens: torch.Tensor, labels: torch.Tensor):
    from torchtitan.components.loss import cross_entropy_loss

    opt = adamw(model)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        (cross_entropy_loss(model(tokens), labels) / labels.numel()).backward()
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
    titan = _torchtitan_llama3()
    torch.manual_seed(0)
    peers = ["megatron_core"] * (mcore is not None) + ["torchtitan"] * (titan is not None) + ["transformers"]
    print(f"threads={torch.get_num_threads()} layers={layers} hidden={HIDDEN} heads={HEADS} vocab={VOCAB} batch=1 "
          f"steps={steps}; tokens per CPU-second of the median step after {warmup} warm-up rounds; "
          "ratio: median over rounds of the peer's step time over ours"
          + ("" if mcore else "; megatron-core not installed") + ("" if titan else "; torchtitan not installed"))
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
                if titan and flavour == "llama":
                    fns["torchtitan"] = torchtitan_step(torchtitan_llama(titan, layers, seq, dtype), tokens, labels)
                fns["transformers"] = step_fn(theirs(flavour, layers, dtype), True, tokens, tokens)
                t = timed(fns, steps, warmup, time.process_time)
                line = f"{flavour:<7}{dtype_name:<10}{seq:>5}{seq / statistics.median(t['ours']):>8.0f}"
                for peer in peers:
                    line += (f"{seq / statistics.median(t[peer]):>15.0f}{speedup(t, peer):>7.2f}" if peer in t
                             else f"{'-':>15}{'-':>7}")
                print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
