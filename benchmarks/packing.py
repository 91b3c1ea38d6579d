"""What packing buys on fine-tuning data: padding, and real tokens trained per second.

    python benchmarks/packing.py [conversations=3000] [steps=8] [seq=512]

A generated chat set with the spread of lengths real instruction data has (a long right tail):
every conversation is a user prompt of log-normal length (median 50 bytes, sigma 1.0), an
assistant answer of log-normal length (median 120 bytes, sigma 1.0), and, one time in three, a
system message (median 40 bytes); byte tokenizer, so bytes are tokens. With the template's
headers the median conversation is about 245 tokens, half the 512-token sequence, and the longest
tenth reaches past it (truncated, as data=sft does): instruction data at a short context. The same file is loaded
twice through ``data=sft`` (``build_datasets``), with ``data.packing=true`` and ``false``, and:

1. the padding fraction of one epoch of sequences (padding positions / all positions), and the
   number of sequences an epoch needs, for both;
2. a gpt_tiny-shaped GPT (4 layers, h=256, 8 heads, seq ``seq``, micro-batch 4; the project's
   ``GPTModel``, AdamW) trains ``steps`` steps on each, after 2 untimed warm-up steps: non-padding
   tokens per second (positions that hold a conversation's token, whatever their loss mask) and
   assistant (loss) tokens per second.
3. the time ``best_fit_packs`` takes to pack 100k conversations.

Prints numbers and the packed/unpacked ratios; asserts nothing.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import numpy as np
import torch

from megatron_hydra.config import bundled, derive
from megatron_hydra.data.builders import build_datasets
from megatron_hydra.data.packing import best_fit_packs, padding_fraction
from megatron_hydra.models.archs import masked_mean
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel.state import ParallelState

MICRO_BATCH, WARMUP = 4, 2
WORDS = "the of and to in is for that with as on be at by this from or have an are which you it not".split()


def _text(rng: np.random.RandomState, length: int) -> str:
    words, size = [], 0
    while size < length:
        words.append(WORDS[rng.randint(len(WORDS))])
        size += len(words[-1]) + 1
    return " ".join(words)[:max(1, length)]


def write_chats(path: str, count: int, seed: int = 0) -> None:
    rng = np.random.RandomState(seed)
    with open(path, "w") as f:
        for _ in range(count):
            messages = []
            if rng.rand() < 1 / 3:
                messages.append({"role": "system", "content": _text(rng, int(rng.lognormal(np.log(40), 0.5)))})
            messages.append({"role": "user", "content": _text(rng, int(rng.lognormal(np.log(50), 1.0)))})
            messages.append({"role": "assistant", "content": _text(rng, int(rng.lognormal(np.log(120), 1.0)))})
            f.write(json.dumps({"messages": messages}) + "\n")


def epoch_stats(ds, seq: int):
    """(sequences in epoch 0, padding fraction of them)."""
    n = ds.epoch_size(0)
    used = sum(int((ds[k]["document_ids"] < len(ds.pack(k))).sum()) for k in range(n))
    return n, 1 - used / (n * seq)


def _model(cfg, derived):
    tcfg = derived.transformer
    model = GPTModel(tcfg, ParallelState.single())
    init_weights(model, tcfg, cfg.seed, 0, 1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_rates(cfg, derived, datasets, steps: int):
    """Per dataset: (non-padding tokens / s, assistant tokens / s) over ``steps`` timed steps. The
    datasets take turns step by step, so that a busy machine slows them alike."""
    runs = [(ds, *_model(cfg, derived)) for ds in datasets]
    totals = [[0.0, 0, 0] for _ in datasets]  # seconds, non-padding tokens, assistant tokens
    for step in range(WARMUP + steps):
        for (ds, model, opt), total in zip(runs, totals):
            picks = [(step * MICRO_BATCH + i) % len(ds) for i in range(MICRO_BATCH)]
            items = [ds[k] for k in picks]
            batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
            start = time.perf_counter()
            opt.zero_grad()
            loss = masked_mean(model(batch["tokens"], batch["labels"], position_ids=batch["position_ids"]),
                               batch["loss_mask"])
            loss.backward()
            opt.step()
            if step >= WARMUP:
                total[0] += time.perf_counter() - start
                total[1] += sum(int((it["document_ids"] < len(ds.pack(k))).sum()) for k, it in zip(picks, items))
                total[2] += int(batch["loss_mask"].sum())
    return [(real / seconds, learned / seconds) for seconds, real, learned in totals]


def main(conversations: int = 3000, steps: int = 8, seq: int = 512) -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/chat.jsonl"
        write_chats(path, conversations)
        datasets = []
        for packing in (True, False):
            cfg = bundled.compose(["model=gpt_tiny", f"model.seq_length={seq}", "model.vocab_size=512", "data=sft",
                                   f"data.path={path}", "data.tokenizer.type=byte", f"data.packing={packing}",
                                   "data.split=[1,0,0]", f"data.micro_batch_size={MICRO_BATCH}",
                                   f"data.global_batch_size={MICRO_BATCH}", f"trainer.max_steps={steps + WARMUP}",
                                   "optim.warmup_steps=0"])
            derived = derive(cfg)
            ds, _, _ = build_datasets(cfg.data, seq_length=seq, seed=cfg.data.seed, num_samples=derived.split_samples,
                                      vocab_size=derived.transformer.vocab_size)
            datasets.append(ds)
        lengths = datasets[0].samples.positions
        print(f"{len(lengths)} conversations of median {int(np.median(lengths))} tokens (90th percentile "
              f"{int(np.percentile(lengths, 90))}, {np.mean(lengths == seq):.1%} truncated to {seq})")
        results = [(*epoch_stats(ds, seq), *rate) for ds, rate in zip(datasets, train_rates(cfg, derived, datasets, steps))]
    for packing, (sequences, padding, rate, learned) in zip((True, False), results):
        print(f"packing={str(packing).lower():5s}  sequences/epoch={sequences:6d}  padding={padding:6.1%}  "
              f"non-padding tokens/s={rate:8.0f}  assistant tokens/s={learned:8.0f}")
    (s1, p1, r1, l1), (s0, p0, r0, l0) = results
    print(f"packed / unpacked: sequences per epoch {s1 / s0:.3f}, padding fraction {p1 / p0:.3f}, "
          f"non-padding tokens/s {r1 / r0:.2f}x, assistant tokens/s {l1 / l0:.2f}x "
          f"(from the padding alone: {(1 - p1) / (1 - p0):.2f}x)")
    rng = np.random.RandomState(1)
    lengths = np.minimum(rng.lognormal(np.log(280), 0.8, 100_000).astype(int) + 1, seq)
    start = time.perf_counter()
    packs = best_fit_packs(lengths, seq)
    took = time.perf_counter() - start
    print(f"best_fit_packs: 100000 conversations into {len(packs)} sequences of {seq} in {took:.2f} s "
          f"(padding {padding_fraction(packs, lengths, seq):.1%})")


if __name__ == "__main__":
    main(**{k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])})
