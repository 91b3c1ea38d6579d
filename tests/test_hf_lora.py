"""LoRA adapters to and from Hugging Face ``peft``: exported adapter directories, merged exports,
imported ``peft`` adapters, and the one-line refusals.

The references are ``peft`` itself on ``transformers``' models: ``PeftModel.from_pretrained`` loading
our export onto the Hugging Face base, ``merge_and_unload`` for the merged export, the adapter
directories ``save_pretrained`` writes for the import, and ``transformers`` loading a merged GPT-2
(whose fused c_attn has no ``peft`` form). Bases are small random Llama and Qwen2 models (Qwen2 with
its q, k, v biases, an MLP width of its own and an adapter of q_proj and v_proj only, rsLoRA
scaled, one target named by a longer suffix as peft allows), weights spread to O(0.1) and adapters drawn from seeded generators so that both matter in
the logits. Our model with adapters is built and loaded here from the checkpoints directly,
without the converter.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

from conftest import compose_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402  (after the skip: safetensors comes with transformers)

VOCAB = 301
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=1, pad_token_id=None)
# model_type -> (config class, model class, its own values, the peft adapter's settings)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96),
              dict(r=4, lora_alpha=8, target_modules=ALL)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=80),
              dict(r=4, lora_alpha=6, use_rslora=True, target_modules=["self_attn.q_proj", "v_proj", "down_proj"])),
}


def _spread(model, seed: int, lora: bool = False) -> None:
    """O(0.1) random weights (norms around one), or with ``lora`` only the adapters'."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora == ("lora_" in name):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1 + (1.0 if "norm" in name else 0.0))


def _hf_base(family: str):
    config_class, model_class, own, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **own))
    _spread(model, 1)
    return model.eval()


def _with_adapter(hf, adapter_dir: str):
    return peft.PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir).eval()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{family: (transformers' base, its directory, our import of it, peft's adapter directory,
    peft's logits, our adapter checkpoint imported from that directory)}."""
    from megatron_hydra.convert import api

    out = {}
    for family, (*_, settings) in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        hf = _hf_base(family)
        hf.save_pretrained(root / "hf")
        api.from_hf(str(root / "hf"), str(root / "base"))
        adapted = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(task_type="CAUSAL_LM", **settings))
        _spread(adapted, 2, lora=True)
        adapted.save_pretrained(root / "peft")
        with torch.no_grad():
            logits = adapted.eval()(TOKENS).logits
        api.from_hf(str(root / "peft"), str(root / "adapter"), base=str(root / "base"))
        out[family] = (hf, str(root / "hf"), str(root / "base"), str(root / "peft"), logits, str(root / "adapter"))
    return out


def _read_into(params: dict, path: str) -> None:
    """Copy the checkpoint ``path``'s tensors of ``params`` (by logical name) into them."""
    from megatron_hydra.checkpoint import standalone

    sources = standalone.tensor_sources(path, {n: list(p.shape) for n, p in params.items()})
    with torch.no_grad():
        for key, t in standalone.read_tensors(path, list(sources.values())):
            params[key[len("model/"):]].copy_(t)


def _ours(base: str, adapter_cfg, adapter: str = None):
    """Our model with adapters (config ``adapter_cfg``), the weights of ``base`` and, where given,
    the adapters of ``adapter``: the base loaded into a model without adapters, then copied."""
    from megatron_hydra.checkpoint import sharded, standalone
    from megatron_hydra.config.schema import PeftConfig
    from megatron_hydra.models.archs import ARCHS
    from megatron_hydra.parallel.state import ParallelState

    ps = ParallelState.single()
    cfg, derived = standalone.single_process(adapter_cfg)
    model = ARCHS["gpt"].build(derived.transformer, ps)
    plain = copy.deepcopy(cfg)
    plain.peft = PeftConfig()
    _, d0 = standalone.single_process(plain)
    without = ARCHS["gpt"].build(d0.transformer, ps)
    sharded.load(base, without, None, ps, d0.transformer.vocab_size, load_optimizer=False)
    missing, unexpected = model.load_state_dict(without.state_dict(), strict=False)
    assert not unexpected and missing and all(".lora." in name for name in missing)
    if adapter is not None:
        _read_into({n: p for n, p in model.named_parameters() if ".lora." in n}, adapter)
    return model.eval(), cfg, derived


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)[..., :VOCAB]


# peft -> ours ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_imports_with_peft_logits(families, family):
    from megatron_hydra.checkpoint import standalone

    hf, _, base, _, reference, adapter = families[family]
    model, cfg, _ = _ours(base, standalone.read_config(adapter), adapter)
    ours = _logits(model)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (ours - hf(TOKENS).logits).abs().max() > 0.1  # the adapters matter
    settings = FAMILIES[family][3]
    assert (cfg.peft.rank, cfg.peft.alpha, cfg.peft.rslora) == (4, settings["lora_alpha"],
                                                               settings.get("use_rslora", False))


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_reproduces_peft_tensors_bitwise(families, family, tmp_path):
    """peft -> ours -> peft: the same tensors, bit for bit. An adapter of q and v alone comes back
    with k's adapters too, all zero (our qkv adapter has all three)."""
    from megatron_hydra.convert import api

    hf, _, _, peft_dir, reference, adapter = families[family]
    out = tmp_path / "peft"
    api.to_hf(adapter, str(out), base="tiny-base")
    theirs = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    ours = load_file(out / "adapter_model.safetensors")
    assert set(theirs) <= set(ours)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    extra = sorted(set(ours) - set(theirs))
    assert all(".k_proj." in name and not ours[name].any() for name in extra)
    assert bool(extra) == ("k_proj" not in FAMILIES[family][3]["target_modules"])
    config = json.loads((out / "adapter_config.json").read_text())
    original = json.loads(open(os.path.join(peft_dir, "adapter_config.json")).read())
    for key in ("r", "lora_alpha", "use_rslora", "lora_dropout", "peft_type", "task_type", "bias"):
        assert config[key] == original[key], key
    assert config["base_model_name_or_path"] == "tiny-base"
    torch.testing.assert_close(_with_adapter(hf, str(out))(TOKENS).logits, reference, atol=1e-6, rtol=0)


# ours -> peft ------------------------------------------------------------------------------------
def _random_adapters(base: str, path: str, seed: int, **peft_settings):
    """Our model of ``base`` with adapters of ``peft_settings`` drawn from a seeded generator,
    written as the adapter checkpoint ``path`` (C1's format)."""
    from megatron_hydra.checkpoint import standalone
    from megatron_hydra.checkpoint.lazy_write import LazyTensor
    from megatron_hydra.config.schema import PeftConfig
    from megatron_hydra.convert.lora import write_adapters

    cfg = standalone.read_config(base)
    cfg.peft = PeftConfig(name="lora", **peft_settings)
    model, cfg, derived = _ours(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    adapters = {n: p for n, p in model.named_parameters() if ".lora." in n}
    with torch.no_grad():
        for p in adapters.values():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    os.makedirs(path)
    write_adapters(path, {n: LazyTensor(tuple(p.shape), p.dtype, lambda p=p: p.detach().clone())
                          for n, p in adapters.items()}, cfg, derived)
    return model, cfg, derived


@pytest.mark.parametrize("family", FAMILIES)
def test_our_adapters_export_to_peft_with_our_logits(families, family, tmp_path):
    from megatron_hydra.convert import api

    hf, _, base, *_ = families[family]
    ckpt, out = str(tmp_path / "ours"), str(tmp_path / "peft")
    model, *_ = _random_adapters(base, ckpt, 3, rank=4, alpha=16.0, rslora=family == "qwen2")  # every target layer
    api.to_hf(ckpt, out)
    with torch.no_grad():
        theirs = _with_adapter(hf, out)(TOKENS).logits
        assert (theirs - hf(TOKENS).logits).abs().max() > 0.1
    torch.testing.assert_close(_logits(model), theirs, atol=1e-5, rtol=0)
    assert sorted(json.loads(open(os.path.join(out, "adapter_config.json")).read())["target_modules"]) == sorted(ALL)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_equals_merge_and_unload(families, family, dtype, tmp_path):
    from megatron_hydra.convert import api

    hf, _, base, peft_dir, _, adapter = families[family]
    out = tmp_path / "merged"
    api.to_hf(base, str(out), dtype=dtype, adapter=adapter, merge=True)
    ours = load_file(out / "model.safetensors")
    reference = _with_adapter(hf.to(getattr(torch, dtype)), peft_dir).merge_and_unload().state_dict()
    hf.float()  # the fixture's model, as it was
    assert sorted(ours) == sorted(reference)
    for name, t in reference.items():
        assert ours[name].dtype == t.dtype
        torch.testing.assert_close(ours[name], t, atol=1e-6 if dtype == "float32" else 1e-15, rtol=0)


def test_gpt2_adapters_merge_but_have_no_peft_form(tmp_path, capsys):
    """GPT-2's c_attn is q, k and v fused and transposed: one peft adapter cannot hold our three.
    The merged export is the way out, and transformers' GPT-2 gives our LoRA model's logits. A full
    checkpoint of the LoRA model (base and adapters in one) merges to the same bits."""
    from megatron_hydra.checkpoint import standalone
    from megatron_hydra.convert.__main__ import main

    cfg = compose_config(["data=synthetic", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                          "model.seq_length=32", f"model.vocab_size={VOCAB}"])
    cfg, derived = standalone.single_process(cfg)
    from megatron_hydra.models.archs import ARCHS
    from megatron_hydra.parallel.state import ParallelState

    plain = ARCHS["gpt"].build(derived.transformer, ParallelState.single())
    _spread(plain, 4)
    standalone.save_model(str(tmp_path / "base"), plain, cfg, derived, {"world": 1})
    model, lora_cfg, lora_derived = _random_adapters(str(tmp_path / "base"), str(tmp_path / "adapter"), 5, rank=2,
                                                     alpha=4.0)
    assert main(["to_hf", f"input={tmp_path / 'adapter'}", f"output={tmp_path / 'peft'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no peft form in a Hugging Face gpt2 model" in err and "merge=true" in err, err
    assert not os.path.exists(tmp_path / "peft")
    assert main(["to_hf", f"input={tmp_path / 'base'}", f"adapter={tmp_path / 'adapter'}", "merge=true",
                 f"output={tmp_path / 'merged'}"]) == 0
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(_logits(model), merged(TOKENS).logits, atol=1e-5, rtol=0)
    standalone.save_model(str(tmp_path / "full"), model, lora_cfg, lora_derived, {"world": 1})
    assert main(["to_hf", f"input={tmp_path / 'full'}", "merge=true", f"output={tmp_path / 'merged_full'}"]) == 0
    once = load_file(tmp_path / "merged" / "model.safetensors")
    again = load_file(tmp_path / "merged_full" / "model.safetensors")
    assert sorted(once) == sorted(again) and all(torch.equal(once[n], again[n]) for n in once)


# Bad input: one line naming the file and key, nothing written -------------------------------------
def _refused(families, tmp_path, change, family: str = "llama", base: str = None) -> str:
    """The one-line error of importing a copy of ``family``'s peft directory after ``change(dir,
    config)`` (which edits the parsed adapter_config.json in place, or the directory itself)."""
    from megatron_hydra.convert import api
    from megatron_hydra.errors import MegatronHydraError

    broken = tmp_path / "broken"
    shutil.copytree(families[family][3], broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    if change(broken, config) is None:
        (broken / "adapter_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    with pytest.raises(MegatronHydraError) as raised:
        api.from_hf(str(broken), str(out), base=base or families[family][2])
    assert "\n" not in str(raised.value) and not os.path.exists(out)
    return str(raised.value)


def _set(**values):
    return lambda directory, config: config.update(values)


@pytest.mark.parametrize("change, message", [
    (_set(use_dora=True), "use_dora=true is not supported: only null or false is"),
    (_set(rank_pattern={"q_proj": 8}), "rank_pattern={\"q_proj\": 8} is not supported: one rank for every layer"),
    (_set(alpha_pattern={"layers.0.self_attn.q_proj": 32}), "alpha_pattern="),
    (_set(bias="lora_only"), "bias='lora_only' is not supported: none is"),
    (_set(modules_to_save=["lm_head"]), "modules_to_save=[\"lm_head\"] is not supported"),
    (_set(layers_to_transform=[0]), "layers_to_transform=[0] is not supported"),
    (_set(target_modules=".*_proj"), "target_modules='.*_proj' is not supported: a list of module names"),
    (_set(target_modules=["layers.0.self_attn.q_proj"]), "names 'layers.0.self_attn.q_proj', which is no module of"),
    (_set(target_modules=["q_proj", "lm_head"]), "target_modules names 'lm_head', which is no module of every layer"),
    (_set(peft_type="IA3"), "peft_type='IA3' is not supported: LORA is"),
    (_set(task_type="SEQ_CLS"), "task_type='SEQ_CLS' is not supported"),
    (_set(init_lora_weights="pissa"), "init_lora_weights='pissa' is not supported"),
    (_set(lora_dropout=1.5), "lora_dropout=1.5 is not supported"),
    (_set(r="4"), "r=\"4\" should be an integer"),
    (_set(r=128), "peft.rank=128 exceeds the width 32 of the qkv layer"),
], ids=["dora", "rank_pattern", "alpha_pattern", "bias", "modules_to_save", "layers_to_transform", "regex",
        "one-layer-target", "unknown-target", "peft_type", "task_type", "pissa", "dropout", "rank-type", "rank-too-large"])
def test_unsupported_adapter_config_is_one_line(families, tmp_path, change, message):
    err = _refused(families, tmp_path, change)
    assert "adapter_config.json" in err and message in err, err


def _replace(name: str, how):
    def change(directory, config):
        os.remove(directory / name)
        how(directory / name)
        return False  # adapter_config.json stays as it now is
    return change


def _extra_tensor(directory, config):
    from safetensors.torch import save_file

    tensors = load_file(directory / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, VOCAB)
    save_file(tensors, directory / "adapter_model.safetensors")


@pytest.mark.parametrize("change, message", [
    (_replace("adapter_config.json", os.mkdir), "adapter_config.json: is a directory, not a regular file"),
    (_replace("adapter_config.json", os.mkfifo), "adapter_config.json: is a FIFO, not a regular file"),
    (_replace("adapter_config.json", lambda p: p.write_text("{\"r\": ")), "adapter_config.json: not valid JSON"),
    (_replace("adapter_config.json", lambda p: p.write_text("[1]")), "adapter_config.json holds a JSON list"),
    (_replace("adapter_model.safetensors", lambda p: None), "has no adapter_model.safetensors"),
    (_replace("adapter_model.safetensors", lambda p: p.write_bytes(b"\x10" + b"\0" * 7 + b"{")),
     "adapter_model.safetensors: not a readable weights file"),
    (_extra_tensor, "tensor base_model.model.model.embed_tokens.lora_embedding_A has no place among our adapters"),
], ids=["directory", "fifo", "not-json", "json-list", "no-weights", "truncated", "extra-tensor"])
def test_hostile_adapter_files_are_one_line(families, tmp_path, change, message):
    assert message in _refused(families, tmp_path, change)


def test_adapters_of_another_base_are_one_line(families, tmp_path):
    """A llama adapter (MLP width 96) onto the qwen2 base (80): refused on import and on merge."""
    from megatron_hydra.convert import api
    from megatron_hydra.errors import MegatronHydraError

    err = _refused(families, tmp_path, lambda d, c: None, base=families["qwen2"][2])
    assert "up_proj.lora_B.weight has shape [96, 4] but [80, 4] on this base model: the adapter belongs to " \
        "another base model" in err
    with pytest.raises(MegatronHydraError) as raised:
        api.to_hf(families["qwen2"][2], str(tmp_path / "merged"), adapter=families["llama"][5], merge=True)
    assert ("adapter tensor layers.0.mlp.fc1.lora.b is [80, 4] on this base model but the checkpoint has it as "
            "[96, 4]: the adapters belong to another base model") in str(raised.value)
    assert not os.path.exists(tmp_path / "merged")


def test_export_arguments_that_do_not_fit_are_one_line(families, tmp_path, capsys):
    from megatron_hydra.convert.__main__ import main

    _, _, base, peft_dir, _, adapter = families["llama"]
    out = f"output={tmp_path / 'out'}"
    for args, message in [
        ([f"input={adapter}", "merge=true"], "holds adapters only: give input=<base checkpoint> adapter="),
        ([f"input={base}", f"adapter={adapter}"], "is folded into input= with merge=true"),
        ([f"input={base}", "merge=true"], "holds no adapters; give adapter=<adapter checkpoint>"),
        ([f"input={base}", "base=x"], "base=x names the Hugging Face base of a peft adapter directory"),
    ]:
        assert main(["to_hf", *args, out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and message in err, err
    broken = tmp_path / "dora"
    shutil.copytree(peft_dir, broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert main(["from_hf", f"input={broken}", f"base={base}", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "adapter_config.json: use_dora=true is not supported" in err
    assert not os.path.exists(tmp_path / "out")


def test_trained_adapters_export_to_peft_with_our_logits(families, tmp_path):
    """The issue's check after training: adapters trained by a LoRA run on an imported Llama,
    exported as a peft directory and loaded by ``PeftModel.from_pretrained`` onto the Hugging Face
    base, give our model's logits (base + those adapters) to 1e-5 in fp32."""
    from megatron_hydra import launcher
    from megatron_hydra.checkpoint import standalone, store
    from megatron_hydra.convert import api

    hf, _, base, *_ = families["llama"]
    run_dir = tmp_path / "run"
    cfg = compose_config([f"checkpoint.load={base}", "peft=lora", "peft.rank=4", "data=synthetic", "trainer=cpu",
                          "trainer.max_steps=3", "optim.warmup_steps=1", "optim.lr=0.02", "precision=fp32",
                          "data.micro_batch_size=2", "trainer.enable_progress_bar=false",
                          "trainer.generate_sample_tokens=0"], str(run_dir))
    cfg.model = standalone.read_config(base).model  # model=from_checkpoint, as launch.py resolves it
    cfg.model.seq_length = 16
    launcher.run(cfg)
    adapter = store.latest(str(run_dir / "checkpoints"))
    assert store.step_of(adapter) == 3
    model, *_ = _ours(base, standalone.read_config(adapter), adapter)
    assert all(p.abs().max() > 0 for n, p in model.named_parameters() if ".lora.b" in n)  # trained: B left zero
    out = str(tmp_path / "peft")
    api.to_hf(adapter, out)
    with torch.no_grad():
        theirs = _with_adapter(hf, out)(TOKENS).logits
        assert (theirs - hf(TOKENS).logits).abs().max() > 1e-3
    torch.testing.assert_close(_logits(model), theirs, atol=1e-5, rtol=0)
