"""Config composition, derivation, and every validation error a user can hit before launch."""

from __future__ import annotations

import math
import subprocess

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import CONF, compose_config, launch_cmd
from megatron_hydra.config import derive
from megatron_hydra.config.io import from_yaml, to_yaml
from megatron_hydra.errors import ConfigError

GROUP_OPTIONS = [(group.name, f.stem) for group in sorted(CONF.iterdir()) if group.is_dir()
                 for f in sorted(group.glob("*.yaml"))]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_config_file_composes(group, option):
    cfg = compose_config([f"{group}={option}"])
    assert getattr(cfg, group).name == option
    # The text workers and checkpoints carry: OmegaConf's own serialisation, and it reads back.
    text = to_yaml(cfg)
    assert text == OmegaConf.to_yaml(OmegaConf.structured(cfg))
    assert from_yaml(text, "test") == cfg


def test_published_shapes_derive():
    # Llama 3 8B: 32 heads, 8 KV groups, 128-d heads, SwiGLU 14336, untied, vocab padded for tp=1.
    d = derive(compose_config(["model=llama3_8b"])).transformer
    assert (d.num_query_groups, d.kv_channels, d.ffn_hidden_size, d.padded_vocab_size) == (8, 128, 14336, 128256)
    d = derive(compose_config(["model=gpt_175b"])).transformer
    assert (d.kv_channels, d.ffn_hidden_size, d.padded_vocab_size) == (128, 4 * 12288, 50304)


def test_derived_values():
    cfg = compose_config(["trainer.devices=4", "data.micro_batch_size=2", "data.global_batch_size=32"])
    d = derive(cfg)
    assert (d.world_size, d.dp, d.num_microbatches) == (4, 4, 4)
    assert d.layers_per_stage == (cfg.model.num_layers,)
    assert d.split_samples == (cfg.trainer.max_steps * 32, 0, 0)  # no validation by default
    d = derive(compose_config(["trainer.val_check_interval=5", "trainer.limit_val_batches=3", "trainer.max_steps=20"]))
    assert d.split_samples == (20 * 4, 3 * 4, 0)  # the default global batch: micro-batch 4 x dp 1 x pp 1
    # swiglu's default ffn: 8h/3 rounded up to a multiple of 256.
    d = derive(compose_config(["model.activation=swiglu", "model.hidden_size=1000", "model.num_attention_heads=8"]))
    assert d.transformer.ffn_hidden_size == 256 * math.ceil(int(8000 / 3) / 256) == 2816


def test_pipeline_layout_derives():
    # tp2 x pp2 on 8 ranks -> dp2; 4 virtual stages of 2 layers; 16 / (2 x 2) = 4 micro-batches.
    d = derive(compose_config(["parallel=tp2_pp2", "trainer.devices=8", "model.num_layers=8", "data.micro_batch_size=2",
                               "data.global_batch_size=16", "parallel.virtual_pipeline_size=2",
                               "parallel.pipeline_schedule=interleaved_1f1b"]))
    assert (d.tp, d.pp, d.dp, d.vpp, d.num_microbatches) == (2, 2, 2, 2, 4)
    assert d.layers_per_stage == (2, 2, 2, 2)
    d = derive(compose_config(["parallel=pp2", "trainer.devices=2", "parallel.layers_per_stage=[1,3]"]))
    assert d.layers_per_stage == (1, 3)
    # torch's looped schedules take any multiple of the rounds: 6 micro-batches on pp=4 is one round.
    derive(compose_config(["parallel=pp4", "trainer.devices=4", "parallel.pipeline_schedule=zero_bubble",
                           "data.micro_batch_size=1", "data.global_batch_size=6"]))


def test_padded_vocab_is_multiple_of_128_times_tp():
    from megatron_hydra.config.derive import padded_vocab_size

    for vocab in (1, 127, 128, 50257, 128256):
        for tp in (1, 2, 4, 8):
            padded = padded_vocab_size(vocab, 128, tp)
            assert padded % (128 * tp) == 0 and vocab <= padded < vocab + 128 * tp


def test_command_line_override_reaches_the_config():
    cfg = compose_config(["optim.lr=0.123", "model.hidden_size=96", "trainer.devices=3"])
    assert (cfg.optim.lr, cfg.model.hidden_size, cfg.trainer.devices) == (0.123, 96, 3)


@pytest.mark.parametrize("override,error", [
    ("model.hiden_size=3", ConfigKeyError),  # misspelled key
    ("model.num_layers=four", ValidationError),  # wrong type
    ("trainer.devices=1.5", ValidationError),
])
def test_schema_rejects_at_compose_time(override, error):
    with pytest.raises((ConfigCompositionException, error)):
        compose_config([override])


BAD = [
    (["trainer.devices=0"], "trainer.devices"),
    (["trainer.num_nodes=0"], "trainer.num_nodes"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["parallel.tensor_parallel_size=0"], "parallel.tensor_parallel_size"),
    (["parallel.context_parallel_size=2", "trainer.devices=3"], "trainer.devices"),
    (["trainer.devices=3", "parallel.pipeline_parallel_size=2"], "trainer.devices"),
    (["model.num_attention_heads=6", "model.hidden_size=60", "model.num_query_groups=4"], "model.num_query_groups"),
    (["model.hidden_size=250"], "model.hidden_size"),
    (["model.num_layers=3", "parallel.layers_per_stage=[1,1]"], "parallel.layers_per_stage"),
    (["data.global_batch_size=10", "data.micro_batch_size=4"], "data.global_batch_size"),
    (["data.micro_batch_size=0"], "data.micro_batch_size"),
    (["parallel.virtual_pipeline_size=2"], "parallel.virtual_pipeline_size"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["model.position_embedding=alibi"], "model.position_embedding"),
    (["model.normalization=batchnorm"], "model.normalization"),
    (["model.activation=tanh"], "model.activation"),
    (["precision.params_dtype=int8"], "precision.params_dtype"),
    (["optim.lr_schedule=step"], "optim.lr_schedule"),
    (["optim.lr=0.001", "optim.min_lr=0.01"], "optim.min_lr"),
    (["optim.warmup_steps=500", "trainer.max_steps=100"], "optim.warmup_steps"),
    (["model.hidden_dropout=1.0"], "model.hidden_dropout"),
    (["model.seq_length=512", "model.max_position_embeddings=256"], "model.max_position_embeddings"),
    (["model.position_embedding=rope", "model.kv_channels=33"], "model.kv_channels"),
    (["trainer.accelerator=tpu"], "trainer.accelerator"),
    (["model.ffn_hidden_size=0"], "model.ffn_hidden_size"),
    (["optim.clip_grad=-1"], "optim.clip_grad"),
    (["trainer.collective_timeout_s=0"], "trainer.collective_timeout_s"),
    (["trainer.limit_val_batches=0"], "trainer.limit_val_batches"),
    (["trainer.val_check_interval=-1"], "trainer.val_check_interval"),
    (["data.num_workers=-1"], "data.num_workers"),
    (["data.tokenizer.type=wordpiece"], "data.tokenizer.type"),
    # Pipeline parallelism (gpt_tiny has 4 layers; micro-batches of 4).
    (["trainer.devices=2", "parallel.pipeline_parallel_size=2", "model.num_layers=3"], "model.num_layers"),
    (["trainer.devices=2", "parallel.pipeline_parallel_size=2", "parallel.layers_per_stage=[1,2]"],
     "parallel.layers_per_stage"),
    (["trainer.devices=4", "parallel.pipeline_parallel_size=4", "data.global_batch_size=8"], "data.global_batch_size"),
    (["data.global_batch_size=0"], "data.global_batch_size"),
    (["trainer.devices=2", "parallel.pipeline_parallel_size=2", "parallel.virtual_pipeline_size=2"],
     "parallel.pipeline_schedule"),
    (["trainer.devices=2", "parallel.pipeline_parallel_size=2", "parallel.pipeline_schedule=interleaved_1f1b"],
     "parallel.virtual_pipeline_size"),
    (["trainer.devices=2", "parallel.pipeline_parallel_size=2", "parallel.pipeline_schedule=zbv"],
     "parallel.virtual_pipeline_size"),
    (["trainer.devices=4", "parallel.pipeline_parallel_size=4", "parallel.virtual_pipeline_size=2", "model.num_layers=8",
      "parallel.pipeline_schedule=interleaved_1f1b", "data.micro_batch_size=1", "data.global_batch_size=9"],
     "data.global_batch_size"),
    (["parallel.pipeline_schedule=gpipe"], "parallel.pipeline_schedule"),
]


@pytest.mark.parametrize("overrides,key", BAD)
def test_bad_config_raises_one_line_naming_the_key(overrides, key):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as info:
        derive(cfg)
    message = str(info.value)
    assert key in message and "\n" not in message


def test_multi_node_without_external_launcher_is_refused():
    from megatron_hydra.launcher import preflight

    cfg = compose_config(["trainer.num_nodes=2"])
    with pytest.raises(ConfigError, match="trainer.num_nodes"):
        preflight(cfg, derive(cfg), external=None)


def test_external_world_size_must_match_config():
    from megatron_hydra.launcher import ExternalLaunch, preflight

    cfg = compose_config(["trainer.devices=2"])
    with pytest.raises(ConfigError, match="trainer.devices"):
        preflight(cfg, derive(cfg), ExternalLaunch("torchrun", 0, 0, 4, 4))


def test_launch_py_prints_one_line_and_exits_2(tmp_path, env_no_launcher):
    out = subprocess.run(launch_cmd("model.num_attention_heads=7", f"hydra.run.dir={tmp_path}"),
                         capture_output=True, text=True, timeout=120, env=env_no_launcher)
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert lines == [lines[-1]] and "model.num_attention_heads=7" in lines[-1]
    assert "Traceback" not in out.stdout + out.stderr


# auto values (config/machine.py) and the derived global batch ---------------------------------------

def _unresolved(*overrides):
    """The config as launch.py composes it, before the launcher resolves ``auto``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatron_hydra.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=["run_dir=unused", *overrides]))


def _machine_values(cfg):
    return cfg.trainer.accelerator, cfg.trainer.devices, cfg.precision.params_dtype, cfg.data.num_workers


def test_auto_resolves_for_the_machine():
    from megatron_hydra.config.machine import resolve

    cfg = _unresolved()
    assert _machine_values(cfg) == ("auto", "auto", "auto", "auto") and cfg.data.global_batch_size is None
    cpu, gpu = resolve(cfg, visible_gpus=0), resolve(cfg, visible_gpus=8)
    assert _machine_values(cpu) == ("cpu", 1, "float32", 0) and cpu.data.global_batch_size == 4
    assert _machine_values(gpu) == ("gpu", 8, "bfloat16", 2) and gpu.data.global_batch_size == 4 * 8
    assert _machine_values(cfg) == ("auto", "auto", "auto", "auto")  # pure: a resolved copy
    assert resolve(gpu, visible_gpus=0) == gpu  # nothing left to resolve, whatever the machine
    # CPU: the fewest ranks the layout needs; torchrun/srun: the ranks they started on this node.
    assert resolve(_unresolved("parallel=tp4_pp2"), visible_gpus=0).trainer.devices == 8
    assert resolve(cfg, visible_gpus=1, local_ranks=4).trainer.devices == 4  # one GPU per task
    assert resolve(_unresolved("trainer=gpu"), visible_gpus=0).precision.params_dtype == "bfloat16"
    explicit = _unresolved("trainer=cpu", "trainer.devices=2", "precision=fp32", "data.num_workers=1",
                           "data.global_batch_size=16")
    assert _machine_values(resolve(explicit, visible_gpus=8)) == ("cpu", 2, "float32", 1)
    assert resolve(explicit, visible_gpus=8).data.global_batch_size == 16


def test_derive_refuses_what_is_not_resolved():
    with pytest.raises(ConfigError, match="trainer.accelerator=auto") as info:
        derive(_unresolved())
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="trainer.devices='eight' must be a positive integer or auto"):
        derive(compose_config(["trainer.devices=eight"]))


@pytest.mark.parametrize("overrides,gbs,nmb", [
    ([], 4, 1),
    (["trainer.devices=4"], 16, 1),  # micro-batch 4 x dp 4
    (["parallel=tp2_pp2", "trainer.devices=8"], 16, 2),  # 4 x dp 2 x pp 2
    (["parallel=pp4", "model.num_layers=8", "parallel.virtual_pipeline_size=2",
      "parallel.pipeline_schedule=interleaved_1f1b"], 16, 4),
    (["parallel=pp4", "parallel.pipeline_schedule=zero_bubble"], 16, 4),
    (["parallel=pp2", "parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=zbv"], 8, 2),
])
def test_null_global_batch_is_one_micro_batch_per_data_parallel_rank_and_stage(overrides, gbs, nmb):
    cfg = compose_config(overrides)
    d = derive(cfg)
    assert (cfg.data.global_batch_size, d.global_batch_size, d.num_microbatches) == (gbs, gbs, nmb)
    # derive alone computes the same default from a null batch.
    raw = _unresolved(*overrides, f"trainer.devices={cfg.trainer.devices}", "trainer.accelerator=cpu",
                      "precision=fp32", "data.num_workers=0")
    assert raw.data.global_batch_size is None and derive(raw).global_batch_size == gbs


def test_gpt_8b_tp4_pp2_on_cpu_is_one_line_naming_the_memory_fix(monkeypatch):
    """The design's ``python launch.py model=gpt_8b parallel=tp4_pp2`` on a 2-core, 32 GiB CPU
    machine: 8 gloo ranks (the layout's minimum), fp32, and the memory plan's shortfall."""
    from megatron_hydra import launcher
    from megatron_hydra.planning import memory

    monkeypatch.setattr(memory, "_host_memory", lambda: 32 * 1024 ** 3)
    monkeypatch.setattr(launcher.lifecycle, "cpu_cores", lambda: 2)
    cfg = compose_config(["model=gpt_8b", "parallel=tp4_pp2"])
    assert _machine_values(cfg) == ("cpu", 8, "float32", 0) and cfg.data.global_batch_size == 8
    with pytest.raises(ConfigError) as info:
        launcher.preflight(cfg, derive(cfg), external=None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("the memory plan needs") and "short by" in message and "try " in message


def test_layout_planning_needs_an_explicit_global_batch():
    from megatron_hydra.launcher import run

    with pytest.raises(ConfigError, match="data.global_batch_size") as info:
        run(compose_config(["model=gpt_175b", "cluster=a100_80g_x1024", "mode=plan_layouts"]))
    assert "\n" not in str(info.value)
