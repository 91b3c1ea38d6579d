"""Is the data pipeline ever the bottleneck? Three rates measured in one run, then their ratios:

1. preprocessing throughput (MB of jsonl per second) with 1 and 2 worker processes, for the
   byte tokenizer and a byte-level BPE (its training is not timed);
2. samples per second that a torch DataLoader over the GPT dataset delivers (micro-batch 8,
   seq 2048), in the main process and with 2 loader workers;
3. samples per second a training step of a gpt_125m-shaped model consumes (forward + backward of
   a plain torch GPT stack: 12 layers, h=768, 12 heads, vocab 50257, seq 2048, micro-batch 1).

    python benchmarks/data_throughput.py [mb=32] [batches=40] [train_steps=2]

The corpus is the standard library's text as jsonl (no download), repeated up to ``mb`` MB; the
preprocessing rates are those the command line reports, worker start-up included.
Prints numbers and ratios; asserts nothing (compare numbers from one run only).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.data import demo
from megatron_hydra.data.gpt_dataset import GPTDataset
from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.data.tokenizers import train_bpe

SEQ, MICRO_BATCH = 2048, 8


def write_corpus(path: str, megabytes: float) -> int:
    texts = []
    for _, p, _ in demo.source_files(max_bytes=10**9):
        try:
            with open(p, encoding="utf-8") as f:
                texts.append(f.read())
        except UnicodeDecodeError:
            pass
    size, i = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            line = json.dumps({"text": texts[i % len(texts)]}) + "\n"
            f.write(line)
            size += len(line.encode())
            i += 1
    return size


def preprocess_rate(src: str, out: str, tok: TokenizerConfig, workers: int) -> float:
    """MB/s as the command line reports it (its own clock: reading, worker start-up, writing)."""
    args = [f"input={src}", f"output_prefix={out}", f"tokenizer.type={tok.type}", f"workers={workers}"]
    if tok.path:
        args.append(f"tokenizer.path={tok.path}")
    done = subprocess.run([sys.executable, "-m", "megatron_hydra.data.preprocess", *args, "progress=true"],
                          capture_output=True, text=True, check=True)
    return float(re.search(r"\(([\d.]+) MB/s", done.stderr).group(1))


def loader_rate(ds: GPTDataset, batches: int, workers: int) -> float:
    loader = torch.utils.data.DataLoader(ds, batch_size=MICRO_BATCH, num_workers=workers, shuffle=False)
    it = iter(loader)
    next(it)  # worker start-up is not throughput
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        n += len(next(it)["tokens"])
    return n / (time.perf_counter() - t0)


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """gpt_125m's shape in plain torch (tied embeddings, learned positions)."""

    def __init__(self, vocab=50257, h=768, layers=12, heads=12, seq=SEQ):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.tok.weight.T
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train_rate(steps: int) -> float:
    """Samples per second consumed by forward + backward at micro-batch 1 (first step excluded)."""
    torch.manual_seed(0)
    model = TinyGPT()
    tokens = torch.randint(0, 50257, (1, SEQ))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        model(tokens, tokens).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return 1.0 / (sum(times[1:]) / steps)


def main(argv):
    args = dict(a.split("=", 1) for a in argv)
    mb, batches, steps = float(args.get("mb", 32)), int(args.get("batches", 40)), int(args.get("train_steps", 2))
    print(f"torch threads: {torch.get_num_threads()}, cpus: {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus.jsonl")
        size = write_corpus(src, mb)
        bpe_path = os.path.join(tmp, "bpe.json")
        t0 = time.perf_counter()
        with open(src) as f:
            texts = (json.loads(line)["text"] for line in f)
            train_bpe((t for t, _ in zip(texts, range(300))), 8192, bpe_path)
        print(f"corpus: {size / 1e6:.1f} MB jsonl; BPE-8192 trained on its first 300 documents in {time.perf_counter() - t0:.1f} s (not timed below)")
        rates = {}
        for name, tok in (("byte", TokenizerConfig(type="byte")), ("bpe", TokenizerConfig(type="hf", path=bpe_path))):
            for workers in (1, 2):
                rates[name, workers] = preprocess_rate(src, os.path.join(tmp, f"{name}{workers}"), tok, workers)
                print(f"preprocess {name:4s} workers={workers}: {rates[name, workers]:6.2f} MB/s")
            print(f"preprocess {name:4s} 2 workers / 1 worker: {rates[name, 2] / rates[name, 1]:.2f}x")

        corpus = IndexedDataset(os.path.join(tmp, "bpe1_text_document"))
        docs = np.arange(corpus.num_documents)
        n = (batches + 2) * MICRO_BATCH * 3
        t0 = time.perf_counter()
        ds = GPTDataset(corpus, docs, n, SEQ, 1234, os.path.join(tmp, "cache"))
        print(f"GPT index for {len(ds)} samples ({ds.num_epochs} epochs of {ds.tokens_per_epoch} tokens) "
              f"built in {time.perf_counter() - t0:.2f} s")
        load = {w: loader_rate(ds, batches, w) for w in (0, 2)}
        for w, r in load.items():
            print(f"loader num_workers={w}: {r:9.1f} samples/s ({r * SEQ / 1e6:.2f} M tokens/s), "
                  f"micro-batch {MICRO_BATCH}, seq {SEQ}")

    consume = train_rate(steps)
    print(f"gpt_125m shape fwd+bwd, micro-batch 1, seq {SEQ}: {1 / consume:.2f} s/sample "
          f"-> consumes {consume:.3f} samples/s ({consume * SEQ:.0f} tokens/s)")
    for w, r in load.items():
        print(f"ratio loader(num_workers={w}) / training consumption: {r / consume:,.0f}x")
    bpe_tokens_per_mb = ds.tokens_per_epoch / (size / 1e6)
    for name in ("byte", "bpe"):
        per_s = rates[name, 2] * (bpe_tokens_per_mb if name == "bpe" else 1e6)
        print(f"ratio preprocess({name}, 2 workers) tokens/s / training tokens/s: {per_s / (consume * SEQ):,.0f}x")

if __name__ == "__main__":
    main(sys.argv[1:])
