"""The model: Megatron-LM's shape and architecture flags as ``model.*`` keys, with Megatron-LM's
own rules where a value is left out (``validate_args`` and ``core_transformer_config_from_args``).

- ``--ffn-hidden-size`` absent: 4 x hidden, or with ``--swiglu`` int(4 x hidden x 2/3 / 64) x 64
  (ours would round 8/3 x hidden up to a multiple of 256, so the size is always written out);
- ``--group-query-attention`` turns ``--num-query-groups`` on (default 1: multi-query attention);
  without it the groups flag is ignored and attention is multi-head;
- ``--kv-channels`` absent: hidden / heads, as here;
- GeLU: Megatron-Core's MLP computes the tanh form through its bias-GeLU fusion (on by default,
  off with ``--no-bias-gelu-fusion`` or without biases) or Transformer Engine's activation
  (``--use-te-activation-func``), the exact form otherwise; ``--openai-gelu`` is read by
  ``--use-legacy-models``' MLP only;
- rotary base, percent, ``--rotary-seq-len-interpolation-factor`` (positions divided by it:
  ``rope_scaling.type=linear``) and ``--use-rope-scaling`` (Llama 3.1's, with its fixed
  8192 / 1 / 4);
- ``--apply-layernorm-1p``: norm weights w applied as (1 + w), our ``zero_centered_gamma``;
- ``--window-size L,0``: a query sees itself and L keys before it, our window L + 1.
"""

from __future__ import annotations

import ast
import re
from typing import Any, List, Optional

from megatron_hydra.config.derive import size_defaults
from megatron_hydra.migrate.translation import Translation

POSITIONS = {"learned_absolute": "learned", "rope": "rope"}
NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
LEGACY = "the model here is Megatron-Core's GPT form"


def translate_model(t: Translation) -> None:
    cl = t.cl
    for flag in REQUIRED:
        if not cl.given(flag):
            t.refuse(flag, "Megatron-LM requires it: add it (the model's shape cannot be translated without it)")
    hidden, heads = cl.get("--hidden-size"), cl.get("--num-attention-heads")
    for flag, key in zip(REQUIRED, ("num_layers", "hidden_size", "num_attention_heads", "seq_length")):
        if cl.given(flag):
            t.set(f"model.{key}", cl.get(flag), flag)
    if hidden and heads:
        _attention(t, hidden, heads)
        _mlp(t, hidden, heads)
    _positions(t)
    _norms_and_the_rest(t)


def _attention(t: Translation, hidden: int, heads: int) -> None:
    cl = t.cl
    if cl.get("--group-query-attention"):
        groups = cl.get("--num-query-groups")
        t.set("model.num_query_groups", None if groups == heads else groups, "--group-query-attention",
              "--num-query-groups")
    else:
        t.ignore("--num-query-groups", "Megatron-LM reads it with --group-query-attention only: multi-head "
                                       "attention")
    if cl.given("--kv-channels"):
        kv = cl.get("--kv-channels")
        if hidden % heads == 0 and kv == hidden // heads:
            t.ignore("--kv-channels", "it equals hidden / heads, the default here too")
        else:
            t.set("model.kv_channels", kv, "--kv-channels")
    if cl.given("--window-size"):
        _window(t)


def _window(t: Translation) -> None:
    cl = t.cl
    sizes = [int(x) for x in re.findall(r"-?\d+", cl.get("--window-size"))]
    if len(sizes) != 2 or sizes[1] != 0 or sizes[0] < 0:
        t.refuse("--window-size", "only causal windows (L,0) exist here")
        return
    t.set("model.sliding_window", sizes[0] + 1, "--window-size")
    skip = cl.get("--window-attn-skip-freq")
    if skip is not None:
        pattern = _pattern(skip)
        if pattern is None:
            t.refuse("--window-attn-skip-freq", "not an integer or a list pattern such as ([1]*3+[0])*2")
        else:
            t.set("model.sliding_window_pattern", pattern, "--window-attn-skip-freq")


def _mlp(t: Translation, hidden: int, heads: int) -> None:
    cl = t.cl
    swiglu = cl.get("--swiglu")
    if cl.given("--ffn-hidden-size"):
        ffn, flag = cl.get("--ffn-hidden-size"), "--ffn-hidden-size"
    else:
        ffn, flag = (int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden), "--swiglu"
    ours = size_defaults(hidden, heads, "swiglu" if swiglu else "gelu", cl.get("--seq-length") or 1)
    if ffn == ours["ffn_hidden_size"]:
        t.ignore("--ffn-hidden-size", "it equals the default here")
    else:
        t.set("model.ffn_hidden_size", ffn, flag)
    if swiglu:
        t.set("model.activation", "swiglu", "--swiglu")
        for flag in ("--openai-gelu", "--no-bias-gelu-fusion"):
            t.ignore(flag, "--swiglu replaces GeLU")
        t.ignore("--use-te-activation-func", "Transformer Engine's SwiGLU kernel: the same function")
        t.ignore("--use-legacy-models", LEGACY)
    else:
        _gelu(t)


def _gelu(t: Translation) -> None:
    """Which GeLU Megatron-LM computes: the tanh form wherever a fused or Transformer Engine
    kernel runs it, the exact one in the unfused local MLP. Without biases there is no fusion
    (Megatron-LM turns it off)."""
    cl = t.cl
    unfused = tuple(f for f in ("--no-bias-gelu-fusion", "--disable-bias-linear") if cl.get(f))
    if cl.get("--use-legacy-models"):  # its own MLP: --openai-gelu, else as fused; no Transformer Engine activation
        t.ignore("--use-te-activation-func", "--use-legacy-models' MLP does not read it")
        t.ignore("--use-legacy-models", LEGACY)
        if cl.get("--openai-gelu"):
            activation, flags = "gelu_tanh", ("--openai-gelu", "--use-legacy-models")
            t.ignore("--no-bias-gelu-fusion", "--openai-gelu chooses the GeLU")
        else:
            activation, flags = ("gelu" if unfused else "gelu_tanh"), unfused
    else:
        t.ignore("--openai-gelu", "only --use-legacy-models' MLP reads it, not Megatron-Core's")
        if cl.get("--use-te-activation-func") and cl.get("--transformer-impl") == "transformer_engine":
            if not unfused:
                t.refuse("--use-te-activation-func", "Megatron-Core refuses it with the bias-GeLU fusion, which is on "
                                                     "by default: add --no-bias-gelu-fusion")
            activation, flags = "gelu_tanh", ("--use-te-activation-func",)
            t.ignore("--no-bias-gelu-fusion", "Transformer Engine's activation runs instead (--use-te-activation-func)")
        else:
            activation, flags = ("gelu" if unfused else "gelu_tanh"), unfused
            t.ignore("--use-te-activation-func", "under --transformer-impl local Megatron-Core runs torch's exact GeLU "
                                                 "through it, as here")
    t.set("model.activation", activation, *flags)


def _positions(t: Translation) -> None:
    cl = t.cl
    kind = "rope" if cl.get("--use-rotary-position-embeddings") else cl.get("--position-embedding-type")
    if kind not in POSITIONS:
        t.refuse("--position-embedding-type", f"{kind} positions are not a GPT feature here: use rope or "
                                              "learned_absolute")
        kind = "learned_absolute"
    flags = ("--position-embedding-type", "--use-rotary-position-embeddings")
    t.set("model.position_embedding", POSITIONS[kind], *flags)
    if cl.get("--no-position-embedding"):
        if kind == "rope":
            t.ignore("--no-position-embedding", "rotary positions have no learned position table anyway")
        else:
            t.refuse("--no-position-embedding", "a GPT without positions is not a model feature here")
    seq, max_pos = t.cl.get("--seq-length"), cl.get("--max-position-embeddings")
    if max_pos is None:
        t.notes.append("--max-position-embeddings is missing: Megatron-LM requires it; here it defaults to "
                       "--seq-length")
    elif max_pos == seq:
        t.ignore("--max-position-embeddings", "it equals --seq-length, the default here")
    else:
        t.set("model.max_position_embeddings", max_pos, "--max-position-embeddings")
    rope_flags = ("--rotary-base", "--rotary-percent", "--rotary-seq-len-interpolation-factor", "--use-rope-scaling",
                  "--rope-scaling-factor")
    if kind != "rope":
        for flag in rope_flags:
            t.ignore(flag, "Megatron-LM reads it with rotary positions only")
        return
    t.set("model.rope_theta", float(cl.get("--rotary-base")), "--rotary-base")
    if cl.get("--rotary-percent") != 1.0:
        t.refuse("--rotary-percent", "rotary embeddings here rotate the whole head (partial rotary is not a "
                                     "model feature)")
    elif cl.given("--rotary-percent"):
        t.ignore("--rotary-percent", "1.0: the whole head rotates, as here")
    _rope_scaling(t)


def _rope_scaling(t: Translation) -> None:
    cl = t.cl
    linear, llama3 = cl.get("--rotary-seq-len-interpolation-factor"), cl.get("--use-rope-scaling")
    if linear is not None and llama3:
        t.refuse("--rotary-seq-len-interpolation-factor", "Megatron-LM applies it on top of --use-rope-scaling; "
                                                          "here a model has one RoPE scaling")
    elif linear is not None:
        t.set("model.rope_scaling.type", "linear", "--rotary-seq-len-interpolation-factor")
        t.set("model.rope_scaling.factor", float(linear), "--rotary-seq-len-interpolation-factor")
    elif llama3:
        flags = ("--use-rope-scaling", "--rope-scaling-factor")
        for key, value in (("type", "llama3"), ("factor", float(cl.get("--rope-scaling-factor"))),
                           ("original_max_position_embeddings", 8192), ("low_freq_factor", 1.0),
                           ("high_freq_factor", 4.0)):
            t.set(f"model.rope_scaling.{key}", value, *flags)
    else:
        t.ignore("--rope-scaling-factor", "Megatron-LM reads it with --use-rope-scaling only")


def _norms_and_the_rest(t: Translation) -> None:
    cl = t.cl
    norm = cl.get("--normalization")
    if norm not in NORMS:
        t.refuse("--normalization", "use LayerNorm or RMSNorm")
    else:
        t.set("model.normalization", NORMS[norm], "--normalization")
    t.set("model.norm_eps", cl.get("--norm-epsilon"), "--norm-epsilon")
    t.set("model.zero_centered_gamma", bool(cl.get("--apply-layernorm-1p")), "--apply-layernorm-1p")
    bias = not cl.get("--disable-bias-linear")
    t.set("model.add_bias_linear", bias, "--disable-bias-linear")
    if cl.get("--add-qkv-bias") and not bias:
        t.set("model.qkv_bias", True, "--add-qkv-bias")
    elif cl.given("--add-qkv-bias"):
        t.ignore("--add-qkv-bias", "every linear layer has a bias already")
    t.set("model.qk_norm", bool(cl.get("--qk-layernorm")), "--qk-layernorm")
    t.set("model.tie_embeddings", not cl.get("--untie-embeddings-and-output-weights"),
          "--untie-embeddings-and-output-weights")
    t.set("model.hidden_dropout", cl.get("--hidden-dropout"), "--hidden-dropout")
    t.set("model.attention_dropout", cl.get("--attention-dropout"), "--attention-dropout")
    t.set("model.init_std", cl.get("--init-method-std"), "--init-method-std")
    t.set("model.make_vocab_size_divisible_by", cl.get("--make-vocab-size-divisible-by"),
          "--make-vocab-size-divisible-by")
    impl = cl.get("--transformer-impl")
    if cl.given("--transformer-impl"):
        if impl in ("local", "transformer_engine"):
            t.set("model.transformer_impl", impl, "--transformer-impl")
        else:
            t.refuse("--transformer-impl", "use local or transformer_engine")
    elif not cl.given("--fp8-format"):
        t.notes.append("model.transformer_impl=local: Megatron-LM's default is transformer_engine (the same "
                       "layers); set model.transformer_impl=transformer_engine where it is installed")
    _moe(t)


def _moe(t: Translation) -> None:
    cl = t.cl
    moe_flags = [f for f in cl.raw if f.startswith("--moe-")]
    if not cl.given("--num-experts"):
        for flag in moe_flags:
            t.ignore(flag, "Megatron-LM reads it with --num-experts only")
        return
    topk, score = cl.get("--moe-router-topk"), cl.get("--moe-router-score-function")
    moe: dict = dict(num_experts=(cl.get("--num-experts"), "--num-experts"), top_k=(topk, "--moe-router-topk"))
    if cl.given("--moe-ffn-hidden-size"):
        moe["ffn_hidden_size"] = (cl.get("--moe-ffn-hidden-size"), "--moe-ffn-hidden-size")
    pattern = _pattern(cl.get("--moe-layer-freq"))
    if pattern is None:
        t.refuse("--moe-layer-freq", "not an integer or a list pattern such as ([1]*3+[0])*2")
    else:
        moe["layer_freq"] = (pattern, "--moe-layer-freq")
    if score not in ("softmax", "sigmoid"):
        t.refuse("--moe-router-score-function", "use softmax or sigmoid")
    else:
        moe["router"] = (score, "--moe-router-score-function")
    # softmax: top-k of the logits then a softmax over them (renormalised) unless pre-softmax;
    # sigmoid: the chosen scores renormalised when k > 1.
    norm = not cl.get("--moe-router-pre-softmax") if score == "softmax" else topk > 1
    moe["norm_topk"] = (norm, "--moe-router-pre-softmax" if score == "softmax" else "--moe-router-topk")
    _moe_losses(t, moe)
    for key, (value, flag) in moe.items():
        t.set(f"model.moe.{key}", value, flag)


def _moe_losses(t: Translation, moe: dict) -> None:
    cl = t.cl
    balancing = cl.get("--moe-router-load-balancing-type")
    coeff = cl.get("--moe-aux-loss-coeff")
    if balancing == "none":
        coeff = 0.0
    elif balancing != "aux_loss":
        t.refuse("--moe-router-load-balancing-type", "only the Switch/GShard auxiliary loss (aux_loss) or none")
    moe["aux_loss_coeff"] = (coeff, "--moe-aux-loss-coeff" if balancing == "aux_loss" else
                             "--moe-router-load-balancing-type")
    if balancing == "aux_loss":
        t.ignore("--moe-router-load-balancing-type", "aux_loss: the Switch/GShard loss, weighed by "
                                                     "model.moe.aux_loss_coeff")
    moe["z_loss_coeff"] = (cl.get("--moe-z-loss-coeff") or 0.0, "--moe-z-loss-coeff")
    rate = cl.get("--moe-router-bias-update-rate") if cl.get("--moe-router-enable-expert-bias") else 0.0
    moe["expert_bias_rate"] = (rate, "--moe-router-enable-expert-bias")
    if not cl.get("--moe-router-enable-expert-bias"):
        t.ignore("--moe-router-bias-update-rate", "Megatron-LM reads it with --moe-router-enable-expert-bias only")
    if cl.given("--moe-expert-capacity-factor"):
        moe["capacity_factor"] = (cl.get("--moe-expert-capacity-factor"), "--moe-expert-capacity-factor")
        if cl.get("--moe-token-drop-policy") != "probs":
            t.refuse("--moe-token-drop-policy", "over capacity the assignments with the lowest weights are dropped "
                                                "here (probs)")
        t.ignore("--moe-token-drop-policy", "probs: the assignments with the lowest weights are dropped, as here")
    else:
        t.ignore("--moe-token-drop-policy", "Megatron-LM reads it with --moe-expert-capacity-factor only")
    if cl.given("--moe-shared-expert-intermediate-size"):
        moe["shared_ffn_hidden_size"] = (cl.get("--moe-shared-expert-intermediate-size"),
                                         "--moe-shared-expert-intermediate-size")
    if cl.get("--moe-router-topk-scaling-factor") is not None:
        t.refuse("--moe-router-topk-scaling-factor", "routing weights are not rescaled here")


def _pattern(text: Any) -> Optional[Any]:
    """Megatron-LM's layer pattern: an integer, or a list expression of 0/1 built with ``*`` and
    ``+`` (read as data, never evaluated as code)."""
    text = str(text).strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        value = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return value if isinstance(value, list) and all(v in (0, 1) for v in value) and len(value) <= 100_000 else None


def _list_expression(node) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and 0 <= node.value <= 100_000:
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * times > 100_000:
                raise ValueError("too long")
            return items * times
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
    raise ValueError("not a list pattern")


def split_values(values: List[str]) -> List[str]:
    """A list flag's words, a quoted "1.0 a 2.0 b" split as the shell would not."""
    return [w for v in values for w in v.split()]
