"""LoRA against ``peft``: the same adapter weights give the same loss and adapter gradients.

The reference is ``peft`` itself on a small float64 Llama from ``transformers`` (grouped-query
attention, SwiGLU), with nonzero random lora_A and lora_B on q, k, v, o, gate, up and down. Our
model is the same base imported with our converter and loaded at tp1, tp2 with sequence
parallelism and pp2, given peft's adapter tensors through a name map written here (not the
converter's): peft's q_proj, k_proj, v_proj adapters are our fused QKV's a_q/b_q, a_k/b_k, a_v/b_v,
o_proj's our proj, up_proj fc1, gate_proj gate, down_proj fc2. Loss (mean token cross-entropy) and
every adapter gradient agree to 1e-10; tp1 also with rank-stabilised scaling and a target subset.
transformers runs Llama's RMSNorm and forms its rotary tables in float32 whatever the model's dtype;
the reference swaps in float64 ones (the same formulas), or the comparison would stop at 1e-7.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import spawn_ranks

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*")]  # tp1: one process, no group

VOCAB, SEQ, BATCH, LAYERS, HIDDEN, HEADS, RANK = 96, 16, 2, 2, 32, 4, 4
TOL = 1e-10
# peft's module -> (our layer, whether it is row-parallel: A split along its input, B whole;
# column-parallel layers hold A whole and B split along the output).
MODULES = {"q_proj": ("attention.qkv", "_q", False), "k_proj": ("attention.qkv", "_k", False),
           "v_proj": ("attention.qkv", "_v", False), "o_proj": ("attention.proj", "", True),
           "gate_proj": ("mlp.gate", "", False), "up_proj": ("mlp.fc1", "", False),
           "down_proj": ("mlp.fc2", "", True)}
PEFT_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# name: (peft target modules, our target modules, rslora)
VARIANTS = {
    "all": (list(MODULES), ["qkv", "proj", "fc1", "gate", "fc2"], False),
    "rslora": (list(MODULES), ["qkv", "proj", "fc1", "gate", "fc2"], True),
    "qkv_fc2": (["q_proj", "k_proj", "v_proj", "down_proj"], ["qkv", "fc2"], False),
}
ALPHA = 6.0
LAYOUTS = {"tp1": (1, 1, False), "tp2_sp": (2, 1, True), "pp2": (1, 2, False)}  # (tp, pp, sequence parallel)


class Rope64(torch.nn.Module):
    """Rotary cos/sin tables formed in float64 (transformers forms them in float32 whatever the
    model's dtype, a 1e-7 difference a float64 comparison would see); rotate-half, as Llama's."""

    def __init__(self, theta: float, dim: int):
        super().__init__()
        self.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def forward(self, x, position_ids):
        angles = position_ids[..., None].to(torch.float64) * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


class RMSNorm64(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """Llama's RMSNorm in the input's dtype (transformers' runs in float32 whatever the model's)."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _float64_reference(model) -> None:
    """Every part of ``model`` in float64 arithmetic: its norms and rotary tables replaced."""
    for module in model.modules():
        if isinstance(module, transformers.models.llama.modeling_llama.LlamaRMSNorm):
            module.__class__ = RMSNorm64
    model.model.rotary_emb = Rope64(10000.0, HIDDEN // HEADS)


def _hf_base(path):
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # O(1) weights: a mapping error cannot hide in near-zero activations
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.2
            p.copy_(noise + 1.0 if "norm" in name else noise)
    model.save_pretrained(path)
    _float64_reference(model)
    return model


def _peft_model(base, variant):
    """``base`` (a copy) wrapped by peft, its lora_A and lora_B drawn from a seeded generator."""
    modules, _, rslora = VARIANTS[variant]
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules, lora_dropout=0.0, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return model


def _peft_tensors(model):
    """{(layer, module, "A" | "B"): (weight, grad)} of peft's adapters."""
    out = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for module, parent in PEFT_PARENT.items():
            lin = getattr(getattr(layer, parent), module)
            if hasattr(lin, "lora_A"):
                for kind, holder in (("A", lin.lora_A), ("B", lin.lora_B)):
                    w = holder["default"].weight
                    out[i, module, kind] = (w.detach().clone(), w.grad.detach().clone())
    return out


def _ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The imported checkpoint, the tokens, and per variant peft's loss and adapter tensors."""
    from megatron_hydra.convert import api

    root = tmp_path_factory.mktemp("llama")
    base = _hf_base(str(root / "hf"))
    api.from_hf(str(root / "hf"), str(root / "ckpt"), name="tiny_llama")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    out = {}
    for variant in VARIANTS:
        model = _peft_model(base, variant)
        loss = _ce(model(tokens).logits, labels)
        loss.backward()
        out[variant] = (loss.item(), _peft_tensors(model))
    return str(root / "ckpt"), tokens, labels, out


# Our side (runs on each rank, or in this process at tp1) -----------------------------------------

def _peft_key(name):
    """(layer index, peft module, "A" | "B") behind our adapter tensor ``name``
    (``layers.{i}.<layer>.lora.<a|b><suffix>``), and the dim its TP shards split: column-parallel
    layers hold A whole and B split along the output, row-parallel ones A split along the input."""
    i = int(name.split(".")[1])
    for module, (layer, suffix, row) in MODULES.items():
        for kind in "ab":
            if name == f"layers.{i}.{layer}.lora.{kind}{suffix}":
                dim = (1 if kind == "a" else None) if row else (None if kind == "a" else 0)
                return (i, module, kind.upper()), dim
    raise AssertionError(f"{name} has no peft counterpart")


def _build(ckpt, variant, tp, pp, sp, world):
    """This rank's chunks of the imported model with LoRA ``variant`` at (tp, pp), float64, the
    base loaded from ``ckpt`` into a plain model and copied over by name (an adapter-free load)."""
    from megatron_hydra.checkpoint import sharded, standalone
    from megatron_hydra.config import derive
    from megatron_hydra.models.stages import build_stage_chunks
    from megatron_hydra.parallel.state import ParallelState

    cfg, _ = standalone.single_process(standalone.read_config(ckpt))
    cfg.precision.params_dtype = "float64"
    cfg.model.seq_length = SEQ
    cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size = tp, pp
    cfg.parallel.sequence_parallel = sp
    cfg.trainer.devices = world
    plain_derived = derive(cfg)
    ps = ParallelState.single() if world == 1 else ParallelState.build(tp=tp, pp=pp, dp=world // (tp * pp))
    plain, _ = build_stage_chunks(cfg, plain_derived, ps)
    sharded.load(ckpt, torch.nn.ModuleList(plain) if pp > 1 else plain[0], None, ps,
                 plain_derived.transformer.vocab_size, load_optimizer=False)
    _, ours, rslora = VARIANTS[variant]
    cfg.peft.name, cfg.peft.rank, cfg.peft.alpha = "lora", RANK, ALPHA
    cfg.peft.target_modules, cfg.peft.rslora = ours, rslora
    chunks, _ = build_stage_chunks(cfg, derive(cfg), ps)
    for chunk, base in zip(chunks, plain):
        missing, unexpected = chunk.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected and all(".lora." in k for k in missing), (missing, unexpected)
    return chunks, ps


def _set_adapters(chunk, peft_tensors, ps):
    """Our adapters' shards cut from peft's weights."""
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            if ".lora." in name:
                key, dim = _peft_key(name)
                full = peft_tensors[key][0]
                p.copy_(full if dim is None else full.chunk(ps.tp_size, dim)[ps.tp_rank])


def _gather(t, dim, group):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _adapter_grads(chunk, ps):
    """{name: logical gradient} of ``chunk``'s adapters (TP shards gathered by a raw all_gather),
    and the names of base parameters that have a gradient or require one."""
    grads = {}
    for name, p in chunk.named_parameters():
        if ".lora." in name:
            dim = _peft_key(name)[1]
            grads[name] = p.grad if dim is None or ps.tp_size == 1 else _gather(p.grad, dim, ps.tp_group)
    base = [n for n, p in chunk.named_parameters() if ".lora." not in n and (p.requires_grad or p.grad is not None)]
    return grads, base


def _loss_and_grads(ckpt, variant, layout, peft_tensors, tokens, labels, world):
    """Our model at ``layout``: one forward and backward of the mean token loss; pp2 passes the
    hidden state and its gradient between the two stages. Returns (loss, adapter grads, base
    parameters with grads, the loss with the adapters off)."""
    import torch.distributed as dist

    from megatron_hydra.models.lora import adapters_off
    from megatron_hydra.parallel.data_parallel import allreduce_sequence_parallel_grads

    tp, pp, sp = LAYOUTS[layout]
    chunks, ps = _build(ckpt, variant, tp, pp, sp, world)
    stage = chunks[0].eval()
    _set_adapters(stage, peft_tensors, ps)
    loss = base_loss = None
    if pp == 1:
        with torch.no_grad(), adapters_off(stage):
            base_loss = stage(tokens, labels).mean().item()
        loss = stage(tokens, labels).mean()
        loss.backward()
    elif ps.pp_rank == 0:
        hidden = stage(tokens)
        dist.send(hidden.detach().contiguous(), dst=1)
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=1)
        hidden.backward(grad)
    else:
        hidden = torch.empty(BATCH, SEQ, HIDDEN, dtype=torch.float64)
        dist.recv(hidden, src=0)
        hidden.requires_grad_(True)
        loss = stage(hidden, labels).mean()
        loss.backward()
        dist.send(hidden.grad.contiguous(), dst=0)
    allreduce_sequence_parallel_grads(stage.parameters(), ps.tp_group)  # as the optimizer step does
    return (None if loss is None else loss.item()), *_adapter_grads(stage, ps), base_loss


def _on_ranks(rank, world, ckpt, peft_tensors, tokens, labels):
    torch.set_num_threads(1)
    return {layout: _loss_and_grads(ckpt, "all", layout, peft_tensors, tokens, labels, world)
            for layout in ("tp2_sp", "pp2")}


@pytest.fixture(scope="module")
def results(reference):
    """{(variant, layout): (loss, {adapter name: grad}, base params with grads, base loss)}: tp1
    in this process, tp2 + SP and pp2 from one start of two ranks."""
    ckpt, tokens, labels, ref = reference
    out = {(v, "tp1"): _loss_and_grads(ckpt, v, "tp1", ref[v][1], tokens, labels, 1) for v in VARIANTS}
    ranks = spawn_ranks(_on_ranks, 2, ckpt, ref["all"][1], tokens, labels)
    tp2 = [ranks[r]["tp2_sp"] for r in (0, 1)]
    assert tp2[0][0] == tp2[1][0]  # both TP ranks end with the whole loss
    out["all", "tp2_sp"] = tp2[0]
    (_, first, first_base, _), (loss, last, last_base, _) = ranks[0]["pp2"], ranks[1]["pp2"]
    assert not set(first) & set(last)  # each stage holds its own layers' adapters
    out["all", "pp2"] = (loss, {**first, **last}, first_base + last_base, None)
    return out


CASES = [("all", "tp1"), ("rslora", "tp1"), ("qkv_fc2", "tp1"), ("all", "tp2_sp"), ("all", "pp2")]


@pytest.mark.parametrize("variant,layout", CASES)
def test_loss_equals_peft(reference, results, variant, layout):
    ref_loss = reference[3][variant][0]
    loss = results[variant, layout][0]
    assert abs(loss - ref_loss) < TOL, (loss, ref_loss)


@pytest.mark.parametrize("variant,layout", CASES)
def test_adapter_grads_equal_peft_and_base_has_none(reference, results, variant, layout):
    peft_tensors = reference[3][variant][1]
    _, grads, base_with_grads, _ = results[variant, layout]
    assert sorted(_peft_key(name)[0] for name in grads) == sorted(peft_tensors)  # one to one
    worst = max(float((g - peft_tensors[_peft_key(name)[0]][1]).abs().max()) for name, g in grads.items())
    assert worst < TOL, worst
    assert not base_with_grads


def test_adapters_change_the_loss(reference, results):
    """The adapters matter: the base alone (adapters off) gives another loss, so the equal losses
    above test the adapters, and peft's loss differs between the variants."""
    losses = {v: loss for v, (loss, _) in reference[3].items()}
    assert abs(results["all", "tp1"][3] - losses["all"]) > 1e-3
    assert abs(losses["all"] - losses["rslora"]) > 1e-3 and abs(losses["all"] - losses["qkv_fc2"]) > 1e-3
