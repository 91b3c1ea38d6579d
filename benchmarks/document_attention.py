"""Document-masked attention on CPU: which kernel, and what the mask costs against plain causal.

    python benchmarks/document_attention.py

``data.reset_attention_mask`` restricts each token to the earlier tokens of its own document
(block-diagonal causal). Two ways to run that through torch:

- SDPA with a mask: ``F.scaled_dot_product_attention(attn_mask=...)``, boolean (True = attend)
  or additive float (0 / -inf), built from the document ids ([b, 1, s, s]);
- FlexAttention (``torch.nn.attention.flex_attention``) with a block mask from a ``mask_mod``,
  which skips the blocks that are masked out entirely;
- what the model runs (``parallel.document_masks.document_attention``): on CPU torch's flash
  kernel given the causal flag and the additive mask together, so that it skips the blocks above
  the diagonal as causal SDPA does.

Each is timed at sequence 2048 (one sequence, 8 heads of 64, fp32, 4 documents of random length)
against plain causal SDPA (``is_causal=True``) in the same run, the variants taking turns, best of
several runs: forward + backward, and forward alone. The mask build (from the document ids) is
counted in the masked variants. FlexAttention has no CPU backward, so it is timed forward only
(marked n/a where it fails). Prints ratios, asserts nothing.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from megatron_hydra.parallel.document_masks import document_attention

B, H, S, D, DOCS, REPEATS = 1, 8, 2048, 64, 4, 7


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


def run_once(fn, backward: bool) -> float:
    """Seconds of one call of ``fn`` (forward, plus backward when ``backward``)."""
    q, k, v = (torch.randn(B, H, S, D, requires_grad=backward) for _ in range(3))
    start = time.perf_counter()
    out = fn(q, k, v)
    if backward:
        out.sum().backward()
    return time.perf_counter() - start


def best_times(variants, backward: bool):
    """name -> fastest of REPEATS runs (or the exception's name). The variants take turns, so
    load from other processes on the machine falls on all of them alike; the minimum is the
    least disturbed run. One warm-up run each first."""
    times, failed = {name: [] for name in variants}, {}
    for repeat in range(REPEATS + 1):
        for name, fn in variants.items():
            if name in failed:
                continue
            try:
                t = run_once(fn, backward)
            except Exception as e:  # noqa: BLE001 (FlexAttention: no backward on CPU)
                failed[name] = type(e).__name__
                continue
            if repeat:
                times[name].append(t)
    return {name: failed.get(name) or min(ts) for name, ts in times.items()}


def main() -> None:
    warnings.filterwarnings("ignore")  # FlexAttention's advice to compile it: eager is what is measured
    torch.manual_seed(0)
    ids = document_ids()
    variants = {
        "causal SDPA (is_causal)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "SDPA, boolean document mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask(ids)),
        "SDPA, additive document mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=additive_mask(ids, q.dtype)),
    }
    variants["causal flash kernel + additive mask"] = lambda q, k, v: document_attention(q, k, v, ids)
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
          f"best of {REPEATS}; ratio = time / causal SDPA's")
    results = {backward: best_times(variants, backward) for backward in (True, False)}
    for name in variants:
        cells = []
        for backward, label in ((True, "fwd+bwd"), (False, "fwd")):
            t, base = results[backward][name], results[backward]["causal SDPA (is_causal)"]
            cells.append(f"{label} n/a ({t})" if isinstance(t, str) else f"{label} {t * 1e3:8.1f} ms  x{t / base:.2f}")
        print(f"{name:36s}" + "   ".join(cells))


if __name__ == "__main__":
    main()
