"""Published training throughputs the step-time model is fitted to, and those it is checked on.

Each row is one published run: its model, GPUs, layout and software switches, and the number its
source prints. The fitting rows fix the constants of ``planning.performance`` that SC21 cannot
(the Hopper matmul efficiency and the FP8 efficiency; SC21 Table 1 fixes ``eta`` and ``kappa``,
``planning.sc21``); the held-out rows are never looked at by the fit, and
``benchmarks/planner_validation.py`` prints the error on both.

Sources (every number below is copied from them; what a source does not state is an assumption,
named in the row's note or here):

* ``nemo-24.07``: NVIDIA NeMo Framework, ``docs/source/performance/performance_summary.md``,
  "Pretraining" table (NeMo 24.07 container, DGX-H100, FP8), 2024. Tokens/s/GPU.
* ``llama3``: Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv:2407.21783, July 2024,
  Table 4 (Llama 3 405B on H100, BF16): TFLOP/s per GPU, compared here with the model TFLOP/s of
  ``planning.flops`` (attention counted unmasked; the paper does not give its count).
* ``bridge-25.11``: NVIDIA Megatron-Bridge, ``docs/performance-summary.md``, "25.11 NeMo
  Container" pre-training tables, systems DGX-H100 and DGX-B200, FP8 current scaling, 2025.
  Tokens/s/GPU.
* ``torchtitan``: PyTorch torchtitan, ``docs/performance.md``, "Llama 3 performance numbers":
  FSDP2 on 64 A100 80GB, local batch 1, bf16, 2024 (sequence length 8192, torchtitan's Llama 3
  default). Tokens/s/GPU.

Assumptions where the sources are silent: micro-batch 1 and 8 virtual stages per GPU for Llama 3
(Table 4 gives neither; it uses interleaved 1F1B), no activation recompute in NVIDIA's runs (their
recipes' default on H100), TE's userbuffer overlap in NVIDIA's runs with tp > 1 and not in Meta's
(not stated), pipeline send/receive overlapped with compute in NVIDIA's interleaved runs (NeMo's and
Megatron-Bridge's communication-overlap setup sets ``overlap_p2p_comm`` whenever the virtual
pipeline size exceeds 1) and not in Meta's (not stated), the distributed optimizer with overlapped
gradient reduction and parameter gather,
sequence parallelism at tp > 1, flash attention everywhere, TE's fused kernels in NVIDIA's and
Meta's runs, not in torchtitan's (no torch.compile in that table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from typing import Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from megatron_hydra.config.bundled import CONF_MODULE
from megatron_hydra.config.schema import ClusterConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.planning import sc21
from megatron_hydra.planning.flops import model_flops_per_token
from megatron_hydra.planning.performance import CALIBRATED, SC21_FIT, Constants, Layout, estimate

# name: (layers, hidden, heads, query groups, ffn, vocab, activation); public model cards/configs.
MODELS: Dict[str, Tuple[int, int, int, int, int, int, str]] = {
    "GPT3-5B": (24, 4096, 32, 32, 16384, 50257, "gelu"),
    "GPT3-20B": (44, 6144, 48, 48, 24576, 50257, "gelu"),
    "GPT3-175B": (96, 12288, 96, 96, 49152, 50257, "gelu"),
    "Llama2-7B": (32, 4096, 32, 32, 11008, 32000, "swiglu"),
    "Llama2-13B": (40, 5120, 40, 40, 13824, 32000, "swiglu"),
    "Llama2-70B": (80, 8192, 64, 8, 28672, 32000, "swiglu"),
    "Llama3-8B": (32, 4096, 32, 8, 14336, 128256, "swiglu"),
    "Llama3-70B": (80, 8192, 64, 8, 28672, 128256, "swiglu"),
    "Llama3-405B": (126, 16384, 128, 8, 53248, 128256, "swiglu"),
}
CLUSTERS = {"A100": "a100_80g_x1024", "H100": "h100_80g_x1024", "B200": "b200_x1024"}
TOKENS = "tokens/s/GPU"
MODEL_TFLOPS = "model TFLOP/s/GPU"
HW_TFLOPS = "hw TFLOP/s/GPU"


@dataclass(frozen=True)
class Row:
    source: str
    gpu: str  # key of CLUSTERS
    model: str  # key of MODELS
    gpus: int
    seq: int
    batch: int  # global batch, sequences
    tp: int
    pp: int
    cp: int
    vpp: int
    micro_batch: int
    metric: str
    published: float
    held_out: bool
    fp8: bool = False
    fsdp: bool = False
    recompute: Optional[str] = None
    tp_comm_overlap: bool = True  # effective only at tp > 1
    pp_comm_overlap: bool = True  # overlap_p2p_comm, effective only with virtual stages
    fused_kernels: bool = True
    note: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, micro_batch=self.micro_batch, vpp=self.vpp,
                      recompute=self.recompute, sequence_parallel=self.tp > 1,
                      distributed_optimizer=not self.fsdp and self.dp * self.cp > 1, overlap_grad_reduce=True,
                      fsdp=self.fsdp, cp=self.cp, flash_attention=True, fused_kernels=self.fused_kernels,
                      fp8=self.fp8, tp_comm_overlap=self.tp_comm_overlap and self.tp > 1,
                      pp_comm_overlap=self.pp_comm_overlap and self.vpp > 1)

    def transformer(self) -> TransformerConfig:
        layers, h, heads, groups, ffn, vocab, act = MODELS[self.model]
        padded = 128 * self.tp * math.ceil(vocab / (128 * self.tp))
        return TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=heads, num_query_groups=groups,
                                 kv_channels=h // heads, ffn_hidden_size=ffn, seq_length=self.seq,
                                 max_position_embeddings=self.seq, vocab_size=vocab, padded_vocab_size=padded,
                                 activation=act)

    def layout_label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"dp{self.dp}"]
        parts += ([f"vp{self.vpp}"] if self.vpp > 1 else []) + [f"mb{self.micro_batch}"]
        parts += (["fsdp"] if self.fsdp else []) + (["fp8"] if self.fp8 else []) + ([self.recompute] if self.recompute else [])
        return " ".join(parts)


def _nemo(model, gpus, batch, mb, seq, tp, pp, cp, vp, tokens):
    return Row("nemo-24.07", "H100", model, gpus, seq, batch, tp, pp, cp, vp, mb, TOKENS, tokens, False, fp8=True)


def _bridge(gpu, model, gpus, batch, mb, seq, tp, pp, cp, vp, tokens, fsdp=False):
    return Row("bridge-25.11", gpu, model, gpus, seq, batch, tp, pp, cp, vp, mb, TOKENS, tokens, True, fp8=True,
               fsdp=fsdp)


ROWS: List[Row] = [
    # NeMo 24.07, DGX-H100, FP8 (fitting set).
    _nemo("GPT3-5B", 64, 2048, 4, 2048, 1, 1, 1, 1, 22521),
    _nemo("GPT3-20B", 64, 256, 2, 2048, 2, 1, 1, 1, 5851),
    _nemo("GPT3-175B", 128, 256, 1, 2048, 4, 8, 1, 6, 726),
    _nemo("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 1, 6, 782),
    _nemo("Llama2-7B", 8, 128, 1, 4096, 1, 1, 1, 1, 16847),
    _nemo("Llama2-13B", 16, 128, 1, 4096, 1, 4, 1, 10, 8646),
    _nemo("Llama2-70B", 64, 128, 1, 4096, 4, 4, 1, 20, 1707),
    _nemo("Llama3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12036),
    _nemo("Llama3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1533),
    # The Llama 3 paper, Table 4, H100, BF16: the 8K-token rows fit, the 128K-token row is held out.
    Row("llama3", "H100", "Llama3-405B", 8192, 8192, 2048, 8, 16, 1, 8, 1, MODEL_TFLOPS, 430, False,
        tp_comm_overlap=False, pp_comm_overlap=False, note="16M tokens per batch; micro-batch and virtual stages assumed"),
    Row("llama3", "H100", "Llama3-405B", 16384, 8192, 2048, 8, 16, 1, 8, 1, MODEL_TFLOPS, 400, False,
        tp_comm_overlap=False, pp_comm_overlap=False, note="16M tokens per batch; micro-batch and virtual stages assumed"),
    Row("llama3", "H100", "Llama3-405B", 16384, 131072, 128, 8, 16, 16, 8, 1, MODEL_TFLOPS, 380, True,
        tp_comm_overlap=False, pp_comm_overlap=False, note="CP16 at 128K tokens; the paper's attention FLOP count is not stated"),
    # Megatron-Bridge 25.11, FP8 current scaling (held out: a later software stack, and the B200).
    _bridge("H100", "Llama3-8B", 8, 128, 1, 8192, 1, 1, 1, 1, 14451, fsdp=True),
    _bridge("H100", "Llama3-70B", 64, 128, 1, 8192, 4, 8, 1, 5, 1602),
    _bridge("H100", "Llama3-405B", 1024, 512, 1, 8192, 8, 8, 2, 8, 292),
    _bridge("B200", "Llama3-8B", 8, 128, 2, 8192, 1, 1, 1, 1, 30624),
    _bridge("B200", "Llama3-405B", 128, 64, 1, 8192, 4, 8, 2, 8, 661),
    # torchtitan, FSDP2 on 64 A100 80GB, bf16 (held out: another framework, FSDP).
    Row("torchtitan", "A100", "Llama3-8B", 64, 8192, 64, 1, 1, 1, 1, 1, TOKENS, 2973, True, fsdp=True,
        recompute="selective", tp_comm_overlap=False, fused_kernels=False, note="selective op checkpointing"),
    Row("torchtitan", "A100", "Llama3-70B", 64, 8192, 64, 1, 1, 1, 1, 1, TOKENS, 331, True, fsdp=True,
        recompute="full", tp_comm_overlap=False, fused_kernels=False, note="full checkpointing"),
]


@lru_cache(maxsize=None)
def cluster_for(gpu: str, gpus: int) -> ClusterConfig:
    """The bundled cluster of this GPU (``conf/cluster``), with as many 8-GPU nodes as the run had."""
    text = (resources.files(CONF_MODULE) / "cluster" / f"{CLUSTERS[gpu]}.yaml").read_text()
    cluster = ClusterConfig(**OmegaConf.to_container(OmegaConf.create(text)))
    return replace(cluster, num_nodes=max(1, gpus // cluster.gpus_per_node))


def predicted(row: Row, constants: Constants = CALIBRATED) -> float:
    """The model's prediction of the row's published metric."""
    tc = row.transformer()
    step = estimate(tc, row.batch, row.layout(), cluster_for(row.gpu, row.gpus), constants)
    if row.metric == TOKENS:
        return step.tokens_per_s / row.gpus
    # Model FLOPs by this project's count (planning.flops), over the predicted step time.
    return model_flops_per_token(tc) * step.tokens / step.total / row.gpus / 1e12


@dataclass(frozen=True)
class Result:
    source: str
    gpu: str
    model: str
    layout: str
    metric: str
    published: float
    predicted: float
    held_out: bool

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def sc21_results(constants: Constants = CALIBRATED) -> List[Result]:
    cluster = cluster_for("A100", 1024)
    return [Result("sc21", "A100", f"GPT {r.label}", f"tp{r.tp} pp{r.pp} dp{r.dp} mb1 full", HW_TFLOPS,
                   r.tflops_per_gpu, sc21.predicted_tflops(r, cluster, constants), False) for r in sc21.TABLE1]


def results(constants: Constants = CALIBRATED, rows: List[Row] = ROWS) -> List[Result]:
    """Every published row with the model's prediction: SC21 Table 1, then ``rows``."""
    return sc21_results(constants) + [
        Result(r.source, r.gpu, r.model, r.layout_label(), r.metric, r.published, predicted(r, constants), r.held_out)
        for r in rows]


def summary(found: List[Result]) -> Tuple[float, float]:
    """(rms, worst) relative error."""
    errors = [abs(r.error) for r in found]
    return (sum(e * e for e in errors) / len(errors)) ** 0.5, max(errors)


def with_hopper(eta: float, fp8_efficiency: float, attention_efficiency: float, base: Constants = SC21_FIT) -> Constants:
    """``base`` with ``eta`` for the H100, H200 and B200 and the given FP8 and attention efficiencies."""
    gpus = ("H100-SXM5-80GB", "H200-SXM-141GB", "B200-SXM-180GB")
    return replace(base, gpu_eta=tuple((g, eta) for g in gpus), fp8_efficiency=fp8_efficiency,
                   attention_efficiency=attention_efficiency)


def fit(rows: List[Row] = ROWS) -> Tuple[Tuple[float, float, float], float]:
    """((Hopper eta, FP8 efficiency, attention efficiency), rms relative error): least squares on
    the fitting rows (H100; ``eta`` and ``kappa`` stay SC21's), by a grid search refined around its
    best point."""
    fitting = [r for r in rows if not r.held_out and r.gpu == "H100"]

    def loss(x: Tuple[float, float, float]) -> float:
        c = with_hopper(*x)
        return sum((predicted(r, c) / r.published - 1) ** 2 for r in fitting) / len(fitting)

    best, step = (0.6, 0.7, 0.6), 0.09
    for _ in range(4):
        axes = [[v + step * i for i in range(-3, 4) if 0 < v + step * i <= 1] for v in best]
        best = min(((e, f, a) for e in axes[0] for f in axes[1] for a in axes[2]), key=loss)
        step /= 3
    return tuple(round(v, 4) for v in best), loss(best) ** 0.5
