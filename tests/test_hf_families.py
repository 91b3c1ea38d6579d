"""Today's open families against transformers itself, in float64: Llama 3.1 (llama3 RoPE scaling),
Qwen2 (QKV-only bias), Qwen3 (QK-norm, yarn), Qwen3-MoE (softmax top-k without renormalising, a
dense layer among MoE ones), Mistral (sliding window, linear scaling), Gemma 2 (zero-centred and
post-sub-layer norms, scaled embeddings, GeGLU, both soft-caps, query_pre_attn_scalar) and
Gemma 3 (QK-norm, a local RoPE base, a layer pattern of both kinds that no int n gives).

Each reference is a small random model built by transformers (odd vocabulary, grouped-query
attention, head_dim apart from hidden / heads where the family has one, a window shorter than the
test sequence and than a context-parallel chunk where the family has one), its weights spread to
O(1) so that no mapping error hides in near-zero logits, saved with save_pretrained and imported.

transformers computes RoPE angles, RMSNorm statistics and softmaxes in float32 even in a float64
model (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float32``), which alone puts its logits
at float32's distance from any float64 computation. ``Float64`` runs its own code with those
requests made float64: the reference a 1e-10 comparison needs.

One fixture builds and imports the seven models once; one start of two gloo ranks evaluates every
(family, layout) pair (tp2 with sequence parallelism, pp2, cp2 with the ring exchange).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import assert_reloads_bitwise, spawn_ranks

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, WINDOW = 301, 24, 5  # cp2: 4 chunks of 6 tokens, each longer than the window
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
PROMPT, NEW_TOKENS = [5, 17, 99, 3, 42, 7], 20
TOLERANCE = 1e-10


class Float64(TorchFunctionMode):
    """Every float32 that torch is asked for, as float64 (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
              pad_token_id=None, tie_word_embeddings=False)
# model_type -> (config class, model class, the config's own values)
SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=24, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1)),  # layer 1 windowed only
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=24, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 16})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
        norm_topk_prob=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        head_dim=24, sliding_window=WINDOW, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=24, query_pre_attn_scalar=20, sliding_window=WINDOW, attn_logit_softcapping=20.0,
        final_logit_softcapping=10.0, tie_word_embeddings=True)),  # hidden 64: sqrt(hidden) is exact
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=24, num_hidden_layers=3, query_pre_attn_scalar=32, sliding_window=WINDOW, tie_word_embeddings=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}
FAMILIES = list(SPECS)
# What each import must read from its config.json: our model keys.
EXPECTED = {
    "llama": dict(kv_channels=24, sliding_window=None, qkv_bias=None, rope_theta=50000.0),
    "qwen2": dict(kv_channels=16, qkv_bias=True, add_bias_linear=False, sliding_window=WINDOW,
                  sliding_window_pattern=[0, 1]),
    "qwen3": dict(kv_channels=24, qk_norm=True, sliding_window=WINDOW, sliding_window_pattern=2, rope_theta=1e6),
    "qwen3_moe": dict(kv_channels=24, qk_norm=True, sliding_window=None, ffn_hidden_size=96),
    "mistral": dict(kv_channels=24, sliding_window=WINDOW, sliding_window_pattern=1),
    "gemma2": dict(kv_channels=24, activation="geglu", zero_centered_gamma=True, post_sublayer_norm=True,
                   scale_embeddings=True, query_pre_attn_scalar=20.0, attn_logit_softcapping=20.0,
                   final_logit_softcapping=10.0, sliding_window=WINDOW, sliding_window_pattern=2, tie_embeddings=True),
    "gemma3_text": dict(kv_channels=24, qk_norm=True, zero_centered_gamma=True, post_sublayer_norm=True,
                        query_pre_attn_scalar=32.0, attn_logit_softcapping=None, final_logit_softcapping=None,
                        sliding_window=WINDOW, sliding_window_pattern=[0, 1, 1], rope_theta=1e6,
                        local_rope_theta=1e4),
}
ROPE_SCALING = {"llama": ("llama3", 8.0), "qwen3": ("yarn", 4.0), "mistral": ("linear", 2.0),
                "gemma3_text": ("linear", 2.0)}


def _spread(model) -> None:
    """Replace transformers' tiny init by O(1) random weights (norm weights around one). Gemma's
    word embeddings are multiplied by sqrt(hidden): theirs are drawn that much smaller, else the
    embedding swamps the residual stream and a tied head only echoes the last token."""
    gen = torch.Generator().manual_seed(1)
    embedding_std = 0.2 / (COMMON["hidden_size"] ** 0.5 if "Gemma" in type(model).__name__ else 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(noise * 0.2 + 1.0 if "norm" in name else noise * (embedding_std if "embed" in name else 0.2))


def _hf_model(family: str):
    """transformers' model of ``family``, built in float64 (eager attention: the kernel that
    soft-caps; eager experts: the loop that runs in float64)."""
    config_class, model_class, own = SPECS[family]
    config = getattr(transformers, config_class)(**{**COMMON, **own}, attn_implementation="eager")
    config._experts_implementation = "eager"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # constants made with torch.tensor(python float) too
    try:
        with Float64():
            torch.manual_seed(0)
            model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(default)
    _spread(model)
    return model.eval()


def _hf_greedy(model) -> list:
    with torch.no_grad(), Float64():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (transformers' model, its directory, our import, its logits, its greedy tokens)}."""
    from megatron_hydra.convert import api

    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
        model = _hf_model(family)
        model.save_pretrained(hf_dir)
        api.from_hf(hf_dir, ckpt, name=f"tiny_{family}")
        with torch.no_grad(), Float64():
            logits = model(TOKENS).logits
        out[family] = (model, hf_dir, ckpt, logits, _hf_greedy(model))
    return out


def _load(ckpt: str, tp: int = 1, pp: int = 1, cp: int = 1, world: int = 1):
    """Our model of ``ckpt`` at a layout, in float64, as a training run builds it: (this rank's
    model chunk, its parallel state); the whole model in this process at the default layout."""
    from megatron_hydra.checkpoint import sharded, standalone
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.models.stages import build_stage_chunks

    cfg, _ = standalone.single_process(standalone.read_config(ckpt))
    cfg.precision.params_dtype = "float64"
    par = cfg.parallel
    par.tensor_parallel_size, par.pipeline_parallel_size, par.context_parallel_size = tp, pp, cp
    par.sequence_parallel = tp > 1
    layers = cfg.model.num_layers
    par.layers_per_stage = [layers - layers // pp, layers // pp] if pp == 2 else None
    cfg.trainer.devices = world
    derived = derive(cfg)
    ps = ParallelState.build(tp=tp, pp=pp, dp=derived.dp, cp=cp) if world > 1 else ParallelState.single()
    chunks, _ = build_stage_chunks(cfg, derived, ps)
    sharded.load(ckpt, torch.nn.ModuleList(chunks) if pp > 1 else chunks[0], None, ps,
                 derived.transformer.vocab_size, load_optimizer=False)
    return chunks[0].eval(), ps


LAYOUTS = {"tp2_sp": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2)}


@torch.no_grad()
def _layout_logits(ckpt: str, layout: str, world: int, tokens: torch.Tensor):
    """This rank's logits: its vocabulary shard (tp), the last stage's (pp), its two chunks of the
    sequence (cp: ``data.sequence_shards``)."""
    import torch.distributed as dist

    from megatron_hydra.data.sequence_shards import shard_batch

    model, ps = _load(ckpt, world=world, **LAYOUTS[layout])
    if layout == "cp2":
        batch = shard_batch({"tokens": tokens}, 2, ps.cp_rank)
        return model(batch["tokens"], position_ids=batch["position_ids"])
    if layout == "tp2_sp":
        return model(tokens)
    if ps.pp_rank == 0:
        dist.send(model(tokens).contiguous(), dst=1)
        return None
    hidden = torch.empty(*tokens.shape, model.cfg.hidden_size, dtype=torch.float64)
    dist.recv(hidden, src=0)
    return model(hidden)


def _all_layouts(rank, world, ckpts, tokens):
    return {(family, layout): _layout_logits(ckpt, layout, world, tokens)
            for family, ckpt in ckpts.items() for layout in LAYOUTS}


@pytest.fixture(scope="module")
def layout_logits(models):
    """{(family, layout): the whole logits, or (cp2) each rank's and the reference's chunks}."""
    from megatron_hydra.data.sequence_shards import shard_batch

    results = spawn_ranks(_all_layouts, 2, {family: m[2] for family, m in models.items()}, TOKENS)
    out = {}
    for family in FAMILIES:
        out[family, "tp2_sp"] = torch.cat([results[r][family, "tp2_sp"] for r in (0, 1)], dim=-1)
        out[family, "pp2"] = results[1][family, "pp2"]
        reference = models[family][3]
        out[family, "cp2"] = [(results[r][family, "cp2"], shard_batch({"tokens": reference}, 2, r)["tokens"])
                              for r in (0, 1)]
    return out


def _assert_logits(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours[..., :VOCAB], reference, atol=TOLERANCE, rtol=0)
    assert torch.isinf(ours[..., VOCAB:]).all()  # the padded vocabulary


@pytest.mark.parametrize("family", FAMILIES)
def test_import_reads_the_family_keys(models, family):
    from megatron_hydra.checkpoint.standalone import read_config

    model = read_config(models[family][2]).model
    for key, value in EXPECTED[family].items():
        assert getattr(model, key) == value, key
    scaling = model.rope_scaling
    assert (None if scaling is None else (scaling.type, scaling.factor)) == ROPE_SCALING.get(family)
    if family == "qwen3_moe":
        moe = model.moe
        assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.layer_freq, moe.norm_topk) == (
            4, 2, 32, [1, 0], False)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_process_logits_equal_transformers(models, family):
    model, _ = _load(models[family][2])
    with torch.no_grad():
        _assert_logits(model(TOKENS), models[family][3])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_logits_equal_transformers(models, layout_logits, family, layout):
    if layout == "cp2":
        for ours, reference in layout_logits[family, layout]:
            _assert_logits(ours, reference)
    else:
        _assert_logits(layout_logits[family, layout], models[family][3])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(models, family):
    """20 tokens past a 6-token prompt: the windowed layers' cache keeps only the window."""
    from megatron_hydra.generate import SamplingConfig, generate

    model, _ = _load(models[family][2])
    theirs = models[family][4]
    greedy = SamplingConfig(greedy=True)
    assert len(set(theirs)) > 3  # a real sequence, not one repeated token
    assert generate(model, PROMPT, NEW_TOKENS, greedy, use_cache=True) == theirs
    assert generate(model, PROMPT, NEW_TOKENS, greedy, use_cache=False) == theirs


# Config keys transformers fills in on its own, that export sets from the checkpoint, or (Qwen's
# max_window_layers) that only stand in for layer_types where a file has none.
NOT_COMPARED = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                "pad_token_id", "use_cache", "output_router_logits", "architectures", "max_window_layers"}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_reloads_bitwise_as_the_family(models, family, tmp_path):
    from megatron_hydra.convert import api

    model, _, ckpt, _, _ = models[family]
    out = tmp_path / "exported"
    assert api.to_hf(ckpt, str(out))["architecture"] == family
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert_reloads_bitwise(model, back)
    theirs, ours = model.config.to_dict(), back.config.to_dict()
    differ = {k: (theirs[k], ours.get(k)) for k in theirs if k not in NOT_COMPARED and theirs[k] != ours.get(k)}
    assert not differ


# Bad input: one line naming the file, the key and the value, and no output directory -----------------
def _refused(hf_dir, tmp_path, capsys, change) -> str:
    from megatron_hydra.convert.__main__ import main

    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    change(config)
    (broken / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["from_hf", f"input={broken}", f"output={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["broken"]
    return err


def test_unsupported_rope_type_is_one_line_and_writes_nothing(models, tmp_path, capsys):
    def dynamic(config):
        config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}

    err = _refused(models["llama"][1], tmp_path, capsys, dynamic)
    assert "config.json: rope_type='dynamic' is not supported: llama3, linear, yarn are" in err


@pytest.mark.parametrize("family, key, value, message", [
    ("gemma2", "hidden_activation", "gelu", "hidden_activation='gelu' is not supported: only gelu_pytorch_tanh is"),
    ("gemma3_text", "use_bidirectional_attention", True, "use_bidirectional_attention=true is not supported"),
    ("qwen3", "attention_bias", True, "attention_bias=true is not supported"),
    ("mistral", "hidden_act", "gelu", "hidden_act='gelu' is not supported: only silu is"),
], ids=["gemma2-activation", "gemma3-bidirectional", "qwen3-attention-bias", "mistral-activation"])
def test_unsupported_field_is_one_line_and_writes_nothing(models, tmp_path, capsys, family, key, value, message):
    err = _refused(models[family][1], tmp_path, capsys, lambda config: config.update({key: value}))
    assert f"config.json: {message}" in err
