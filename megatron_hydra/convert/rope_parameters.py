"""RoPE as a Hugging Face ``config.json`` states it <-> ``model.rope_theta`` and ``model.rope_scaling``.

Files carry it in one of two layouts: transformers 5's ``rope_parameters`` (``rope_type``,
``rope_theta`` and the scaling's own keys in one object), or the older ``rope_scaling`` object beside
a top-level ``rope_theta`` (the Hub's Llama 3.1 files; older still spell ``rope_type`` as ``type``).
They are read as transformers reads them: ``rope_scaling`` wins where both are present, the base
comes from the object, else from the top level, else the family's default, and llama3 and yarn
take their original context from a top-level ``original_max_position_embeddings``, else from the
object, else from ``max_position_embeddings``.

A value that would change the frequencies and that our ``RotaryEmbedding`` does not compute
(dynamic or longrope scaling, a partial rotary dimension, yarn's mscale pair) is one line naming
the key and the value, before anything is written.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from megatron_hydra.config.schema import RopeScalingConfig
from megatron_hydra.config.transformer_config import RopeScaling
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.errors import ConfigError

SCALINGS = ("llama3", "linear", "yarn")
ORIGINAL = "original_max_position_embeddings"
# The keys of each rope_type that our RopeScalingConfig holds under the same name.
KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor", ORIGINAL),
        "yarn": ("factor", ORIGINAL, "beta_fast", "beta_slow", "attention_factor", "truncate")}
# yarn's optional keys as transformers fills them in (attention_factor None: from the factor, as
# ours derives it): left out of an export, as the files on the Hub leave them out.
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "truncate": True}


def read(params: HFConfig, theta: float, max_positions: int,
         original: Optional[int] = None) -> Tuple[float, Optional[RopeScalingConfig]]:
    """(rope_theta, rope_scaling) of one RoPE object ``params`` (``HFConfig.part``: its keys named
    by their place in the file). ``theta``: the base when the object has none; ``original``: a
    top-level original context, which wins over the object's (as transformers has it)."""
    where = params.where
    kind = params.value("rope_type", str, params.value("type", str, "default"))
    if kind != "default" and kind not in SCALINGS:
        raise params.unsupported("rope_type", kind, f"{', '.join(SCALINGS)} are (or default: no scaling)")
    partial = params.value("partial_rotary_factor", float, 1.0)
    if partial != 1.0:
        raise params.unsupported("partial_rotary_factor", partial, "RoPE rotates every dimension of a head")
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key) not in (None, 0):
            raise params.unsupported(key, params[key], "yarn's attention_factor is (set it instead)")
    theta = base(params, "rope_theta", theta)
    if kind == "default":
        return theta, None
    values = {key: params.value(key, bool if key == "truncate" else float, None) for key in KEYS[kind]
              if key != ORIGINAL}
    if kind in ("llama3", "yarn"):
        values[ORIGINAL] = original or params.count(ORIGINAL, max_positions)
    if kind == "yarn":
        values["factor"] = values["factor"] or max_positions / values[ORIGINAL]
        values["beta_fast"], values["beta_slow"] = values["beta_fast"] or 32.0, values["beta_slow"] or 1.0
    if values["factor"] is None:
        raise ConfigError(f"{params.path}: {where}rope_type={kind!r} needs a factor: the file is incomplete; "
                          "copy it again")
    if kind == "llama3" and (values["low_freq_factor"] is None or values["high_freq_factor"] is None):
        raise ConfigError(f"{params.path}: {where}rope_type='llama3' needs low_freq_factor and high_freq_factor: "
                          "the file is incomplete; copy it again")
    return theta, RopeScalingConfig(type=kind, **{k: v for k, v in values.items() if v is not None})


def rope_of(hf: HFConfig, default_theta: float) -> Tuple[float, Optional[RopeScalingConfig]]:
    """(rope_theta, rope_scaling) of a model with one RoPE for every layer."""
    partial = hf.value("partial_rotary_factor", float, 1.0)
    if partial != 1.0:
        raise hf.unsupported("partial_rotary_factor", partial, "RoPE rotates every dimension of a head")
    # transformers 5's layout names its keys as transformers' RoPE code does (rope_type, factor, ...).
    params = hf.part("rope_scaling") if hf.get("rope_scaling") is not None else hf.part("rope_parameters", where="")
    return read(params, base(hf, "rope_theta", default_theta), hf.count("max_position_embeddings", 2048),
                hf.count(ORIGINAL, None))


def base(hf: HFConfig, key: str, default: float) -> float:
    """The RoPE base at ``key`` (``default`` where absent): positive, as the frequencies
    base^(-2i/d) need."""
    theta = hf.value(key, float, default)
    if not theta > 0:
        raise hf.unsupported(key, theta, "a positive base is")
    return theta


def write(theta: float, scaling: Optional[RopeScaling]) -> dict:
    """The ``rope_parameters`` object of transformers 5 for our RoPE."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    values = dataclasses.asdict(scaling)
    return {"rope_type": scaling.type, "rope_theta": theta,
            **{k: values[k] for k in KEYS[scaling.type] if k not in YARN_DEFAULTS or values[k] != YARN_DEFAULTS[k]}}


def legacy(theta: float, scaling: Optional[RopeScaling]) -> dict:
    """The older layout's top-level keys (``rope_theta``, ``rope_scaling``), which readers before
    transformers 5 take instead: the same values."""
    if scaling is None:
        return {"rope_theta": theta, "rope_scaling": None}
    params = write(theta, scaling)
    del params["rope_theta"]
    return {"rope_theta": theta, "rope_scaling": params}
