"""Published measurements the planner is calibrated and checked against.

Narayanan, Shoeybi, Casper, LeGresley, Patwary, Korthikanti, Vainbrand, Kashinkunti, Bernauer,
Catanzaro, Phanishayee, Zaharia: "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC21 (arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T parameters on
Selene (DGX A100 80GB nodes: 8 GPUs on NVSwitch, 8 HDR InfiniBand adapters per node), sequence
length 2048, vocabulary 51,200, mixed precision, activation recomputation, and the achieved
TFLOP/s per GPU counted with their eq. 3, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` FLOPs per
step, i.e. recomputation included. The table gives t, p, the GPU count and the batch size; the
micro-batch size and interleaving are not part of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

SEQ_LENGTH = 2048
VOCAB_SIZE = 51200


@dataclass(frozen=True)
class SC21Row:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved, per GPU

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def label(self) -> str:
        return f"{self.billions:g}B"


# params(B), heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU
_ROWS: Tuple[tuple, ...] = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

TABLE1: List[SC21Row] = [SC21Row(*row) for row in _ROWS]


def model_overrides(row: SC21Row) -> List[str]:
    """Config overrides that describe the row's model (GPT, learned positions, untied nothing)."""
    return [
        f"model.name=sc21_{row.label}", f"model.num_layers={row.layers}", f"model.hidden_size={row.hidden}",
        f"model.num_attention_heads={row.heads}", f"model.seq_length={SEQ_LENGTH}", f"model.vocab_size={VOCAB_SIZE}",
        f"data.global_batch_size={row.batch}",
    ]


def transformer(row: SC21Row):
    """The row's model as the performance model sees it (GPT: 4h MLP, plain multi-head attention)."""
    from megatron_hydra.config.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=row.layers, hidden_size=row.hidden, num_attention_heads=row.heads, num_query_groups=row.heads,
        kv_channels=row.hidden // row.heads, ffn_hidden_size=4 * row.hidden, seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH, vocab_size=VOCAB_SIZE, padded_vocab_size=VOCAB_SIZE,
    )


def published_layout(row: SC21Row):
    """The row's layout as the 2021 code ran it: full recompute, no sequence parallelism, no
    distributed optimizer, gradient all-reduce after the backward, attention scores in HBM.
    Micro-batch 1 and no interleaving: the table states neither, and these are Megatron's
    defaults."""
    from megatron_hydra.planning.performance import Layout

    return Layout(tp=row.tp, pp=row.pp, dp=row.dp, micro_batch=1, vpp=1, recompute="full",
                  sequence_parallel=False, distributed_optimizer=False, overlap_grad_reduce=False,
                  flash_attention=False)


def predicted_tflops(row: SC21Row, cluster, constants=None) -> float:
    from megatron_hydra.planning.performance import CALIBRATED, estimate

    step = estimate(transformer(row), row.batch, published_layout(row), cluster, constants or CALIBRATED)
    return step.tflops_per_gpu


def fit(cluster, rows: List[SC21Row] = TABLE1) -> Tuple[float, float, float]:
    """(eta, kappa, rms relative error): the least-squares fit of the two free constants to the
    published TFLOP/s per GPU, by a grid search refined twice around its best point."""
    from dataclasses import replace

    from megatron_hydra.planning.performance import SC21_FIT

    def loss(eta: float, kappa: float) -> float:
        c = replace(SC21_FIT, eta=eta, kappa=kappa)
        return sum((predicted_tflops(r, cluster, c) / r.tflops_per_gpu - 1) ** 2 for r in rows) / len(rows)

    eta, kappa, step_eta, step_kappa = 0.7, 1.0, 0.05, 0.5
    for _ in range(3):
        grid = [(e, k) for e in (eta + step_eta * i for i in range(-6, 7)) for k in (kappa + step_kappa * i for i in range(-6, 7))
                if 0 < e <= 1 and k >= 0]
        eta, kappa = min(grid, key=lambda ek: loss(*ek))
        step_eta, step_kappa = step_eta / 5, step_kappa / 5
    return eta, kappa, loss(eta, kappa) ** 0.5
