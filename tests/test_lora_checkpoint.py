"""LoRA checkpoints: a run saves its adapters alone, loads its base from ``checkpoint.load`` and its
adapters from its own newest checkpoint or ``peft.adapter``, and resumes bitwise.

The references are independent: the uninterrupted run (bitwise, same layout; the original
layout's losses for a continuation at another one), the tensors as ``torch.distributed.checkpoint``
itself reads them back, and, for generation, the base model with every adapter merged into its
weights by the formula W + alpha / rank * B A, written here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, preflight_error, run_training, spawn_ranks

RANK, ALPHA = 4, 8.0
LORA = ["peft=lora", f"peft.rank={RANK}", f"peft.alpha={ALPHA}", "optim.lr=0.02"]
# Stopped after 2 of 4 steps: the second resumed step starts from state the resumed run made itself.
STEPS = ["trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0"]
MULTI = ["trainer.devices=2", "optim.distributed_optimizer=true"]  # dp2: each rank owns half the adapters' state
PROMPTS = ["def main(", "the quick brown fox"]
NEW_TOKENS = 8


def read_checkpoint(path: Path, out: Path) -> dict:
    """Every tensor of a checkpoint, read back by DCP's own converter (not by our loader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


def resume_from(ckpt: Path, run_dir: Path) -> Path:
    """A fresh run dir whose checkpoint directory holds only ``ckpt`` (as after a stop there)."""
    shutil.copytree(ckpt, run_dir / "checkpoints" / ckpt.name)
    return run_dir


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base (a 1-step full run), then LoRA runs on it: 4 steps in one process, the same stopped at
    step 2 and resumed; the same pair at dp2 with the distributed optimizer."""
    root = tmp_path_factory.mktemp("lora_ckpt")
    base_rows = run_training([*SMALL, "trainer.max_steps=1", "optim.warmup_steps=1"], root / "base")
    base = root / "base" / "checkpoints" / "step_0000001"
    lora = [*SMALL, *LORA, f"checkpoint.load={base}", *STEPS]
    out = SimpleNamespace(root=root, base=base, base_rows=base_rows, lora=lora)
    for name, layout in (("single", []), ("multi", MULTI)):
        rows = run_training([*lora, *layout], root / name)
        resumed_dir = resume_from(root / name / "checkpoints" / "step_0000002", root / f"{name}_resumed")
        resumed = run_training([*lora, *layout, "checkpoint.keep_last=1"], resumed_dir)
        setattr(out, name, SimpleNamespace(rows=rows, resumed=resumed, ckpts=root / name / "checkpoints",
                                           resumed_ckpts=resumed_dir / "checkpoints"))
    return out


@pytest.mark.parametrize("layout", ["single", "multi"])
def test_resume_is_bitwise_exact(runs, layout, tmp_path):
    run = getattr(runs, layout)
    assert [r["step"] for r in run.resumed] == [2.0, 3.0]
    assert [r["loss"] for r in run.resumed] == [r["loss"] for r in run.rows[2:]]
    assert [r["consumed_samples"] for r in run.resumed] == [r["consumed_samples"] for r in run.rows[2:]]
    a = read_checkpoint(run.ckpts / "step_0000004", tmp_path / "a.pt")
    b = read_checkpoint(run.resumed_ckpts / "step_0000004", tmp_path / "b.pt")
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # Retention as for full checkpoints: keep_last=1 left the newest alone.
    assert sorted(p.name for p in run.resumed_ckpts.glob("step_*")) == ["step_0000004"]


def test_a_save_holds_the_adapters_alone(runs, tmp_path):
    ckpt = runs.single.ckpts / "step_0000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["adapter_only"] is True and meta["has_optimizer"] is True
    saved = read_checkpoint(ckpt, tmp_path / "adapters.pt")
    names = {k[len("model/"):] for k in saved if k.startswith("model/")}
    assert names and all(".lora." in n for n in names)
    assert names == set(meta["shapes"])
    assert {k.split("/")[1] for k in saved if k.startswith("optim/")} == names
    for name, shape in meta["shapes"].items():
        assert list(saved[f"model/{name}"].shape) == shape
    # b starts at zero and trained; every layer's qkv has its three adapters.
    assert saved["model/layers.1.attention.qkv.lora.b_v"].abs().max() > 0
    assert {n.rpartition(".")[2] for n in names if ".qkv." in n} == {"a_q", "b_q", "a_k", "b_k", "a_v", "b_v"}
    assert checkpoint_bytes(ckpt) < checkpoint_bytes(runs.base) / 4


def test_the_base_comes_from_checkpoint_load(runs, tmp_path):
    """Without checkpoint.load the base is the seeded initial model: with b = 0 its first loss is
    the base run's first (the same initial model, the same batch). With it, the loaded base's."""
    initial = run_training([*SMALL, *LORA, "trainer.max_steps=1", "optim.warmup_steps=1"], tmp_path / "initial")
    assert initial[0]["loss"] == runs.base_rows[0]["loss"] != runs.single.rows[0]["loss"]


def test_adapters_load_at_another_layout(runs, tmp_path):
    """The dp2 run's step-2 adapters continue in one process: the same adapter tensors, and the
    original layout's losses (fp32, another reduction order). (Saved at tp2: see the generation
    test.)"""
    from megatron_hydra.checkpoint import sharded
    from megatron_hydra.checkpoint.standalone import load_model

    ckpt = runs.multi.ckpts / "step_0000002"
    _, _, model = load_model(str(runs.base), adapter=str(ckpt))
    saved = read_checkpoint(ckpt, tmp_path / "multi.pt")
    loaded = {e.name: e.param for e in sharded.entries(model, "adapters")}
    assert loaded.keys() == {k[len("model/"):] for k in saved if k.startswith("model/")}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, saved[f"model/{name}"]), name
    rows = run_training(runs.lora, resume_from(ckpt, tmp_path / "single"))
    assert [r["step"] for r in rows] == [2.0, 3.0]
    assert_same_trajectory(rows, runs.multi.rows[2:], rel=1e-5, keys=("loss",))


def test_peft_adapter_starts_a_new_run_from_the_weights(runs, tmp_path):
    """peft.adapter: the adapters' weights (its first loss is not the zero adapters'), at step 0
    on the first batch, with fresh optimizer state (one AdamW step counted after one step)."""
    ckpt = runs.single.ckpts / "step_0000004"
    rows = run_training([*SMALL, *LORA, f"checkpoint.load={runs.base}", f"peft.adapter={ckpt}",
                         "trainer.max_steps=1", "optim.warmup_steps=1"], tmp_path / "warm")
    assert [(r["step"], r["consumed_samples"]) for r in rows] == [(0.0, 8.0)]
    assert rows[0]["loss"] != runs.single.rows[0]["loss"]
    saved = read_checkpoint(tmp_path / "warm" / "checkpoints" / "step_0000001", tmp_path / "warm.pt")
    steps = {v.item() for k, v in saved.items() if k.endswith("/step")}
    assert steps == {1.0}


def test_a_stop_request_saves_the_adapters(runs, tmp_path):
    """SIGTERM's save-and-stop (the ranks' agreement stubbed to say SIGTERM after step 1) writes an
    adapter checkpoint, which resumes."""
    from unittest import mock

    from megatron_hydra.training.checkpointing import CheckpointCallback

    with mock.patch.object(CheckpointCallback, "_agree_to_stop", lambda self, device: 1.0):
        rows = run_training(runs.lora, tmp_path / "stopped")
    assert [r["step"] for r in rows] == [0.0]
    ckpt = tmp_path / "stopped" / "checkpoints" / "step_0000001"
    assert json.loads((ckpt / "meta.json").read_text())["adapter_only"] is True
    resumed = run_training(runs.lora, tmp_path / "stopped")  # the history continues in the same csv
    assert [r["step"] for r in resumed] == [0.0, 1.0, 2.0, 3.0]


# Bad input: one line naming the key and the file, before any worker starts --------------------
def _other_base(runs) -> Path:
    """A weights-only checkpoint of a model with another MLP width (written once)."""
    from conftest import compose_config
    from megatron_hydra.checkpoint import plan, standalone
    from megatron_hydra.config import derive
    from megatron_hydra.models.stages import build_model
    from megatron_hydra.parallel.state import ParallelState

    path = runs.root / "other_base"
    if not path.exists():
        cfg = compose_config([*SMALL, "model.ffn_hidden_size=128"])
        derived = derive(cfg)
        model = build_model(cfg, derived, ParallelState.single(), torch.device("cpu"))
        standalone.save_model(str(path), model, cfg, derived, plan.layout(derived))
    return path


def _adapter_dir(runs, tmp_path, which: str) -> str:
    """A checkpoint.dir whose newest checkpoint is an adapter one (or, ``full``, the base)."""
    source = runs.single.ckpts / "step_0000002" if which == "adapters" else runs.base
    return str(resume_from(source, tmp_path / f"dir_{which}") / "checkpoints")


BAD = {
    "base is an adapter checkpoint": (lambda r, t: [*LORA, f"checkpoint.load={r.single.ckpts}/step_0000002"],
                                      "checkpoint.load={a} holds LoRA adapters alone"),
    "peft=none from an adapter checkpoint": (lambda r, t: [f"checkpoint.load={r.single.ckpts}/step_0000002"],
                                             "checkpoint.load={a} holds LoRA adapters alone"),
    "adapter is a full checkpoint": (lambda r, t: [*LORA, f"checkpoint.load={r.base}", f"peft.adapter={r.base}"],
                                     "peft.adapter={b} is a full checkpoint"),
    "other rank": (lambda r, t: [*LORA, "peft.rank=2", f"checkpoint.load={r.base}",
                                 f"peft.adapter={r.single.ckpts}/step_0000002"],
                   "peft.adapter={a} holds adapters trained with peft.rank=4, but this run has peft.rank=2"),
    "other alpha": (lambda r, t: [*LORA, "peft.alpha=16", f"checkpoint.load={r.base}",
                                  f"peft.adapter={r.single.ckpts}/step_0000002"], "set peft.alpha=8.0"),
    "other targets": (lambda r, t: [*LORA, "peft.target_modules=[qkv]", f"checkpoint.load={r.base}",
                                    f"peft.adapter={r.single.ckpts}/step_0000002"],
                      "set peft.target_modules=[qkv,proj,fc1,fc2]"),
    "adapter of another base": (lambda r, t: [*LORA, "model.ffn_hidden_size=128",
                                              f"checkpoint.load={_other_base(r)}",
                                              f"peft.adapter={r.single.ckpts}/step_0000002"],
                                "peft.adapter={a}: tensor layers.0.mlp.fc1.lora.b has shape [256, 4] there but "
                                "[128, 4] in this model"),
    "adapter without its base": (lambda r, t: [*LORA, f"peft.adapter={r.single.ckpts}/step_0000002"],
                                 "add checkpoint.load={b}"),
    "LoRA resuming full checkpoints": (lambda r, t: [*LORA, f"checkpoint.dir={_adapter_dir(r, t, 'full')}"],
                                       "which a peft=lora run does not continue"),
    "full run resuming adapters": (lambda r, t: [f"checkpoint.dir={_adapter_dir(r, t, 'adapters')}"],
                                   "holds the adapter checkpoints of a peft=lora run"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_before_training(runs, case, tmp_path):
    overrides, expected = BAD[case]
    message = preflight_error(tmp_path, *overrides(runs, tmp_path))
    assert expected.format(a=runs.single.ckpts / "step_0000002", b=runs.base) in message


# Generation and evaluation of base + adapters --------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(runs):
    from megatron_hydra.data.tokenizers import train_bpe

    path = runs.root / "tokenizer.json"
    train_bpe(["def main(argv):\n    return argv\n" * 8, "the quick brown fox jumps over the lazy dog\n" * 4], 300,
              str(path))
    return path


@torch.no_grad()
def _reference_text(base: Path, adapter, tokenizer: Path, out: Path) -> str:
    """Greedy text of the base model, with (``adapter``) W + alpha / rank * B A in every adapted
    weight (q, k and v rows of the fused qkv in its per-group [q heads, k, v] order), by the
    single-process loop."""
    from megatron_hydra.checkpoint.standalone import load_model
    from megatron_hydra.config.schema import SamplingConfig
    from megatron_hydra.data.tokenizers import HFTokenizer
    from megatron_hydra.generate import generate

    cfg, _, model = load_model(str(base))
    assert cfg.peft.name == "none"
    if adapter is not None:
        _merge(model, cfg, read_checkpoint(adapter, out))
    tok = HFTokenizer(str(tokenizer))
    greedy = SamplingConfig(greedy=True)
    return "".join(p + tok.decode(generate(model, tok.encode(p), NEW_TOKENS, greedy, eod=tok.eod)) + "\n"
                   for p in PROMPTS)


def _merge(model, cfg, saved: dict) -> None:
    weights = dict(model.named_parameters())
    heads = cfg.model.num_attention_heads
    groups, d = cfg.model.num_query_groups or heads, cfg.model.hidden_size // heads
    scale = ALPHA / RANK
    for i in range(cfg.model.num_layers):
        for layer in ("attention.proj", "mlp.fc1", "mlp.fc2"):
            a, b = (saved[f"model/layers.{i}.{layer}.lora.{x}"].double() for x in "ab")
            weights[f"layers.{i}.{layer}.weight"].add_((scale * b @ a).float())
        parts = []
        for part, rows in (("q", heads // groups * d), ("k", d), ("v", d)):
            a, b = (saved[f"model/layers.{i}.attention.qkv.lora.{x}_{part}"].double() for x in "ab")
            parts.append((scale * b @ a).view(groups, rows, -1))
        weights[f"layers.{i}.attention.qkv.weight"].add_(torch.cat(parts, dim=1).flatten(0, 1).float())


def _generate_at(rank, world, base, adapter, tokenizer, run_dir):
    """Greedy text of base + adapter through the inference job's config and loading, at tp2 and
    pp2; at tp2 the loaded adapters are saved again (``run_dir``/tp2), adapters alone."""
    from megatron_hydra.checkpoint import plan, sharded
    from megatron_hydra.config import derive
    from megatron_hydra.config.schema import SamplingConfig
    from megatron_hydra.data.tokenizers import HFTokenizer
    from megatron_hydra.inference.engine import Engine
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.inference_cli import job_config
    from megatron_hydra.training.inference_job import load_stage

    tok = HFTokenizer(tokenizer)
    out = {}
    for layout in ("parallel=tp2", "parallel=pp2"):
        cfg = job_config("generate", base, [layout, f"trainer.devices={world}", f"peft.adapter={adapter}"], [],
                         tokenizer, run_dir, 0, None)
        derived = derive(cfg)  # job_config took the adapters' peft settings (checkpoint.adapters.adopt)
        ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp)
        chunks = load_stage(cfg, derived, ps, torch.device("cpu"))
        if derived.tp == 2:
            sharded.save(f"{run_dir}/tp2", torch.nn.ModuleList(chunks), None, ps, derived.transformer.vocab_size,
                         plan.meta(cfg, derived, 0, 0, select="adapters"), rng_states=False, select="adapters")
        ids = Engine(chunks, ps, derived.transformer, batch_size=2).generate(
            [tok.encode(p) for p in PROMPTS], NEW_TOKENS, SamplingConfig(greedy=True), seed=0, eod=tok.eod)
        out[layout] = "".join(p + tok.decode(i) + "\n" for p, i in zip(PROMPTS, ids))
    return out


def test_generate_with_adapters_equals_the_merged_model(runs, tokenizer, tmp_path, capsys):
    """``python -m megatron_hydra.generate checkpoint=BASE peft.adapter=ADAPTER`` (one process,
    the adapters' rank and alpha read from their checkpoint), and the same loading at tp2 and
    pp2, print the merged model's greedy text, which is not the base's."""
    from megatron_hydra.generate import main

    adapter = runs.single.ckpts / "step_0000004"
    merged = _reference_text(runs.base, adapter, tokenizer, tmp_path / "adapter.pt")
    assert merged != _reference_text(runs.base, None, tokenizer, tmp_path / "none.pt")
    code = main([f"checkpoint={runs.base}", f"peft.adapter={adapter}", f"prompts=[{','.join(PROMPTS)}]",
                 f"max_new_tokens={NEW_TOKENS}", "sampling.greedy=true", f"tokenizer={tokenizer}",
                 f"run_dir={tmp_path / 'run'}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == merged
    sharded_runs = spawn_ranks(_generate_at, 2, str(runs.base), str(adapter), str(tokenizer), str(tmp_path / "r"))
    assert sharded_runs[0] == {"parallel=tp2": merged, "parallel=pp2": merged}
    # Loaded at tp2 and saved from there: the same adapter tensors, read back in one process.
    resaved = read_checkpoint(tmp_path / "r" / "tp2", tmp_path / "tp2.pt")
    original = {k: v for k, v in read_checkpoint(adapter, tmp_path / "again.pt").items() if k.startswith("model/")}
    assert resaved.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(resaved[key], tensor), key


CLI_BAD = {
    "adapter as the checkpoint": (["checkpoint={a}"], "checkpoint={a} holds LoRA adapters alone"),
    "full checkpoint as the adapter": (["checkpoint={b}", "peft.adapter={b}"], "peft.adapter={b} is a full checkpoint"),
    "another peft option": (["checkpoint={b}", "peft.rank=2"], "peft.adapter=PATH is the one peft option here"),
}


@pytest.mark.parametrize("case", list(CLI_BAD), ids=list(CLI_BAD))
def test_generate_bad_adapter_input_is_one_line(runs, case, tmp_path, capsys):
    from unittest import mock

    from megatron_hydra import generate, launcher

    extra, expected = CLI_BAD[case]
    fill = dict(a=runs.single.ckpts / "step_0000002", b=runs.base)

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    with mock.patch.object(launcher, "_run_locked", no_workers):
        code = generate.main([*(e.format(**fill) for e in extra), f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected.format(**fill) in err
