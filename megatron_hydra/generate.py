"""Text from a checkpoint, at any layout: ``python -m megatron_hydra.generate checkpoint=CKPT prompt="def main(" ...``

    checkpoint=PATH            a checkpoint directory (training's step_NNNNNNN, or an import)
    peft.adapter=PATH          LoRA adapters trained on that checkpoint (their rank, alpha and
                               targets are read from them)
    prompt="..."               the text to continue (empty: start from end-of-document)
    prompts=["...","..."]      several prompts, batched (each printed with its continuation, in order)
    max_new_tokens=64          stop after this many tokens, or earlier at end-of-document
    sampling.greedy=false      true: always the most likely token
    sampling.temperature=1.0   divide the logits by this before sampling
    sampling.top_k=0           sample among the k most likely tokens (0: all)
    sampling.top_p=1.0         ... among the fewest tokens whose probability reaches p (nucleus)
    seed=1234                  prompt i samples from its own generator seeded with seed + i
    tokenizer=PATH             a tokenizer.json (default: the checkpoint's own, else its data's)
    use_cache=true             false recomputes the whole sequence for every token
    batch_size=8               prompts generated together (per data-parallel rank)
    run_dir=DIR                the run's directory (default outputs/<date>/<time>-generate)
    parallel=tp2 trainer.devices=2 ...   launch.py's parallel=, trainer.*, precision= overrides: the
                               layout and machine it runs on (tp, pp, dp, sequence parallel; torchrun
                               and srun start it like launch.py)
    model.KEY=VALUE            on top of the checkpoint's own model (e.g. model.seq_length for RoPE)

The launcher runs it like training (``training.inference_job``): each rank builds its stage of the
model, loads its part of the checkpoint and runs the inference engine (``inference.engine``), whose
KV cache is sharded by heads over TP; rank 0 prints. The tokens do not depend on the layout.
``generate`` below is the single-process loop the engine is checked against.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from omegaconf import MISSING

from megatron_hydra.config import RunConfig
from megatron_hydra.config.schema import GenerationConfig, SamplingConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.inference.engine import model_positions
from megatron_hydra.inference.sampling import check_sampling, sample_next
from megatron_hydra.models.kv_cache import KVCache

__all__ = ["SamplingConfig", "check_sampling", "sample_next", "generate", "max_length", "main"]


@dataclass
class GenerateConfig:
    """This command line's own options (the rest are launch.py's overrides)."""

    checkpoint: str = MISSING
    prompt: Optional[str] = None
    prompts: Optional[List[str]] = None
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 1234
    tokenizer: Optional[str] = None
    use_cache: bool = True
    batch_size: int = 8
    run_dir: Optional[str] = None


def max_length(model) -> int:
    """Longest sequence the model has positions for."""
    return model_positions(model.cfg)


@torch.no_grad()
def generate(model, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig,
             eod: Optional[int] = None, generator: Optional[torch.Generator] = None,
             use_cache: bool = True) -> List[int]:
    """The tokens that follow ``prompt`` (ending at ``eod``, which is not returned)."""
    check_sampling(sampling)
    if not prompt:
        raise ConfigError("the prompt is empty: give at least one token")
    if len(prompt) + max_new_tokens > max_length(model):
        raise ConfigError(f"prompt ({len(prompt)} tokens) + max_new_tokens={max_new_tokens} exceeds the model's "
                          f"{max_length(model)} positions: shorten them")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    cache = KVCache() if use_cache else None
    step_input, out = tokens, []
    try:
        for _ in range(max_new_tokens):
            logits = model(step_input, kv_cache=cache) if use_cache else model(tokens)
            # The padded vocabulary entries (their number depends on tp) are left out: a draw
            # consumes the generator per entry, and the tokens must not depend on the layout.
            token = sample_next(logits[:, -1, :model.cfg.vocab_size], sampling, generator)
            if eod is not None and int(token) == eod:
                break
            out.append(int(token))
            tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
            step_input = token.view(1, 1)
    finally:
        model.train(was_training)
    return out


# Command line --------------------------------------------------------------------------------------
def build_config(argv: Sequence[str]) -> RunConfig:
    """The RunConfig of ``mode=generate`` for this command line (one line for a bad option)."""
    from megatron_hydra.launcher import detect_external
    from megatron_hydra.parallel.device import visible_gpus
    from megatron_hydra.training.inference_cli import job_config, parse_command_line

    args, launch, model = parse_command_line(GenerateConfig, argv)
    check_sampling(args.sampling)
    for key in ("max_new_tokens", "batch_size"):
        if getattr(args, key) < 1:
            raise ConfigError(f"{key}={getattr(args, key)} must be >= 1")
    if args.prompt is not None and args.prompts is not None:
        raise ConfigError("give prompt=\"...\" or prompts=[...], not both")
    prompts = list(args.prompts) if args.prompts is not None else [args.prompt or ""]
    if not prompts:
        raise ConfigError("prompts=[] holds no prompt: give at least one (\"\" starts from end-of-document)")
    external = detect_external()
    cfg = job_config("generate", args.checkpoint, launch, model, args.tokenizer, args.run_dir, visible_gpus(),
                     external.local_world_size if external else None)
    cfg.generation = GenerationConfig(prompts=prompts, max_new_tokens=args.max_new_tokens, sampling=args.sampling,
                                      seed=args.seed, use_cache=args.use_cache, batch_size=args.batch_size)
    _fit_rope_tables(cfg)
    return cfg


def _fit_rope_tables(cfg: RunConfig) -> None:
    """RoPE tables are built for ``model.seq_length`` positions: make room for the longest prompt
    and its new tokens (learned position tables keep their size; preflight names a request that
    does not fit them)."""
    from megatron_hydra.training.inference_job import job_tokenizer, prompt_tokens

    if cfg.model.position_embedding != "rope":
        return
    longest = max(len(t) for t in prompt_tokens(job_tokenizer(cfg), cfg.generation.prompts))
    needed = longest + cfg.generation.max_new_tokens
    multiple = cfg.parallel.tensor_parallel_size if cfg.parallel.sequence_parallel else 1
    cfg.model.seq_length = max(cfg.model.seq_length, -(-needed // multiple) * multiple)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_hydra.launcher import run_tool

    return run_tool(__doc__.strip(), build_config, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
