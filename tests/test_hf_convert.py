"""Hugging Face interop: import gives transformers' logits at every layout, export round-trips.

The references are transformers' own models: small random GPT-2, Llama and Mixtral built here
(weights spread out so that a mapping error cannot hide in near-zero logits), saved with
save_pretrained. Imported checkpoints are loaded at tp1, tp2 and pp2 (Mixtral also at ep2) through
the same code a training run uses, and their logits must equal transformers' to 1e-4 in float32. Exported directories are loaded
back by transformers and must hold bitwise the tensors of the original model.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import assert_reloads_bitwise, compose_config, launch_py, spawn_ranks

transformers = pytest.importorskip("transformers")

VOCAB = 300  # padded to 384 at tp1 and 512 at tp2: the padding differs between layouts
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def _spread(model) -> None:
    """Replace transformers' tiny init by O(1) random weights (norm weights around one)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(noise + 1.0 if "ln" in name or "norm" in name else noise)


def _hf_gpt2(path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    _spread(model)
    model.save_pretrained(path)
    from megatron_hydra.data.tokenizers import train_bpe

    text = ["def main(argv):\n    return argv[0] + 1\n" * 4, "the quick brown fox jumps over the lazy dog\n" * 4]
    train_bpe(text, VOCAB, os.path.join(path, "tokenizer.json"))
    return model.eval()


def _hf_llama(path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    _spread(model)
    model.save_pretrained(path)
    return model.eval()


def _hf_mixtral(path):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                     vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
                                     rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                                     router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = transformers.MixtralForCausalLM(cfg)
    _spread(model)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{architecture: (hf model, its directory, our imported checkpoint, transformers' logits)}."""
    from megatron_hydra.convert import api

    out = {}
    for kind, build in (("gpt2", _hf_gpt2), ("llama", _hf_llama), ("mixtral", _hf_mixtral)):
        root = tmp_path_factory.mktemp(kind)
        hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
        model = build(hf_dir)
        api.from_hf(hf_dir, ckpt, parallel="tp2_pp2", name=f"tiny_{kind}")
        with torch.no_grad():
            out[kind] = (model, hf_dir, ckpt, model(TOKENS).logits)
    return out


ARCHS = ["gpt2", "llama", "mixtral"]
LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}  # (tp, pp, ep)
# Every architecture at tp2 and pp2; the MoE one also with its experts split over two ranks.
CASES = [(kind, layout) for kind in ARCHS for layout in ("tp2", "pp2")] + [("mixtral", "ep2")]


@pytest.mark.parametrize("kind", ARCHS)
def test_import_writes_model_config_and_tokenizer(models, kind):
    """The model config is stored as data in meta.json (read by model=from_checkpoint); no YAML is
    written for Hydra's config search path, since a checkpoint is never one."""
    from megatron_hydra.checkpoint.standalone import read_config

    ckpt = models[kind][2]
    assert read_config(ckpt).model.name == f"tiny_{kind}"
    assert not os.path.exists(os.path.join(ckpt, "model"))
    assert os.path.isfile(os.path.join(ckpt, "tokenizer.json")) == (kind == "gpt2")
    assert not os.path.exists(os.path.join(ckpt, "rng"))  # loads start from their own seeds


@pytest.mark.parametrize("kind", ARCHS)
def test_single_process_logits_match_transformers(models, kind):
    from megatron_hydra.checkpoint.standalone import load_model

    *_, ckpt, ref = models[kind]
    _, _, model = load_model(ckpt)
    with torch.no_grad():
        ours = model(TOKENS)
    torch.testing.assert_close(ours[..., :VOCAB], ref, atol=1e-4, rtol=0)
    assert torch.isinf(ours[..., VOCAB:]).all()


def _layout_logits(ckpt, layout, world, tokens):
    """Load ``ckpt`` at ``layout`` on this rank as a training run builds its model; return this
    rank's logits shard (tp), the last stage's logits (pp) or this rank's logits (ep: the experts
    split over the two data-parallel ranks, both given the same tokens)."""
    import torch.distributed as dist

    from megatron_hydra.checkpoint import sharded, standalone
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.models.stages import build_stage_chunks

    cfg, _ = standalone.single_process(standalone.read_config(ckpt))
    tp, pp, ep = layout
    cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size = tp, pp
    cfg.parallel.expert_parallel_size = ep
    cfg.trainer.devices = world
    derived = derive(cfg)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp, ep=ep)
    chunks, _ = build_stage_chunks(cfg, derived, ps)
    model = torch.nn.ModuleList(chunks) if derived.pp > 1 else chunks[0]
    sharded.load(ckpt, model, None, ps, derived.transformer.vocab_size, load_optimizer=False)
    stage = chunks[0].eval()
    with torch.no_grad():
        if derived.pp == 1:
            return stage(tokens).numpy()
        if ps.pp_rank == 0:
            dist.send(stage(tokens).contiguous(), dst=1)
            return None
        hidden = torch.empty(*tokens.shape, derived.transformer.hidden_size)
        dist.recv(hidden, src=0)
        return stage(hidden).numpy()


def _all_layouts(rank, world, ckpts, tokens):
    return {(kind, name): _layout_logits(ckpts[kind], LAYOUTS[name], world, tokens) for kind, name in CASES}


@pytest.fixture(scope="module")
def layout_logits(models):
    """Every (architecture, layout)'s logits from one start of two gloo ranks."""
    results = spawn_ranks(_all_layouts, 2, {kind: m[2] for kind, m in models.items()}, TOKENS)
    out = {}
    for kind in ARCHS:
        out[kind, "tp2"] = torch.cat([torch.from_numpy(results[r][kind, "tp2"]) for r in (0, 1)], dim=-1)
        out[kind, "pp2"] = torch.from_numpy(results[1][kind, "pp2"])
    out["mixtral", "ep2"] = torch.stack([torch.from_numpy(results[r]["mixtral", "ep2"]) for r in (0, 1)])
    return out


@pytest.mark.parametrize("kind,layout", CASES)
def test_parallel_logits_match_transformers(models, layout_logits, kind, layout):
    ref = models[kind][3]
    logits = layout_logits[kind, layout]
    for rank_logits in (logits if layout == "ep2" else [logits]):  # ep2: each rank's, the same tokens
        torch.testing.assert_close(rank_logits[..., :VOCAB], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ARCHS)
def test_export_reloads_bitwise_in_transformers(models, kind, tmp_path):
    from megatron_hydra.convert import api

    model, hf_dir, ckpt, _ = models[kind]
    out = tmp_path / "exported"
    api.to_hf(ckpt, str(out))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert_reloads_bitwise(model, back)
    assert os.path.isfile(out / "tokenizer.json") == (kind == "gpt2")


def test_cli_import_then_documented_fine_tune_command(models, tmp_path, env_no_launcher, capsys):
    """The documented commands: convert's CLI, then launch.py fine-tuning the import."""
    from megatron_hydra.convert.__main__ import main

    hf_dir = models["gpt2"][1]
    ckpt = tmp_path / "ckpt"
    assert main(["from_hf", f"input={hf_dir}", f"output={ckpt}", "name=tiny"]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert command[:2] == ["python", "launch.py"] and f"checkpoint.load={ckpt}" in command
    code = launch_py([*command[2:], "data=synthetic", "model.seq_length=32", "data.micro_batch_size=2",
                      "data.global_batch_size=2", "trainer.max_steps=1", "optim.warmup_steps=0",
                      "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"], env_no_launcher)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert f"resumed from {ckpt} at step 0" in out.err + out.out


# Bad input: one line naming the file or key ------------------------------------------------------
def _error_line(argv, capsys) -> str:
    from megatron_hydra.convert.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}))
    err = _error_line(["from_hf", f"input={tmp_path}", f"output={tmp_path / 'out'}"], capsys)
    assert "model_type='gpt_neox'" in err and "gpt2, llama, bert, t5" in err


def test_missing_files(tmp_path, capsys):
    assert "has no config.json" in _error_line(["from_hf", f"input={tmp_path}", f"output={tmp_path / 'o'}"], capsys)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2,
                                                      "n_positions": 8, "vocab_size": 10}))
    assert "has no weights" in _error_line(["from_hf", f"input={tmp_path}", f"output={tmp_path / 'o'}"], capsys)
    assert "no such file or directory" in _error_line(["to_hf", f"input={tmp_path / 'nothing'}", f"output={tmp_path / 'x'}"], capsys)


def test_shape_mismatch(models, tmp_path, capsys):
    import shutil

    hf_dir = models["gpt2"][1]
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["vocab_size"] = VOCAB + 1
    (broken / "config.json").write_text(json.dumps(config))
    err = _error_line(["from_hf", f"input={broken}", f"output={tmp_path / 'out'}"], capsys)
    assert f"has shape [{VOCAB}, 64] but config.json implies [{VOCAB + 1}, 64]" in err


def test_bad_arguments(models, tmp_path, capsys):
    hf_dir = models["gpt2"][1]
    assert "inptu" in _error_line(["from_hf", "inptu=x", "output=y"], capsys)
    assert "parallel=tp3: no such layout" in _error_line(
        ["from_hf", f"input={hf_dir}", f"output={tmp_path / 'o'}", "parallel=tp3"], capsys)
    assert "not divisible by parallel.tensor_parallel_size=8" in _error_line(
        ["from_hf", f"input={hf_dir}", f"output={tmp_path / 'o'}", "parallel=tp8"], capsys)
    assert "already exists" in _error_line(["from_hf", f"input={hf_dir}", f"output={hf_dir}"], capsys)


def test_export_refuses_a_model_without_hf_counterpart(tmp_path, capsys):
    from megatron_hydra.checkpoint import standalone
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.parallel.state import ParallelState

    cfg = compose_config(["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
                          "model.vocab_size=50", "model.position_embedding=rope"])
    cfg, derived = standalone.single_process(cfg)
    model = GPTModel(derived.transformer, ParallelState.single())
    init_weights(model, derived.transformer, cfg.seed, 0, 1)  # saves refuse non-finite weights
    standalone.save_model(str(tmp_path / "ckpt"), model, cfg, derived, layout={"world": 1})
    err = _error_line(["to_hf", f"input={tmp_path / 'ckpt'}", f"output={tmp_path / 'hf'}"], capsys)
    assert "no Hugging Face counterpart" in err


def test_weight_files_sharded_safetensors_and_pytorch_bin(tmp_path):
    """Large exports are split into shards with an index; imports read shards and .bin files."""
    from megatron_hydra.convert import hf_files

    tensors = {f"w{i}": torch.randn(10, 10, generator=torch.Generator().manual_seed(i)) for i in range(5)}
    files = hf_files.write(str(tmp_path / "sharded"), {"model_type": "gpt2"}, tensors, max_shard_bytes=900)
    assert files[-1] == hf_files.SAFETENSORS_INDEX and len(files) == 2 + 3  # config, 3 shards of <= 2 tensors, index
    read = hf_files.read_weights(str(tmp_path / "sharded"))
    assert sorted(read) == sorted(tensors) and all(torch.equal(read[k], tensors[k]) for k in tensors)
    (tmp_path / "bin").mkdir()
    torch.save(tensors, tmp_path / "bin" / hf_files.PT_BIN)
    read = hf_files.read_weights(str(tmp_path / "bin"))
    assert all(torch.equal(read[k], tensors[k]) for k in tensors)
