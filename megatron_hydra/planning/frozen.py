"""Frozen weights in the plans: LoRA's frozen base (``peft=lora``) and DPO's frozen reference
(``objective=dpo``). ``planning.memory``, ``planning.flops`` and ``planning.performance`` ask here
what they change.

State. Under LoRA the base's parameters keep their weights (params dtype) and nothing else: no
gradient buffer, no fp32 main copy, no Adam state (``models.lora.freeze_base``; the gradient
buffer and the optimizer skip them). The adapters are the buffer and the optimizer's parameters:
their grads, main copy and Adam state follow the plan's byte rules, sharded over dp x cp by the
distributed optimizer. DPO without LoRA keeps a frozen copy of the policy (``training.dpo``: the
same stages and shards, built apart from the gradient buffer), its weights unpadded in the params
dtype and its buffers (rotary tables) beside them; under LoRA the reference is the base with the
adapters off, and nothing is added.

Activations. Autograd keeps what a backward needs for the inputs that require a gradient, and
no more: ``F.linear`` with a frozen weight keeps the weight (a parameter already counted), not its
input, which only the weight's gradient reads. So with the base frozen, a layer's linear inputs are
kept only where an adapter reads them (its A's gradient does) or another op keeps the same tensor
(the fused attention kernel its output, which is the projection's input; ReLU its output, which is
fc2's); norms, activation functions, attention and dropout still keep theirs, whose input
gradients the earlier adapters need. Per layer and micro-batch, T = b s / cp tokens, r the rank,
v and m the activation and dropout-mask bytes (``planning.activations``), i the inputs' share
under sequence parallelism (1: the column-parallel inputs are gathered), a layer whose input
requires a gradient differs from a trained one by:

    qkv input            - v T h i           without a qkv adapter
    projection input     - v T a d / t       without a proj adapter, unless the fused kernel
                                             keeps it (not under selective recompute)
    fc1 (and gate) input - v T h i           without an fc1 or gate adapter
    fc2 input            - v T f / t         without an fc2 adapter (ReLU keeps it anyway)
    each adapter         + v T r             its A x ([T, r]: qkv's three, [T, 3r]), which B's
                                             gradient reads
    qkv's A              + v 3 r h           the three A's concatenated for one matmul
    adapter dropout      + (v + m) T n       per adapter of n local inputs: the dropped copy and
                                             its mask; its layer's input then counts as above,
                                             as if no adapter read it

The first layer of the first stage reads an input without a gradient (the frozen embedding's
output): its graph starts at its first adapter, and ``layer_bytes(input_grad=False)`` follows the
gradient from there through the layer (with a qkv adapter: its first norm keeps nothing, nor
does qkv's A concatenation or its adapter dropout mask; without one nothing of attention before
the first adapted layer; past it, the MLP's tensors only where a gradient reaches them). A later
stage's input has a gradient. Outside the layers the frozen embedding keeps neither the token ids
nor its dropout mask, and the frozen LM head not its input (- v T h). A Mixture-of-Experts
layer's experts are counted as trained (an upper bound). Recompute: a checkpointed region keeps
its input as before; its replay is one region of the layers above.

FLOPs. A frozen weight gets no gradient: the backward of a linear layer runs its input-gradient
matmul only (as long as the forward) instead of two, attention's matmuls still both; each
adapter costs 2 r (n_in + n_out) FLOPs per token forward and twice that backward. DPO adds the
reference model's forward over every sample (the base's, without adapters, under LoRA). The step
time runs these on each rank's share: a column-parallel layer's A (and a row-parallel layer's B)
whole on every tensor-parallel rank, the other factor split.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

from megatron_hydra.config.derive import derive
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.errors import ConfigError

COLUMN = ("qkv", "fc1", "gate")  # column-parallel targets: A replicated, B split by output (the others: by input)


# Parameters ---------------------------------------------------------------------------------------

def adapter_widths(tc: TransformerConfig) -> Dict[str, tuple]:
    """(input width, output width, A matrices) of each target layer's adapter, logical (unsharded).
    qkv has one A per projection (q, k, v, as ``peft`` adapts them)."""
    h, d, a, g, f = tc.hidden_size, tc.kv_channels, tc.num_attention_heads, tc.num_query_groups, tc.ffn_hidden_size
    return {"qkv": (h, (a + 2 * g) * d, 3), "proj": (a * d, h, 1), "fc1": (h, f, 1), "gate": (h, f, 1),
            "fc2": (f, h, 1)}


def dense_layers(tc: TransformerConfig) -> int:
    return tc.num_layers - (len(tc.moe_layers) if tc.moe is not None else 0)


def adapter_params_per_rank(tc: TransformerConfig, tp: int, layers: float, dense_layers: float) -> float:
    """Adapter elements a tensor-parallel rank holds over ``layers`` layers, ``dense_layers`` of
    them with a dense MLP (the experts of MoE layers are not adapted). Twice that is the
    adapters' forward FLOPs per token there: each element is one multiply-add per token."""
    spec = tc.lora
    if spec is None:
        return 0.0
    total = 0.0
    for target in spec.targets:
        n_in, n_out, heads = adapter_widths(tc)[target]
        a, b = spec.rank * n_in * heads, spec.rank * n_out
        per_layer = a + b / tp if target in COLUMN else a / tp + b
        total += per_layer * (layers if target in ("qkv", "proj") else dense_layers)
    return total


# Activations --------------------------------------------------------------------------------------

def layer_bytes(tc: TransformerConfig, layer: dict, recompute: Optional[str] = None, mlp: bool = True,
                input_grad: bool = True) -> float:
    """Bytes a LoRA layer keeps beyond a trained layer's (``activation_bytes_per_layer``; module
    docstring); 0 without LoRA and for a checkpointed region's input. ``mlp=False``: the
    attention's terms alone (an MoE layer has no dense MLP); ``input_grad=False``: the first layer
    of the first stage, whose input has no gradient."""
    spec = tc.lora
    if spec is None or recompute == "full":
        return 0.0
    part = _parts(layer, recompute)
    targets, dropped, g = set(spec.targets), spec.dropout > 0, input_grad
    v, m, tokens = part["v"], part["m"], part["T"]
    delta = 0.0

    def keep(name: str, kept: bool) -> None:
        nonlocal delta
        delta -= 0.0 if kept else part[name]

    def adapter(target: str, inputs: float, grad: bool, segments: int = 1) -> None:
        """A x ([T, segments r]), which B's gradient reads; the dropped input, and its mask where
        the input has a gradient, once per segment (q, k and v draw masks of their own)."""
        nonlocal delta
        if target in targets:
            delta += v * tokens * segments * spec.rank + ((v + m * grad) * inputs * segments if dropped else 0.0)

    read = {t: t in targets and not dropped for t in ("qkv", "proj", "fc1", "gate", "fc2")}  # A keeps the input
    g_qkv = g or "qkv" in targets
    keep("norm1", g)
    keep("core", g_qkv)
    keep("qkv_in", read["qkv"])
    adapter("qkv", part["qkv_in"] / v, g, 3)
    delta += v * 3 * spec.rank * part["h"] if "qkv" in targets and g and not dropped else 0.0  # the A's concatenated
    fused_keeps = g_qkv and (layer["cp"] > 1 or (layer["attention"] == "fused" and recompute != "selective"))
    keep("proj_in", read["proj"] or fused_keeps)
    adapter("proj", part["proj_in"] / v, g_qkv)
    g_attn = g_qkv or "proj" in targets
    keep("attn_out", g_attn)
    if not mlp:
        return delta
    g_mid = g or g_attn
    keep("norm2", g_mid)
    keep("fc1_in", read["fc1"] or read["gate"])
    adapter("fc1", part["fc1_in"] / v, g_mid)
    adapter("gate", part["fc1_in"] / v, g_mid)
    g_up, g_gate = g_mid or "fc1" in targets, g_mid or "gate" in targets
    hidden = part["hidden"]  # one f-wide tensor
    if layer["gated"]:  # act(gate) * up keeps: gate (act's input), act(gate) (for up), up (for act), product
        delta -= hidden * ((not g_gate) + (not g_up) + (not g_gate) + (not read["fc2"]))
        g_hidden = g_up or g_gate
    elif layer["relu"]:  # its output, which is fc2's input
        delta -= 0.0 if g_up or read["fc2"] else hidden
        g_hidden = g_up
    else:
        delta -= hidden * ((not g_up) + (not read["fc2"]))
        g_hidden = g_up
    adapter("fc2", hidden / v, g_hidden)
    keep("mlp_out", g_hidden or "fc2" in targets)
    return delta


def _parts(layer: dict, recompute: Optional[str]) -> dict:
    """The bytes of a trained layer (``planning.activations``) by where they are kept: each norm's
    input, the linear layers' inputs, the MLP's f-wide tensors (``hidden``: one of them), the
    dropout masks and post-norms after each branch, and the attention's own (``core``: Q, K, V
    and what the kernel keeps: the rest of the layer's total)."""
    from megatron_hydra.planning.activations import activation_bytes_per_layer

    tp, sp, v = layer["tp"], layer["sequence_parallel"], layer["value_bytes"]
    r = 1.0 / tp if sp else 1.0
    i = 1.0 if sp and layer["sp_gathered_inputs"] else r
    h, b = layer["hidden"], layer["micro_batch"]
    tokens = layer["seq"] / layer["cp"] * b
    d = layer["kv_channels"] or h // layer["heads"]
    f = layer["ffn_hidden"] or 4 * h
    norm = v * tokens * h * r + ((v * h + max(0, 4 - v) * tokens * h * r) if layer["zero_centered"] else 0.0)
    branch_out = (layer["mask_bytes"] * tokens * h * r if layer["hidden_dropout"] else 0.0) + norm * layer["post_norms"]
    units = 4 if layer["gated"] else 1 if layer["relu"] else 2
    part = dict(norm1=norm, qkv_in=v * tokens * h * i, proj_in=v * tokens * layer["heads"] * d / tp,
                attn_out=branch_out, norm2=norm, fc1_in=v * tokens * h * i, hidden=v * tokens * f / tp,
                mlp_out=branch_out)
    rest = sum(part.values()) + (units - 1) * part["hidden"]
    full = activation_bytes_per_layer(**{**layer, "recompute": recompute})
    return {**part, "core": full - rest, "v": v, "m": layer["mask_bytes"], "T": tokens, "h": h}


def first_layer_bytes(tc: TransformerConfig, layer: dict) -> float:
    """What the first layer of the first stage keeps beyond the other layers under LoRA (at most
    0): its input has no gradient (module docstring)."""
    return layer_bytes(tc, layer, input_grad=False) - layer_bytes(tc, layer)


def outside_bytes(tc: TransformerConfig, layer: dict, embedding: float, head_tokens: float) -> tuple:
    """(first-stage, last-stage) change of the bytes kept outside the layers under LoRA: the frozen
    embedding keeps nothing of its ``embedding`` bytes, the frozen LM head not its input of
    ``head_tokens`` per sample."""
    if tc.lora is None:
        return 0.0, 0.0
    head_input = layer["value_bytes"] * head_tokens * layer["micro_batch"] * layer["hidden"]
    return -embedding, -head_input


# The DPO reference ------------------------------------------------------------------------------

def reference_bytes(objective: str, tc: TransformerConfig, params: int, buffers: int, shards: int = 1) -> int:
    """Bytes of DPO's frozen reference on a rank that holds ``params`` parameter elements and
    ``buffers`` bytes of buffers (module docstring): its weights (1/``shards`` of them under
    FSDP) and buffers; nothing under LoRA or for the lm objective."""
    if objective != "dpo" or tc.lora is not None:
        return 0
    return -(-params // shards) * tc.params_dtype.itemsize + buffers


def plan_notes(cfg, derived, rows, plan_memory) -> list:
    """``mode=plan``'s lines on LoRA (what trains, and the optimizer-side bytes against the same
    run with every weight trained, planned by ``plan_memory`` unless it is None) and on DPO's
    reference."""
    notes = []
    if derived.transformer.lora is not None:
        full = copy.deepcopy(cfg)
        full.peft.name, full.peft.adapter = "none", None
        try:
            other = plan_memory(full, derive(full)).ranks if plan_memory is not None else []
        except ConfigError:
            other = []
        row = max(rows, key=lambda r: r.params - r.frozen_params)

        def state(rs) -> int:
            return max(r.grad_bytes + r.main_weight_bytes + r.optimizer_bytes for r in rs)

        trained = row.params - row.frozen_params
        notes.append(f"peft=lora: {trained:,} of {row.params:,} parameters train on {row.position} "
                     f"({trained / row.params:.2%}); grads + main weights + optimizer "
                     f"{state(rows) / 2**30:.3f} GiB per rank"
                     + (f", {state(other) / 2**30:.2f} GiB with every weight trained (peft=none)" if other else ""))
    if cfg.objective.name == "dpo":
        notes.append("objective=dpo: the reference model is " + (
            "the base with the adapters off (no copy)" if derived.transformer.lora is not None else
            f"a frozen copy of the policy, {max(r.reference_bytes for r in rows) / 2**30:.2f} GiB per rank "
            "(reference)") + "; its forward-only pass keeps no activations")
    return notes


# FLOPs ------------------------------------------------------------------------------------------

def adapter_flops_per_token(tc: TransformerConfig) -> float:
    """Forward FLOPs of every adapter of the model per token (module docstring)."""
    return 2 * adapter_params_per_rank(tc, 1, tc.num_layers, dense_layers(tc))


def adapter_flops_per_rank(tc: TransformerConfig, tp: int) -> float:
    """Forward FLOPs per token of one layer's adapters (the mean over layers) on one tensor-parallel
    rank: a column-parallel adapter's A and a row-parallel adapter's B run whole on every rank."""
    return 2 * adapter_params_per_rank(tc, tp, 1, dense_layers(tc) / tc.num_layers)


def training_flops(tc: TransformerConfig, linear: float, attention: float, head: float,
                   reference_forward: bool = False) -> float:
    """A step's FLOPs from the forward's ``linear`` (QKV, projection, MLP), ``attention`` (its two
    matmuls) and ``head`` FLOPs: 3x the forward when every weight trains; under LoRA the frozen
    weights' gradients are skipped and the adapters added; DPO's reference forward on top."""
    if tc.lora is None:
        train = 3 * (linear + attention + head)
    else:
        train = 2 * (linear + head) + 3 * attention + 3 * adapter_flops_per_token(tc)
    return train + (linear + attention + head if reference_forward else 0.0)
