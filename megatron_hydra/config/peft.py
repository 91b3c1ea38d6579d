"""Checks of ``peft``, ``objective`` and preference data, and the adapters the model sees.

Each problem is a one-line ``ConfigError`` naming the key, raised by ``config.derive`` before any
worker starts: a target that names no layer of this model, a rank above a target layer's width,
an objective without its data, or a combination LoRA does not run with.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from megatron_hydra.config.schema import RunConfig
from megatron_hydra.config.transformer_config import LORA_TARGETS, LoRASpec
from megatron_hydra.errors import ConfigError

GATED = ("swiglu", "geglu")


def _widths(cfg: RunConfig, kv_channels: int, ffn: int) -> Dict[str, Tuple[int, int]]:
    """(input, output) widths of each target layer; qkv's output is its narrowest projection (k, v)."""
    m = cfg.model
    h, heads = m.hidden_size, m.num_attention_heads
    groups = m.num_query_groups or heads
    return {"qkv": (h, groups * kv_channels), "proj": (heads * kv_channels, h), "fc1": (h, ffn), "gate": (h, ffn),
            "fc2": (ffn, h)}


def _dense_layers(cfg: RunConfig, moe_layers) -> bool:
    return cfg.model.moe is None or len(moe_layers) < cfg.model.num_layers


def check_peft(cfg: RunConfig, kv_channels: int, ffn: int, moe_layers=()) -> None:
    """``peft.*`` against the model and the layout."""
    p = cfg.peft
    if p.name == "none":
        if p.adapter is not None:
            raise ConfigError(f"peft.adapter={p.adapter} loads LoRA adapters, but peft=none: add peft=lora")
        return
    if p.rank < 1:
        raise ConfigError(f"peft.rank={p.rank}: an adapter's rank is a positive integer")
    if not p.alpha > 0:
        raise ConfigError(f"peft.alpha={p.alpha}: the adapters' scale alpha / rank needs alpha > 0")
    if not 0.0 <= p.dropout < 1.0:
        raise ConfigError(f"peft.dropout={p.dropout}: a probability in [0, 1)")
    targets = model_targets(cfg, moe_layers)
    if not targets:
        raise ConfigError("peft.target_modules=[]: name at least one of " + ", ".join(LORA_TARGETS))
    for t in targets:
        if t not in LORA_TARGETS:
            raise ConfigError(f"peft.target_modules: {t!r} is no layer of the model; the layers are "
                              + ", ".join(LORA_TARGETS) + " (docs/finetuning.md)")
    if len(set(targets)) < len(targets):
        raise ConfigError(f"peft.target_modules={targets} names a layer twice")
    if "gate" in targets and cfg.model.activation not in GATED:
        raise ConfigError(f"peft.target_modules: 'gate' but model.activation={cfg.model.activation} has no gate "
                          "projection: remove it")
    mlp = [t for t in targets if t in ("fc1", "gate", "fc2")]
    if mlp and not _dense_layers(cfg, moe_layers):
        raise ConfigError(f"peft.target_modules: {mlp} but every layer of this model is a Mixture of Experts, whose "
                          "experts LoRA does not adapt: target qkv and proj")
    for t in targets:
        width = min(_widths(cfg, kv_channels, ffn)[t])
        if p.rank > width:
            raise ConfigError(f"peft.rank={p.rank} exceeds the width {width} of the {t} layer: lower peft.rank")
    unsupported = [
        (cfg.model.arch != "gpt", f"model.arch={cfg.model.arch} (LoRA adapts GPT-family models)"),
        (cfg.model.transformer_impl != "local",
         f"model.transformer_impl={cfg.model.transformer_impl} (its fused layers take no adapter): use local"),
        (cfg.parallel.data_parallel == "fsdp",
         "parallel.data_parallel=fsdp (its sharded units take no frozen parameters beside trained ones): use ddp, "
         "with optim.distributed_optimizer=true to shard the adapters' state"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"peft=lora does not run with {what}")


def check_objective(cfg: RunConfig) -> None:
    """``objective.*`` against the data."""
    o, data = cfg.objective, cfg.data.name
    if o.name == "lm":
        if data == "preference":
            raise ConfigError("data=preference holds preference pairs, which the lm objective cannot train on: "
                              "add objective=dpo")
        return
    if data != "preference":
        raise ConfigError(f"objective=dpo trains on preference pairs, not data={data}: use data=preference "
                          "data.path=pairs.jsonl")
    if cfg.model.arch != "gpt":
        raise ConfigError(f"objective=dpo trains GPT-family models, not model.arch={cfg.model.arch}")
    if not o.beta > 0:
        raise ConfigError(f"objective.beta={o.beta}: DPO's temperature is positive (0.1 is usual)")
    if not 0.0 <= o.label_smoothing < 0.5:
        raise ConfigError(f"objective.label_smoothing={o.label_smoothing}: in [0, 0.5)")


def model_targets(cfg: RunConfig, moe_layers=()) -> list:
    """``peft.target_modules``, or (null) every target layer the model has."""
    if cfg.peft.target_modules is not None:
        return list(cfg.peft.target_modules)
    mlp = ["fc1", "gate", "fc2"] if cfg.model.activation in GATED else ["fc1", "fc2"]
    return ["qkv", "proj"] + (mlp if _dense_layers(cfg, moe_layers) else [])


def lora_spec(cfg: RunConfig, moe_layers=()) -> Optional[LoRASpec]:
    """The adapters the model is built with (None: peft=none)."""
    p = cfg.peft
    if p.name == "none":
        return None
    return LoRASpec(rank=p.rank, alpha=float(p.alpha), dropout=float(p.dropout),
                    targets=tuple(model_targets(cfg, moe_layers)), rslora=p.rslora)
