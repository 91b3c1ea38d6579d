"""Document-masked attention on CPU: which kernel, and what the mask costs against plain causal.

    python benchmarks/document_attention.py

``data.reset_attention_mask`` restricts each token to the earlier tokens of its own document
(block-diagonal causal). Two ways to run that through torch:

- SDPA with a mask: ``F.scaled_dot_product_attention(attn_mask=...)``, boolean (True = attend)
  or additive float (0 / -inf), built from the document ids ([b, 1, s, s]);
- FlexAttention (``torch.nn.attention.flex_attention``) with a block mask from a ``mask_mod``,
  which skips the blocks that are masked out entirely.

Each is timed at sequence 2048 (one sequence, 8 heads of 64, fp32, 4 documents of random length)
against plain causal SDPA (``is_causal=True``) in the same run: forward + backward, and forward
alone. The mask build (from the document ids) is counted in the masked variants. FlexAttention
has no CPU backward, so it is timed forward only (and marked n/a where it fails). Prints ratios,
asserts nothing.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

B, H, S, D, DOCS, REPEATS = 1, 8, 2048, 64, 4, 5


def document_ids(seed: int = 0) -> torch.Tensor:
    """[B, S] ids 0, 0, ..., 1, 1, ...: DOCS documents with random boundaries."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(S - 1, generator=gen)[: DOCS - 1] + 1
    starts = torch.zeros(S, dtype=torch.long)
    starts[cuts] = 1
    return starts.cumsum(0).expand(B, S)


def bool_mask(ids: torch.Tensor) -> torch.Tensor:
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal).unsqueeze(1)


def additive_mask(ids: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros((), dtype=dtype).masked_fill(~bool_mask(ids), float("-inf"))


def timed(fn, backward: bool) -> float:
    """Median seconds of ``fn`` (forward, plus backward when ``backward``) over REPEATS runs."""
    times = []
    for i in range(REPEATS + 1):
        q, k, v = (torch.randn(B, H, S, D, requires_grad=backward) for _ in range(3))
        start = time.perf_counter()
        out = fn(q, k, v)
        if backward:
            out.sum().backward()
        if i:  # the first run warms up
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    ids = document_ids()
    variants = {
        "causal SDPA (is_causal)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "SDPA, boolean document mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask(ids)),
        "SDPA, additive document mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=additive_mask(ids, q.dtype)),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def flex(q, k, v):
            doc = ids

            def mod(b, h, qi, ki):
                return (qi >= ki) & (doc[b, qi] == doc[b, ki])
            return flex_attention(q, k, v, block_mask=create_block_mask(mod, B, None, S, S, device="cpu"))
        variants["FlexAttention, document block mask"] = flex
    except ImportError:
        pass
    print(f"seq {S}, batch {B}, {H} heads x {D}, fp32, {DOCS} documents, {torch.get_num_threads()} threads; "
          f"median of {REPEATS}; ratio = time / causal SDPA's")
    base = {}
    for name, fn in variants.items():
        cells = []
        for backward in (True, False):
            try:
                t = timed(fn, backward)
            except Exception as e:  # noqa: BLE001 (e.g. FlexAttention: no backward on CPU)
                cells.append(f"{'fwd+bwd' if backward else 'fwd'} n/a ({type(e).__name__})")
                continue
            base.setdefault(backward, t)
            cells.append(f"{'fwd+bwd' if backward else 'fwd'} {t * 1e3:8.1f} ms  x{t / base[backward]:.2f}")
        print(f"{name:36s}" + "   ".join(cells))


if __name__ == "__main__":
    main()
