"""Generation: the KV cache changes nothing but speed, sampling follows its definitions, and
greedy decoding of an imported GPT-2 gives transformers' own greedy tokens."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from conftest import compose_config


def _model(position_embedding: str, activation: str, groups: int):
    from megatron_hydra.checkpoint.standalone import single_process
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.parallel.state import ParallelState

    cfg = compose_config(["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                          f"model.num_query_groups={groups}", "model.seq_length=48", "model.vocab_size=200",
                          f"model.position_embedding={position_embedding}", f"model.activation={activation}",
                          "model.init_std=0.3", "precision=fp64"])
    cfg, derived = single_process(cfg)
    model = GPTModel(derived.transformer, ParallelState.single())
    init_weights(model, derived.transformer, seed=7, tp_rank=0, tp_size=1)
    return cfg, model.eval()


def _greedy():
    from megatron_hydra.generate import SamplingConfig

    return SamplingConfig(greedy=True)


@pytest.mark.parametrize("variant", [("learned", "gelu", 4), ("rope", "swiglu", 2)], ids=["gpt2_style", "llama_gqa"])
def test_kv_cache_greedy_equals_full_recompute(variant):
    from megatron_hydra.generate import generate

    _, model = _model(*variant)
    prompt = [5, 17, 99, 3, 42]
    cached = generate(model, prompt, 24, _greedy(), use_cache=True)
    recomputed = generate(model, prompt, 24, _greedy(), use_cache=False)
    assert len(cached) == 24 and cached == recomputed
    assert len(set(cached)) > 3  # a real sequence, not one repeated token


def test_stops_at_end_of_document():
    from megatron_hydra.generate import generate

    _, model = _model("learned", "gelu", 4)
    free = generate(model, [1, 2, 3], 30, _greedy())
    eod = free[5]
    stopped = generate(model, [1, 2, 3], 30, _greedy(), eod=eod)
    assert stopped == free[:free.index(eod)]


def test_generation_beyond_positions_is_refused():
    from megatron_hydra.errors import ConfigError
    from megatron_hydra.generate import generate

    _, model = _model("learned", "gelu", 4)
    with pytest.raises(ConfigError, match="exceeds the model's 48 positions"):
        generate(model, [1] * 10, 39, _greedy())


def _frequencies(logits, sampling, n=20000):
    from megatron_hydra.generate import sample_next

    gen = torch.Generator().manual_seed(0)
    draws = sample_next(logits.expand(n, -1), sampling, gen)
    return torch.bincount(draws, minlength=logits.shape[-1]).double() / n


def test_sampling_distributions():
    """Empirical frequencies against the renormalised probabilities each rule defines."""
    from megatron_hydra.generate import SamplingConfig

    probs = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05], dtype=torch.float64)
    logits = torch.cat([probs.log(), torch.tensor([float("-inf")])])  # a padded entry
    plain = _frequencies(logits, SamplingConfig())
    assert torch.allclose(plain[:5], probs, atol=0.015) and plain[5] == 0
    top_k = _frequencies(logits, SamplingConfig(top_k=2))
    assert torch.allclose(top_k[:2], probs[:2] / probs[:2].sum(), atol=0.015) and top_k[2:].sum() == 0
    # top_p=0.7: 0.45 < 0.7 keeps the second token, 0.70 >= 0.7 drops the third.
    top_p = _frequencies(logits, SamplingConfig(top_p=0.7))
    assert torch.allclose(top_p[:2], probs[:2] / 0.7, atol=0.015) and top_p[2:].sum() == 0
    hot = _frequencies(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(hot[:5], (probs.log() / 2).softmax(-1), atol=0.015)
    assert _frequencies(logits, SamplingConfig(top_k=1))[0] == 1.0


@pytest.mark.parametrize("bad, key", [({"temperature": 0.0}, "sampling.temperature"), ({"top_k": -1}, "sampling.top_k"),
                                      ({"top_p": 1.5}, "sampling.top_p")])
def test_bad_sampling_settings(bad, key):
    from megatron_hydra.errors import ConfigError
    from megatron_hydra.generate import SamplingConfig, check_sampling

    with pytest.raises(ConfigError, match=key):
        check_sampling(SamplingConfig(**bad))


def test_greedy_matches_transformers_and_cli(tmp_path, capsys):
    """An imported GPT-2 decodes greedily to the tokens transformers' own generate gives."""
    transformers = pytest.importorskip("transformers")
    from megatron_hydra.checkpoint.standalone import load_model
    from megatron_hydra.convert import api
    from megatron_hydra.data.tokenizers import HFTokenizer, train_bpe
    from megatron_hydra.generate import generate, main

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                              vocab_size=300, bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path / "hf")
    train_bpe(["def main(argv):\n    return argv\n" * 8], 300, str(tmp_path / "hf" / "tokenizer.json"))
    api.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    _, _, model = load_model(str(tmp_path / "ckpt"))
    prompt = [7, 8, 9, 10]
    theirs = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(model, prompt, 20, _greedy()) == theirs

    tok = HFTokenizer(str(tmp_path / "ckpt" / "tokenizer.json"))
    expected = generate(model, tok.encode("def main("), 12, _greedy(), eod=tok.eod)
    run_dir = f"run_dir={tmp_path / 'run'}"
    with mock.patch.dict(os.environ):  # the one-process run sets its rendezvous variables
        assert main([f"checkpoint={tmp_path / 'ckpt'}", "prompt=def main(", "max_new_tokens=12",
                     "sampling.greedy=true", run_dir]) == 0
    assert capsys.readouterr().out == "def main(" + tok.decode(expected) + "\n"
    assert main([f"checkpoint={tmp_path / 'ckpt'}", "sampling.top_p=2", run_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sampling.top_p=2.0") and "\n" not in err
    assert main([f"checkpoint={tmp_path / 'nowhere'}", run_dir]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_training_sample_is_the_reference_loop_and_names_what_it_skips():
    """The end-of-run sample (the inference engine on the live model) draws the tokens of the
    single-process loop with a generator seeded ``cfg.seed``; a layout the engine does not run
    gets a reason instead, the same on every rank (the config says it)."""
    from megatron_hydra.data.tokenizers import ByteTokenizer
    from megatron_hydra.generate import generate
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.inference_job import (SAMPLE_PROMPT, SAMPLE_SAMPLING, no_sample_reason,
                                                       training_sample)

    cfg, model = _model("learned", "gelu", 4)
    cfg.data.name, cfg.data.tokenizer.type, cfg.data.blend = "indexed", "byte", ["unused"]
    cfg.trainer.generate_sample_tokens = 8
    single = ParallelState.single()
    text = training_sample(model, cfg, model.cfg, single)
    tok = ByteTokenizer()
    reference = generate(model, tok.encode(SAMPLE_PROMPT), 8, SAMPLE_SAMPLING, eod=tok.eod,
                         generator=torch.Generator().manual_seed(cfg.seed))
    assert text == SAMPLE_PROMPT + tok.decode(reference) and len(reference) == 8
    assert no_sample_reason(cfg, single) is None
    cfg.parallel.context_parallel_size = 2
    assert no_sample_reason(cfg, single) == "context parallelism"
    cfg.parallel.context_parallel_size, cfg.parallel.virtual_pipeline_size = 1, 2
    assert no_sample_reason(cfg, single) == "virtual pipeline stages"


def test_sample_length_is_validated():
    from megatron_hydra.config import derive
    from megatron_hydra.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.generate_sample_tokens=-1"):
        derive(compose_config(["trainer.generate_sample_tokens=-1"]))
