"""Step time of a parallel layout on a GPU cluster: an analytic model, calibrated once.

Notation: global batch ``B``, micro-batch ``b``, sequence ``s``, hidden ``h``, heads ``a``, layers
``l``, padded vocabulary ``V``; tensor, pipeline, virtual-pipeline, context-parallel and
data-parallel degrees ``t, p, v, c, d`` (``t p c d`` GPUs); ``m = B / (b d)`` micro-batches per
pipeline per step. Bytes per activation and weight element ``e = 2`` (bf16); gradients are reduced
in fp32 (4 bytes). A GPU holds ``b s / c`` tokens of a micro-batch: with context parallelism every
per-token term below (compute, memory-bound traffic, tensor- and pipeline-parallel messages) is
``1/c`` of its value at ``c = 1``; the attention of the GPU's ``s/c`` queries runs against all
``s`` keys, ``1/c`` of the sequence's attention too.

Compute. Per micro-batch, each GPU runs ``1/t`` of its stage's matmuls: per layer and token the
forward costs ``F_layer = 2 (h (a + 2 g) k + a k h + n_mlp h f) + 4 s a k`` FLOPs (``planning.flops``,
``g`` query groups, ``k`` head size, ``n_mlp`` = 2, or 3 for SwiGLU), the backward twice that. Matmuls
run at ``eta * peak``. Memory-bound kernels (layer norms, bias-dropout-add, the activation, softmax
and dropout over the ``a s`` attention scores) move ``kappa * e * (c_h h_r + 2 f/t + c_s a s / t)``
bytes per token and layer in the forward (twice in the backward) at HBM speed, where ``h_r = h``
(``h/t`` with sequence parallelism, which splits the replicated norms and dropouts), ``c_h = 12``
and ``c_s = 5`` element passes; ``eta`` and ``kappa`` are the two calibrated constants (below).
Activation recompute adds, in the backward, the forward of every layer (``full``) or of the
attention matmuls and softmax only (``selective``, Korthikanti et al. 2022). The last stage also
runs the LM head (``2 h V / t`` FLOPs per token forward) and its cross entropy over ``V / t``
logits (4 passes); the first stage reads the embedding (negligible).

Tensor parallelism: per layer and micro-batch, 2 all-reduces of ``b s h e`` bytes in the forward and
2 in the backward (all-gather + reduce-scatter pairs with sequence parallelism: the same volume),
plus 2 more when the forward is recomputed; a ring moves ``2 (t-1)/t`` of the message per GPU, over
NVLink when the group fits in a node, else InfiniBand. Not overlapped, unless ``tp_comm_overlap``
(below).

Pipeline: the 1F1B schedule (interleaved with ``v`` chunks per GPU) takes
``(m + (p-1)/v) * T_stage`` where ``T_stage`` is the forward + backward time of one micro-batch on
the slowest stage (the bubble is the ``(p-1)/v`` term, Narayanan et al. 2021 eq. 1-2). Each
micro-batch crosses ``2 v`` stage boundaries per GPU (activation forward, gradient backward), each a
``b s h e / t`` message (Megatron's scatter-gather: every tensor-parallel rank sends its slice over
its own adapter) over InfiniBand when the neighbouring stage is on another node (stages are
``t c d`` ranks apart), else NVLink.

Context parallelism (``planning.context_parallel`` derives each term): per layer and micro-batch,
with ``kv = 2 b (s/c) (g/t) k e`` bytes (one CP rank's K and V) and ``A_blk`` the forward attention
of one K/V block (matmuls and softmax traffic of the GPU's queries against ``s/c`` keys: ``1/c^2``
of the whole sequence's attention at this ``t``), ring attention (``p2p``) exposes
``(c-1) max(0, T(kv) - A_blk)`` in the forward (each exchange hidden behind one block), and in the
backward ``(c-1) max(0, 2 T(kv) - 2 A_blk) + T(kv)`` (K/V and the dK/dV accumulators travel
together behind twice the compute, then the accumulators' last hop home; a layer whose sliding
window binds computes its own share of the layers' attention, unevenly over the steps, and each
step hides the next transfer behind its own block: ``context_parallel.ring_step_weights``); Ulysses (``a2a``)
exposes 8 all-to-alls of ``(c-1)/c * b (s/c) (a/t) k e`` bytes per GPU (4 forward, 4 backward). A
recomputed forward (full recompute) repeats the forward's exchanges; selective recompute leaves
context-parallel attention alone (it keeps only its output and log-sum-exp, nothing quadratic, so
replaying it would only repeat its exchanges). The CP group's members are
``t`` ranks apart (tp innermost, then cp, dp, pp): NVLink when ``t c`` fits in a node, else
InfiniBand. On the critical path like the tensor-parallel collectives.

Mixture of Experts (``tc.moe``; expert-parallel degree ``ep`` carved from ``d``): in an MoE layer
the dense MLP's FLOPs are replaced by what a token runs through (the router's ``2 h E``, ``k``
experts of ffn size ``f_e`` and the shared expert, TP-sharded like the MLP), and its memory-bound
``2 f / t`` by ``2 (k f_e + f_s) / t``. Per MoE layer and micro-batch the tokens travel to their
experts and back: 2 all-to-alls in the forward (dispatch, combine), 2 in the backward, 2 more when
the forward is recomputed, each moving ``(ep-1)/ep * T k h e`` bytes per GPU (``T = b s / c``: every
TP rank of an EP rank dispatches all of the micro-batch's tokens; balanced routing assumed) over a
group spanning ``t c ep`` consecutive ranks; on the critical path, not overlapped. Expert weights
are ``1/(ep t)`` per GPU and their gradients reduce over the ``d c / ep`` ranks holding the same
experts. Whole experts (``expert_tensor_parallel_size=1``): each TP rank dispatches its own
``T / t`` tokens (``1/t`` of the volume) over a group of ``ep`` ranks carved from ``d t`` (within
the TP group when ``ep <= t``, else spanning ``ep c`` ranks), holds ``1/ep`` of the expert weights
unsplit, and reduces their gradients over ``d c t / ep`` ranks; the FLOPs per GPU are the same.

Data parallelism: a ring all-reduce of the GPU's fp32 gradients over the ``d c`` ranks that hold
the same weights, ``2 (dc-1)/(dc) * 4 P_gpu`` bytes per GPU (with the distributed optimizer a
reduce-scatter of the same gradients plus an all-gather of bf16 weights:
``(dc-1)/(dc) * (4 + 2) P_gpu``), over NVLink when the group (``t d c`` consecutive ranks) fits in
a node, else InfiniBand; across nodes a group with ``k = gpus_per_node / t`` members per node
reduces hierarchically at ``k`` times an adapter's rate (at most NVLink's). With
``overlap_grad_reduce`` only what outlasts the backward it overlaps is exposed (below: per virtual
chunk).

Every message also pays ``latency_s``, and links deliver ``link_efficiency`` of their rate (NCCL's
bus bandwidth on NVSwitch and HDR InfiniBand is about three quarters of the link rate); these two
are fixed, not fitted.

Model families (``layer_stacks``): the terms above are per layer of a stack of identical layers
over ``s`` tokens. GPT and BERT have one (BERT's bidirectional attention computes all its score
blocks). T5 has two, its pipeline one stage: the encoder over its ``s`` tokens, and the decoder
over ``t = decoder_seq_length`` tokens, each decoder layer a GPT layer at ``t`` plus its
cross-attention: query and output projections per decoder token, the key/value projection of the
``s`` encoder tokens, ``4 s a k`` more attention FLOPs per decoder token (scores and values over
the encoder's keys), a third norm and dropout-add (``c_h`` scaled by 3/2), and a third
tensor-parallel all-reduce each way plus, in the backward, one over the ``s`` encoder tokens (the
encoder output's gradient). The LM head and its loss run over ``t`` tokens. Model FLOPs equal
``planning.flops``' count for every family.

Modern runs (each a switch on ``Layout``; off, they are the 2021 software above, which
``planning.sc21`` evaluates; ``flash_attention`` is on by default, as in every GPU run of this
project):

* ``flash_attention`` (this project's GPU runs: torch's SDPA, or Transformer Engine's fused
  attention): the attention scores never reach HBM, so the ``c_s a s / t`` passes vanish, and a
  causal model (``arch=gpt``) skips the masked half of the score blocks: the two attention matmuls
  take ``1/2`` of ``4 s a k`` FLOPs per token in time (the model FLOPs still count them whole),
  at ``attention_efficiency * eta * peak`` (fitted: fused attention runs well below the GEMMs).
  The layers' other kernels (``parallel.document_masks.masked_attention``) skip nothing: a
  binding sliding window runs SDPA's memory-efficient kernel with a mask, which computes every
  score (``4 s a k``, though the model FLOPs count only the keys in the window); soft-capped
  scores run in plain ops, their matmuls at ``eta * peak`` over every score and ``c_capped`` element
  passes over the ``a s`` scores of a token at HBM speed, as without flash attention.
* ``fused_kernels`` (``model.transformer_impl=transformer_engine``): the layer norm fused into the
  next matmul's input and bias-dropout-add fused into one kernel: ``c_h_fused = 6`` element passes
  per token and layer instead of ``c_h = 12``.
* ``fp8`` (``precision.fp8``): the linear layers' matmuls (QKV, output, MLP) run at
  ``fp8_efficiency * r_fp8 * eta * peak``, ``r_fp8`` the GPU's dense FP8 over bf16 peak
  (``FP8_PEAK_RATIO``: 2 on H100/H200/B200; the A100 has no FP8 tensor cores and runs bf16);
  attention and the LM head stay in bf16; ``fp8_efficiency`` is fitted (scaling, casts).
* ``compiled`` (``trainer.compile``: ``torch.compile`` per transformer block): the norms, the
  activation, RoPE and the dropouts of a block fused by the compiler, modelled as ``fused_kernels``
  is: ``c_h_fused`` element passes instead of ``c_h``. Both fuse the same passes, so they do not
  stack (one or both: ``c_h_fused``).
* ``tp_comm_overlap`` (with sequence parallelism), paired per layer with the four matmuls ``G``
  (QKV, output, MLP in, MLP out; per GPU, forward) whose inputs or outputs its collectives carry:
  all-gather before QKV and FC1, reduce-scatter after the output and FC2 projections, each
  ``T = (t-1)/t * b s h e / c`` bytes per GPU. Two implementations (``tp_comm_ring``):

  - this project's ring collective matmul (``parallel.tp_comm_overlap``, the local layers): the
    collective is split into ``t - 1`` ring steps of one sequence chunk each (``T_1 = T / (t-1)``
    bytes, one message latency each), and each step's transfer runs while the matmul of the chunk
    already present (``G / t``) computes; the last chunk's matmul has nothing left to hide. Per
    collective ``(t-1) max(0, T_1 - G/t)`` is exposed. The backward mirrors it: the input
    gradient's reduce-scatter (after QKV and FC1) and the output gradient's all-gather (before the
    output and FC2 projections' backward) ride the ring the same way, each step behind one partial
    input-gradient matmul (``G / t``, the forward's size); the weight gradients use the gathered
    input kept from the forward. A layer exposes ``(2 + r) (t-1) sum_G max(0, T_1 - G/t)``
    (``r = 1`` with full recompute, else 0).
  - Megatron-Core with Transformer Engine's userbuffers (the published runs of
    ``planning.calibration``): forward (and recomputed forward) pairs are pipelined in ``t``
    chunks, exposing ``T/t + (t-1)/t * max(0, T - G)``; backward pairs are bulk-overlapped with
    the ``2 G`` of the backward matmuls, exposing ``max(0, T - 2 G)``.
* ``pp_comm_overlap`` (Megatron-Core's ``overlap_p2p_comm``, which NeMo's and Megatron-Bridge's
  recipes turn on whenever the schedule is interleaved, ``v > 1``): in the steady state each
  chunk's send and receive run while the GPU computes its next chunk, exposing
  ``max(0, T_p2p - F_v)`` per forward message and ``max(0, T_p2p - B_v)`` per backward one
  (``F_v``, ``B_v`` one chunk's forward and backward of a micro-batch); the ``2 (p-1)`` messages of
  the warm-up and cool-down stay exposed. This project's layouts turn it on where ``v > 1``:
  torch 2.13's interleaved runtime schedules (``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``) post each receive without
  waiting and wait for it just before the computation that needs it, so the transfers run behind
  the chunks computed meanwhile (``docs/parallelism.md``); plain 1F1B (``v = 1``) does not
  overlap. ``benchmarks/overlap.py`` measures what the transfers expose.
* DP overlap per virtual chunk (``overlap_grad_reduce``, under every schedule): a chunk's gradients
  are reduced once its last micro-batch's backward is done. With ``v`` chunks of backward time
  ``B_v = B / v`` each (``B`` the backward of one micro-batch through the GPU's layers), the last
  chunk's reduction ``R / v`` hides only behind its own backward, the others also behind the
  ``(v-1) p`` chunk backwards of the interleaved cool-down: exposed
  ``max(R/v - B_v, R - B_v (1 + (v-1) p), 0)`` (``v = 1``: ``max(0, R - B)``); off, ``R`` whole.
  With the distributed optimizer and ``overlap_param_gather`` the bf16 weights' all-gather ``A``,
  issued in the order the next forward reads the weights, hides the same way behind the forward
  ``F`` of the next step's first micro-batch; off, ``A`` whole.

Muon (``optim=muon``): its Newton-Schulz iterations and TP all-gathers after each step, not
overlapped (``StepTime.optimizer``, ``planning.muon.step_seconds``); under the distributed
optimizer the busiest owner's Newton-Schulz and the ownership all-gather and reduce-scatter of
the buckets holding Muon's matrices over the DP group's link.

LoRA (frozen weights' gradient matmuls skipped, adapters' added and alone reduced over DP) and
DPO (the reference's forward-only pipeline pass first; its CP and EP exchanges left out): ``planning.frozen``.

Matmul efficiency per GPU generation: ``eta`` is looked up by ``cluster.gpu`` in
``Constants.gpu_eta`` (``planning.calibration.CALIBRATED``), ``Constants.eta`` for the rest.

Calibration. ``eta`` (the achieved fraction of peak of large bf16 matmuls) and ``kappa`` (how many
times the counted element passes the memory-bound kernels really make) were fitted by least
squares on the relative error of TFLOP/s per GPU to the ten rows of Narayanan et al. 2021 (SC21),
Table 1 (``planning.sc21``); ``benchmarks/planner_sc21.py`` prints the fit's per-row error. The
H100 ``eta`` and ``fp8_efficiency`` are fitted on published H100 rows, and checked on rows held
out of the fit (``planning.calibration``, ``benchmarks/planner_validation.py``). The context- and
expert-parallel terms are not calibrated.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from megatron_hydra.config.schema import ClusterConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.planning import context_parallel as cpp
from megatron_hydra.planning import frozen, muon
from megatron_hydra.planning.flops import loss_tokens, model_flops_per_step, window_keys
from megatron_hydra.planning.layer_stacks import (LayerStack, computed_keys, layer_stacks, mlp_units, mlp_widths,
                                                 moe_fraction)

ACT_BYTES = 2
GRAD_BYTES = 4


@dataclass(frozen=True)
class Constants:
    eta: float = 0.726  # achieved fraction of peak of large matmuls (fitted on SC21 Table 1)
    kappa: float = 1.26  # memory-bound traffic relative to the counted passes (fitted on SC21 Table 1)
    link_efficiency: float = 0.75
    latency_s: float = 20e-6
    c_h: float = 12.0
    c_s: float = 5.0
    c_h_fused: float = 6.0  # element passes with Transformer Engine's fused kernels
    # Element passes (of e bytes) over soft-capped scores in plain ops, forward: the matmul writes
    # them (1), scale, cap, tanh, un-cap and mask each read and write them (10), the float32 softmax
    # reads them and writes 4-byte values (3), reads those twice and writes them (6), the cast
    # reads them and writes e bytes (3), the value matmul reads those (1). Counted, not calibrated.
    c_capped: float = 24.0
    gpu_eta: Tuple[Tuple[str, float], ...] = ()  # (cluster.gpu, eta) where it differs from ``eta``
    fp8_efficiency: float = 1.0  # achieved fraction of the FP8 rate relative to bf16's eta
    attention_efficiency: float = 1.0  # flash attention's rate relative to the matmuls' eta

    def matmul_eta(self, gpu: str) -> float:
        return dict(self.gpu_eta).get(gpu, self.eta)


SC21_FIT = Constants()  # eta and kappa of the SC21 fit (planning.sc21.fit)

# Dense FP8 over dense bf16 tensor-core peak (datasheets: H100 SXM 1,979 / 989 TFLOP/s; H200 the
# same chip; B200 4.5 / 2.25 PFLOP/s); the A100 has no FP8 tensor cores.
FP8_PEAK_RATIO = {"H100-SXM5-80GB": 2.0, "H200-SXM-141GB": 2.0, "B200-SXM-180GB": 2.0}

# The shipped constants: SC21's eta and kappa (the A100 and the fallback), the Hopper/Blackwell eta
# and the FP8 efficiency fitted on the fitting rows of ``planning.calibration`` (its ``fit``; the
# B200 has no published row in the fit and takes the H100's value).
_HOPPER_ETA = 0.6
CALIBRATED = replace(SC21_FIT, gpu_eta=(("H100-SXM5-80GB", _HOPPER_ETA), ("H200-SXM-141GB", _HOPPER_ETA),
                                        ("B200-SXM-180GB", _HOPPER_ETA)), fp8_efficiency=0.7633,
                     attention_efficiency=0.43)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    vpp: int = 1
    recompute: Optional[str] = None  # None | selective | full
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    fsdp: bool = False  # parallel.data_parallel=fsdp
    cp: int = 1  # parallel.context_parallel_size
    cp_comm: str = "p2p"  # parallel.cp_comm_type: p2p | a2a
    ep: int = 1  # parallel.expert_parallel_size
    whole_experts: bool = False  # parallel.expert_tensor_parallel_size=1 (with tp > 1)
    flash_attention: bool = True  # scores never in HBM, causal blocks skipped (SDPA / TE on GPU)
    fused_kernels: bool = False  # model.transformer_impl=transformer_engine
    fp8: bool = False  # precision.fp8
    tp_comm_overlap: bool = False  # parallel.tp_comm_overlap (with sequence parallelism)
    tp_comm_ring: bool = False  # True: this project's ring collective matmul; False: TE's userbuffers (Megatron-Core)
    pp_comm_overlap: bool = False  # overlap_p2p_comm (interleaved only); the planner's layouts set it where vpp > 1
    overlap_param_gather: bool = True  # parallel.overlap_param_gather (with the distributed optimizer)
    compiled: bool = False  # trainer.compile: each block's element-wise kernels fused (as fused_kernels)
    reference_forward: bool = False  # objective=dpo: the reference model's forward pass before each step
    muon_ns_steps: int = 0  # optim=muon: Newton-Schulz iterations per step (planning.muon); 0: AdamW
    muon_split_qkv: bool = False  # optim.muon_split_qkv


@dataclass(frozen=True)
class StepTime:
    """Seconds per step and where they go (exposed time on the critical path)."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    model_flops: float  # per step, whole cluster, recompute not counted
    hardware_flops: float  # per step, whole cluster, recompute counted (as SC21 reports)
    gpus: int
    tokens: int
    cp_comm: float = 0.0
    ep_comm: float = 0.0  # expert-parallel all-to-alls
    optimizer: float = 0.0  # optim=muon: Newton-Schulz and its TP all-gathers (planning.muon)

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.cp_comm + self.ep_comm
                + self.optimizer)

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s per GPU, recompute counted: Narayanan et al.'s figure."""
        return self.hardware_flops / self.total / self.gpus / 1e12

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.total / self.gpus / 1e12

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total


def _ring_time(bytes_per_gpu: float, gb_per_s: float, c: Constants, messages: float = 1.0) -> float:
    return bytes_per_gpu / (gb_per_s * 1e9 * c.link_efficiency) + messages * c.latency_s


def _group_link(cluster: ClusterConfig, span: int, members_per_node: int = 1) -> float:
    """Bandwidth per member of a group spread over ``span`` consecutive ranks: NVLink within a
    node, else InfiniBand. A reduction (all-reduce, reduce-scatter, all-gather) whose group has
    ``k = members_per_node`` members on each node runs hierarchically: each member carries ``1/k``
    of its node's inter-node volume over its own adapter, i.e. ``k`` times the adapter's rate for
    the whole message, at most NVLink's. Point-to-point and all-to-all traffic leaves a GPU by its
    own adapter (``k = 1``)."""
    if span <= cluster.gpus_per_node:
        return cluster.nvlink_gb_per_s
    return min(cluster.nvlink_gb_per_s, cluster.ib_gb_per_s * max(1, members_per_node))


def _params_per_gpu(tc: TransformerConfig, lay: Layout) -> tuple:
    """(dense, expert) weights on the most loaded GPU (a middle stage has layers only; the
    embedding stages have the vocabulary too): enough for the gradient volume. Expert weights are
    1/ep per GPU; an MoE layer's router and shared expert count as dense."""
    moe = tc.moe
    experts = 0.0
    if moe is not None:
        experts = moe_fraction(tc) * mlp_units(tc) * tc.hidden_size * moe.ffn_hidden_size * moe.num_experts / lay.ep
    if tc.lora is not None:  # only the adapters have gradients (planning.frozen)
        return frozen.adapter_params_per_rank(tc, lay.tp, tc.num_layers / lay.pp, frozen.dense_layers(tc) / lay.pp), 0.0
    dense = sum(st.layers * st.params for st in layer_stacks(tc)) / lay.pp
    embedding = tc.padded_vocab_size * tc.hidden_size
    return (dense + embedding) / lay.tp, tc.num_layers / lay.pp * experts / (1 if lay.whole_experts else lay.tp)


def ep_layer_seconds(tc: TransformerConfig, lay: Layout, cluster: ClusterConfig, c: Constants) -> float:
    """Seconds of one MoE layer's all-to-alls per micro-batch on one GPU (module docstring)."""
    if tc.moe is None or lay.ep == 1:
        return 0.0
    tokens = lay.micro_batch * tc.seq_length / lay.cp / (lay.tp if lay.whole_experts else 1)
    volume = (lay.ep - 1) / lay.ep * tokens * tc.moe.top_k * tc.hidden_size * ACT_BYTES
    count = 4 + (2 if lay.recompute == "full" else 0)
    if lay.whole_experts:
        span = lay.ep if lay.ep <= lay.tp else lay.ep * lay.cp
    else:
        span = lay.tp * lay.cp * lay.ep
    return count * _ring_time(volume, _group_link(cluster, span), c)


def estimate(tc: TransformerConfig, global_batch: int, lay: Layout, cluster: ClusterConfig,
             c: Constants = CALIBRATED) -> StepTime:
    """Seconds per step of ``lay`` (see the module docstring for every term)."""
    t, p, d, b, v, cp = lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.vpp, lay.cp
    s, h = tc.seq_length, tc.hidden_size
    m = global_batch / (b * d)
    tokens_mb = b * s / cp  # the tokens of a micro-batch one GPU holds
    peak, hbm = cluster.peak_tflops * 1e12 * c.matmul_eta(cluster.gpu), cluster.hbm_gb_per_s * 1e9
    fp8 = lay.fp8 and cluster.gpu in FP8_PEAK_RATIO  # a GPU without FP8 tensor cores runs bf16
    linear_peak = peak * max(1.0, c.fp8_efficiency * FP8_PEAK_RATIO[cluster.gpu]) if fp8 else peak
    stacks = [_stack_seconds(tc, st, lay, cluster, c, peak, linear_peak, hbm) for st in layer_stacks(tc)]
    layers_per_gpu = tc.num_layers / p

    def per_gpu(term) -> float:  # the stacks' per-layer seconds over the GPU's share of their layers
        return sum(st.layers / p * term(x) for st, x in zip(layer_stacks(tc), stacks))

    head_tokens = b * loss_tokens(tc) / cp
    head_fwd = (head_tokens * 2 * h * tc.padded_vocab_size / t / peak
                + c.kappa * ACT_BYTES * head_tokens * 4 * tc.padded_vocab_size / t / hbm)
    head_skipped = head_tokens * 2 * h * tc.padded_vocab_size / t / peak if tc.lora is not None else 0.0  # frozen
    stage_time = per_gpu(lambda x: 3 * x.fwd + x.extra - x.skipped) + 3 * head_fwd - head_skipped  # the last stage
    reference = per_gpu(lambda x: x.fwd - x.adapters) + head_fwd if lay.reference_forward else 0.0

    # Tensor-parallel collectives (per layer and micro-batch, on the critical path).
    tp_stage = per_gpu(lambda x: x.tp)
    cp_stage = per_gpu(lambda x: cp_layer_seconds(tc, lay, cluster, c, block_attention=x.attention / cp)[1])
    ep_stage = layers_per_gpu * moe_fraction(tc) * ep_layer_seconds(tc, lay, cluster, c)

    # Pipeline: 1F1B (interleaved) time and the point-to-point messages.
    busy = m * (stage_time + reference)
    bubble = (p - 1) / v * (stage_time + reference)
    if p > 1:
        link = cluster.ib_gb_per_s if t * cp * d >= cluster.gpus_per_node else cluster.nvlink_gb_per_s
        p2p = _ring_time(tokens_mb * h * ACT_BYTES / t, link, c)
        pp_comm = (2 * v * m + 2 * (p - 1) + (v * m + p - 1) * lay.reference_forward) * p2p
        if lay.pp_comm_overlap and v > 1:  # steady-state transfers behind the next chunk's compute
            chunk_fwd, chunk_bwd = per_gpu(lambda x: x.fwd) / v, per_gpu(lambda x: 2 * x.fwd + x.extra) / v
            pp_comm = v * m * (max(0.0, p2p - chunk_fwd) + max(0.0, p2p - chunk_bwd)) + 2 * (p - 1) * p2p
    else:
        pp_comm = 0.0
    tp_comm = (m + (p - 1) / v) * (tp_stage + (per_gpu(lambda x: x.tp_forward) if lay.reference_forward else 0.0))
    cp_comm = (m + (p - 1) / v) * cp_stage
    ep_comm = (m + (p - 1) / v) * ep_stage

    # Data-parallel gradient reduction, over the d x cp ranks that hold the same weights.
    dp_comm, dc = 0.0, d * cp
    backward_of_last = per_gpu(lambda x: 2 * x.fwd + x.extra - x.skipped) + 2 * head_fwd - head_skipped
    if dc > 1 and lay.fsdp:
        dp_comm = _fsdp_comm(tc, lay, m, cluster, c, stage_time, backward_of_last)
    elif dc > 1:
        dense_params, expert_params = _params_per_gpu(tc, lay)
        link = _group_link(cluster, t * dc, cluster.gpus_per_node // t)
        edc = dc * (t if lay.whole_experts else 1) // lay.ep  # the ranks holding the same experts
        share = (edc - 1) / edc * expert_params if expert_params and edc > 1 else 0.0
        volume = (dc - 1) / dc * dense_params
        if lay.distributed_optimizer:  # reduce-scatter fp32 gradients, all-gather bf16 weights
            reduce = _ring_time(volume * GRAD_BYTES, link, c) + (_ring_time(share * GRAD_BYTES, link, c) if share else 0)
            gather = _ring_time(volume * ACT_BYTES, link, c) + (_ring_time(share * ACT_BYTES, link, c) if share else 0)
        else:
            reduce = _ring_time(volume * 2 * GRAD_BYTES, link, c, 2) + (
                _ring_time(share * 2 * GRAD_BYTES, link, c, 2) if share else 0)
            gather = 0.0
        forward_of_first = per_gpu(lambda x: x.fwd) + head_fwd
        if lay.overlap_grad_reduce:
            dp_comm = _chunk_overlap(reduce, backward_of_last, v, p)
        else:
            dp_comm = reduce
        dp_comm += _chunk_overlap(gather, forward_of_first, v, p) if lay.overlap_param_gather else gather

    gpus = t * p * cp * d
    layer_flops = sum(st.tokens * st.layers * (sum(st.projections) + st.attention) for st in layer_stacks(tc))
    model_flops = 3 * global_batch * (layer_flops + loss_tokens(tc) * 2 * h * tc.padded_vocab_size)
    if tc.lora is not None or lay.reference_forward:  # GPT-family only
        model_flops = model_flops_per_step(tc, global_batch, lay.reference_forward)
    replayed = sum(st.tokens * st.layers * {None: 0.0, "selective": st.attention if lay.cp == 1 else 0.0,
                                            "full": sum(st.projections) + st.attention}[lay.recompute]
                   for st in layer_stacks(tc))
    return StepTime(compute=busy, bubble=bubble, tp_comm=tp_comm, pp_comm=pp_comm, dp_comm=dp_comm,
                    model_flops=model_flops, hardware_flops=model_flops + global_batch * replayed, gpus=gpus,
                    tokens=global_batch * s, cp_comm=cp_comm, ep_comm=ep_comm, optimizer=muon.step_seconds(
                        tc, layers_per_gpu, t, lay.muon_ns_steps, peak, lambda x: _ring_time(x, _group_link(cluster, t), c),
                        lay.muon_split_qkv, lay.ep, *_muon_owners(lay, d * cp), grad_bytes=GRAD_BYTES,
                        dp_time=lambda x, n: _ring_time(x, _group_link(cluster, t * d * cp, cluster.gpus_per_node // t),
                                                        c, n)) if lay.muon_ns_steps else 0.0)


def _muon_owners(lay: Layout, dc: int) -> tuple:
    """(dense, expert) owners of Muon's matrices under the distributed optimizer: dp x cp, and the
    expert data-parallel group; (1, 1) without it (every rank steps every matrix)."""
    if not lay.distributed_optimizer:
        return 1, 1
    return dc, max(1, dc * (lay.tp if lay.whole_experts else 1) // lay.ep)


@dataclass(frozen=True)
class _LayerSeconds:
    fwd: float  # one layer's forward, one micro-batch, one GPU
    extra: float  # what recompute replays of it in the backward
    attention: float  # its attention's matmuls and memory-bound passes (the forward of one CP block x cp)
    tp: float  # its exposed tensor-parallel collectives
    skipped: float = 0.0  # LoRA: the frozen weights' gradient matmuls its backward skips (as long as the forward's)
    adapters: float = 0.0  # LoRA: its adapters' forward matmuls (in ``fwd``)
    tp_forward: float = 0.0  # its forward's tensor-parallel collectives (DPO's reference pass)


def _stack_seconds(tc: TransformerConfig, st: LayerStack, lay: Layout, cluster: ClusterConfig, c: Constants,
                   peak: float, linear_peak: float, hbm: float) -> _LayerSeconds:
    """One layer of ``st``: forward matmul and memory-bound seconds, recompute, TP collectives."""
    t = lay.tp
    tokens_mb = lay.micro_batch * st.tokens / lay.cp
    projections = [tokens_mb * x / t / linear_peak for x in st.projections]
    if lay.flash_attention:
        mm_attn = tokens_mb * (st.attention_fused / (peak * c.attention_efficiency) + st.attention_plain / peak) / t
        score_passes = c.c_capped * st.capped
    else:
        mm_attn, score_passes = tokens_mb * st.attention_dense / t / peak, c.c_s
    adapters = tokens_mb * frozen.adapter_flops_per_rank(tc, t) / peak  # LoRA's, in bf16 (0 without)
    mm_dense = sum(projections) + adapters
    h_rep = tc.hidden_size / t if lay.sequence_parallel else tc.hidden_size
    x = moe_fraction(tc)
    f = (1 - x) * tc.ffn_hidden_size + x * mlp_widths(tc)[1]
    passes = (c.c_h_fused if lay.fused_kernels or lay.compiled else c.c_h) * st.branches / 2  # fusions do not stack
    mem_h = c.kappa * ACT_BYTES * tokens_mb * (passes * h_rep + 2 * f / t) / hbm
    keys = st.attention_dense / (4 * tc.kv_channels)  # a s: the scores per query of every head
    mem_s = c.kappa * ACT_BYTES * tokens_mb * score_passes * keys / t / hbm
    fwd = mm_dense + mm_attn + mem_h + mem_s
    selective = 0.0 if lay.cp > 1 else mm_attn + mem_s  # CP attention is not replayed (selective)
    extra = {None: 0.0, "selective": selective, "full": fwd}[lay.recompute]
    return _LayerSeconds(fwd, extra, mm_attn + mem_s, tp_layer_seconds(tc, lay, cluster, c, projections, st),
                         sum(projections) * (tc.lora is not None), adapters,
                         tp_layer_seconds(tc, lay, cluster, c, projections, st, forward_only=True))


def _chunk_overlap(comm: float, compute: float, v: int, p: int) -> float:
    """Exposed seconds of a data-parallel exchange of ``v`` virtual chunks, each started after its
    chunk's last micro-batch (module docstring: DP overlap per virtual chunk)."""
    chunk = compute / v
    return max(0.0, comm / v - chunk, comm - chunk * (1 + (v - 1) * p))


def tp_layer_seconds(tc: TransformerConfig, lay: Layout, cluster: ClusterConfig, c: Constants,
                     projections: list, stack: Optional[LayerStack] = None, forward_only: bool = False) -> float:
    """Exposed seconds of one layer's tensor-parallel collectives per micro-batch on one GPU;
    ``projections`` are the forward seconds of the layer's matmuls (QKV, output, MLP in, MLP out),
    ``stack`` the layer's kind (default: GPT's layers). The communication overlap pairs those four
    matmuls with their collectives; T5's decoder layers (more of both) run without it.
    ``forward_only``: a forward pass's alone (DPO's reference), not overlapped."""
    t = lay.tp
    if t == 1:
        return 0.0
    st = stack or layer_stacks(tc)[0]
    link = _group_link(cluster, t)
    replays = 1 if lay.recompute == "full" else 0

    def message(tokens: int) -> float:  # bytes per GPU of an all-reduce over ``tokens`` per sample
        return 2 * (t - 1) / t * lay.micro_batch * tokens / lay.cp * tc.hidden_size * ACT_BYTES

    if forward_only:
        return sum(_ring_time(message(n), link, c) for n in st.tp_forward)
    exposed = ((1 + replays) * sum(_ring_time(message(n), link, c) for n in st.tp_forward)
               + sum(_ring_time(message(n), link, c) for n in st.tp_backward))
    if not lay.tp_comm_overlap or len(projections) != 4:
        return exposed
    if lay.tp_comm_ring:  # one ring step's transfer (1/(t-1) of the collective) behind each partial matmul
        step = _ring_time(message(st.tokens) / 2 / (t - 1), link, c)
        return (2 + replays) * (t - 1) * sum(max(0.0, step - g / t) for g in projections)
    half = _ring_time(message(st.tokens) / 2, link, c)
    pipelined = sum(half / t + (t - 1) / t * max(0.0, half - g) for g in projections)
    bulk = sum(max(0.0, half - 2 * g) for g in projections)
    return min(exposed, (1 + replays) * pipelined + bulk)  # latency-bound messages: overlap off


def cp_layer_seconds(tc: TransformerConfig, lay: Layout, cluster: ClusterConfig, c: Constants,
                     block_attention: float) -> tuple:
    """(raw, exposed) seconds of context parallelism's exchanges per layer and micro-batch on one
    GPU; ``block_attention`` is the forward attention of one K/V block (module docstring)."""
    t, cp, b, s, k = lay.tp, lay.cp, lay.micro_batch, tc.seq_length, tc.kv_channels
    if cp == 1:
        return 0.0, 0.0
    link = _group_link(cluster, t * cp)
    replays = 1 if lay.recompute == "full" else 0  # selective recompute leaves CP attention alone
    if lay.cp_comm == "p2p":
        kv = cpp.kv_block_bytes(b, s, cp, tc.num_query_groups, k, t, ACT_BYTES)
        return _ring_over_layers(tc, lay, _ring_time(kv, link, c), block_attention, replays)
    tensor = cpp.a2a_tensor_bytes(b, s, cp, tc.num_attention_heads, k, t, ACT_BYTES)
    seconds = cpp.a2a_seconds(cp, tensor, lambda x: _ring_time(x, link, c), replays)
    return seconds, seconds


def _ring_over_layers(tc: TransformerConfig, lay: Layout, transfer: float, block_attention: float,
                      replays: int) -> tuple:
    """The ring's (raw, exposed) seconds averaged over the layers. ``block_attention`` is the
    layers' mean; under flash attention each layer computes its own share of it
    (``computed_keys``), a binding window's unevenly over the ring's steps
    (``context_parallel.ring_step_weights``)."""
    s, cp, layers = tc.seq_length, lay.cp, range(tc.num_layers)
    kinds = Counter((tc.windowed(i) if window_keys(s, tc.windowed(i)) < s else None,
                     sum(computed_keys(tc, i)) if lay.flash_attention else 1.0) for i in layers)
    mean = sum(keys * n for (_, keys), n in kinds.items()) / tc.num_layers
    raw = exposed = 0.0
    for (window, keys), n in kinds.items():
        r, e = cpp.ring_seconds(cp, transfer, block_attention * keys / mean, replays,
                                cpp.ring_step_weights(cp, s, window))
        raw, exposed = raw + r * n / tc.num_layers, exposed + e * n / tc.num_layers
    return raw, exposed


def _fsdp_comm(tc: TransformerConfig, lay: Layout, m: float, cluster: ClusterConfig, c: Constants,
               stage_time: float, backward_of_last: float) -> float:
    """Exposed seconds of FSDP's traffic: every micro-batch all-gathers the rank's 16-bit weights
    for its forward and, at pp = 1 (blocks resharded after forward), again for its backward; the
    gathers are prefetched under the micro-batch's own compute, which hides them up to its length.
    The fp32 gradients are reduce-scattered once, after the last micro-batch, under its backward."""
    d = lay.dp * lay.cp
    params = sum(_params_per_gpu(tc, lay))
    blocks = tc.num_layers / lay.pp + 1
    gathers = 2 if lay.pp == 1 else 1
    link = _group_link(cluster, lay.tp * d, cluster.gpus_per_node // lay.tp)
    gather = gathers * _ring_time((d - 1) / d * params * ACT_BYTES, link, c, blocks)
    reduce = _ring_time((d - 1) / d * params * GRAD_BYTES, link, c, blocks)
    return m * max(0.0, gather - stage_time) + max(0.0, reduce - backward_of_last)
