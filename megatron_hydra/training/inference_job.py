"""Runs of a saved checkpoint instead of training: ``mode=generate`` and ``mode=evaluate``.

They go through the launcher like training (local spawn, torchrun, SLURM), so a model that only
fits sharded generates and is evaluated at the layout it needs. The launcher checks such a run
here before any worker starts (``preflight``): the checkpoint holds this model, its tokenizer
loads, the sampling settings and lm-eval tasks are valid, and the prompts fit the model's
positions. Each rank then builds its pipeline stage at the layout (``models.stages``), fills it
from the checkpoint (any layout wrote it: checkpoints are layout-free), and runs the inference
engine with every other rank (``run_job``). The end-of-training sample runs the same engine on the
live model (``training_sample``), so it too works at any layout the engine runs.

A LoRA model is ``checkpoint.load`` (the base) plus ``peft.adapter`` (adapters trained on it),
loaded side by side, never merged: the adapters' own config says their rank, targets and scale
(``checkpoint.adapters.adopt``, which the launcher applies before it derives the run), so the user
gives the two paths and nothing else.

Nothing here imports Lightning: the launcher runs ``preflight`` in its own process.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron_hydra.checkpoint import adapters, sharded, standalone, store
from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.config.inference import eval_output_dir
from megatron_hydra.config.schema import SamplingConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.data.builders import build_tokenizer_for
from megatron_hydra.data.tokenizers import Tokenizer, build_tokenizer
from megatron_hydra.errors import ConfigError
from megatron_hydra.inference.engine import Engine, model_positions
from megatron_hydra.inference.sampling import check_sampling
from megatron_hydra.models.stages import build_stage_chunks
from megatron_hydra.parallel.state import ParallelState, device_for


def job_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The tokenizer of a run of ``checkpoint.load``: ``data.tokenizer`` when it names a
    ``tokenizer.json`` (the CLIs' ``tokenizer=``), else the checkpoint's own ``tokenizer.json``
    (an import), else the one the run's data was tokenized with."""
    tok = cfg.data.tokenizer
    if tok.type == "hf" and tok.path:
        return build_tokenizer(tok)
    found = standalone.tokenizer_for(cfg.checkpoint.load, cfg)
    if found is None:
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load} was trained on synthetic data and has no "
                          "tokenizer: give one (tokenizer=PATH/tokenizer.json, or data.tokenizer.type=hf "
                          "data.tokenizer.path=PATH)")
    return found


def prompt_tokens(tokenizer: Tokenizer, prompts: List[str]) -> List[List[int]]:
    """Each prompt's tokens; an empty prompt starts from end-of-document."""
    return [tokenizer.encode(p) or [tokenizer.eod] for p in prompts]


# The launcher's checks ------------------------------------------------------------------------
def preflight(cfg: RunConfig, derived: Derived) -> None:
    """One line for what would fail in every worker, found in the launching process: a missing,
    incomplete or other model's checkpoint, no tokenizer, bad sampling settings, prompts longer
    than the model's positions, an unknown task or a task file that does not parse; adapters
    that are no adapters or not of this base."""
    adapters.refuse_adapter_only(cfg.checkpoint.load, "checkpoint.load", store.validate(cfg.checkpoint.load))
    # Its config is data from elsewhere: shown to match its tensors before a worker builds anything.
    standalone.check_before_building(cfg.checkpoint.load, derived, select=_base(derived))
    if cfg.peft.adapter is not None:
        standalone.check_before_building(cfg.peft.adapter, derived, select="adapters", key="peft.adapter")
    tokenizer = job_tokenizer(cfg)
    if cfg.mode == "generate":
        check_sampling(cfg.generation.sampling)
        check_positions(derived.transformer, prompt_tokens(tokenizer, cfg.generation.prompts),
                        cfg.generation.max_new_tokens)
        return
    from megatron_hydra.inference.lm_eval_adapter import check_tasks

    check_tasks(list(cfg.trainer.eval.tasks))


def _base(derived: Derived) -> Optional[str]:
    """The part of the model ``checkpoint.load`` fills: all of it, or with adapters the base."""
    return "base" if derived.transformer.lora is not None else None


def check_positions(tcfg: TransformerConfig, prompts: List[List[int]], max_new_tokens: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > model_positions(tcfg):
        how = ("raise model.seq_length (RoPE tables are built for it)" if tcfg.position_embedding == "rope"
               else "shorten them (the model learned that many positions)")
        raise ConfigError(f"the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} exceeds the "
                          f"model's {model_positions(tcfg)} positions: {how}")


# A worker's job ------------------------------------------------------------------------------
def run_job(cfg: RunConfig, derived: Derived, local_rank: int) -> None:
    """This rank's part of ``mode=generate`` or ``mode=evaluate`` (every rank calls it together)."""
    device = device_for(cfg.trainer.accelerator, local_rank)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp, cp=derived.cp, device_type=device.type,
                             ep=derived.ep, etp=derived.etp)
    chunks = load_stage(cfg, derived, ps, device)
    tokenizer = job_tokenizer(cfg)
    if cfg.mode == "generate":
        _generate(cfg, derived, ps, chunks, tokenizer)
    else:
        _evaluate(cfg, derived, ps, chunks, tokenizer)


def load_stage(cfg: RunConfig, derived: Derived, ps: ParallelState, device: torch.device) -> List[torch.nn.Module]:
    """This rank's model chunks at the layout, filled from ``checkpoint.load`` and, with adapters,
    from ``peft.adapter`` (collective)."""
    chunks, _ = build_stage_chunks(cfg, derived, ps, device)
    model, vocab = torch.nn.ModuleList(chunks), derived.transformer.vocab_size
    sharded.load(cfg.checkpoint.load, model, None, ps, vocab, load_optimizer=False, select=_base(derived),
                 key="checkpoint.load")
    if cfg.peft.adapter is not None:
        sharded.load(cfg.peft.adapter, model, None, ps, vocab, load_optimizer=False, select="adapters",
                     key="peft.adapter")
    return chunks


def _generate(cfg: RunConfig, derived: Derived, ps: ParallelState, chunks, tokenizer: Tokenizer) -> None:
    gen = cfg.generation
    engine = Engine(chunks, ps, derived.transformer, batch_size=gen.batch_size)
    outputs = engine.generate(prompt_tokens(tokenizer, gen.prompts), gen.max_new_tokens, gen.sampling,
                              seed=gen.seed, eod=tokenizer.eod, use_cache=gen.use_cache)
    if ps.rank == 0:  # only rank 0 talks
        for prompt, ids in zip(gen.prompts, outputs):
            print(prompt + tokenizer.decode(ids), flush=True)


def _evaluate(cfg: RunConfig, derived: Derived, ps: ParallelState, chunks, tokenizer: Tokenizer) -> None:
    from megatron_hydra.inference.lm_eval_adapter import evaluate

    ev = cfg.trainer.eval
    engine = Engine(chunks, ps, derived.transformer, batch_size=ev.batch_size)
    evaluate(engine, tokenizer, model_positions(derived.transformer), ev, eval_output_dir(cfg))


# The sample at the end of training -------------------------------------------------------------
SAMPLE_PROMPT = "def main("
SAMPLE_SAMPLING = SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)


def no_sample_reason(cfg: RunConfig, ps: ParallelState) -> Optional[str]:
    """Why this run's layout gets no end-of-training sample (the engine does not run it), or None.
    Decided from the config alone, so that every rank agrees."""
    par = cfg.parallel
    if par.context_parallel_size > 1:
        return "context parallelism"
    if (par.virtual_pipeline_size or 1) > 1:
        return "virtual pipeline stages"
    if par.data_parallel == "fsdp" and ps.dp_size * ps.cp_size > 1:
        return "FSDP-sharded parameters"
    return None


def training_sample(model: torch.nn.Module, cfg: RunConfig, tcfg: TransformerConfig, ps: ParallelState) -> str:
    """A short continuation of ``SAMPLE_PROMPT`` by the just-trained ``model`` (this rank's
    chunk, or a ``ModuleList`` of them), on every rank: each calls it together, whatever the
    layout (``no_sample_reason`` names the ones the engine does not run)."""
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    tokenizer = build_tokenizer_for(cfg.data)
    prompt = prompt_tokens(tokenizer, [SAMPLE_PROMPT])[0]
    n = max(0, min(cfg.trainer.generate_sample_tokens, model_positions(tcfg) - len(prompt)))
    if n == 0:
        return SAMPLE_PROMPT
    ids = Engine(chunks, ps, tcfg, batch_size=1).generate([prompt], n, SAMPLE_SAMPLING, seed=cfg.seed,
                                                         eod=tokenizer.eod)[0]
    return SAMPLE_PROMPT + tokenizer.decode(ids)

