"""Text from a checkpoint: ``python -m megatron_hydra.generate checkpoint=CKPT prompt="def main(" ...``

    checkpoint=PATH            a checkpoint directory (training's step_NNNNNNN, or an import)
    prompt="..."               the text to continue (empty: start from end-of-document)
    max_new_tokens=64          stop after this many tokens, or earlier at end-of-document
    sampling.greedy=false      true: always the most likely token
    sampling.temperature=1.0   divide the logits by this before sampling
    sampling.top_k=0           sample among the k most likely tokens (0: all)
    sampling.top_p=1.0         ... among the fewest tokens whose probability reaches p (nucleus)
    seed=1234                  the sampling generator's seed
    tokenizer=PATH             a tokenizer.json (default: the checkpoint's own)
    use_cache=true             false recomputes the whole sequence for every token

The model runs whole in one process. With the KV cache (``models.kv_cache``) the prompt runs
once and every later step feeds only the newest token, so a step costs one token's work instead of
the whole sequence's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from omegaconf import MISSING

from megatron_hydra.errors import ConfigError, MegatronHydraError
from megatron_hydra.models.kv_cache import KVCache


@dataclass
class SamplingConfig:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class GenerateConfig:
    checkpoint: str = MISSING
    prompt: str = ""
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 1234
    tokenizer: Optional[str] = None
    use_cache: bool = True


def check_sampling(s: SamplingConfig) -> None:
    if not s.greedy and s.temperature <= 0:
        raise ConfigError(f"sampling.temperature={s.temperature} must be > 0 (or set sampling.greedy=true)")
    if s.top_k < 0:
        raise ConfigError(f"sampling.top_k={s.top_k} must be >= 0 (0 keeps every token)")
    if not 0.0 < s.top_p <= 1.0:
        raise ConfigError(f"sampling.top_p={s.top_p} must be in (0, 1]")


def sample_next(logits: torch.Tensor, s: SamplingConfig, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token id per row of ``logits`` [batch, vocab] (padded entries are -inf)."""
    if s.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p; the most likely always stays.
        drop = probs.cumsum(dim=-1) - probs >= s.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def max_length(model) -> int:
    """Longest sequence the model has positions for."""
    cfg = model.cfg
    return cfg.max_position_embeddings if cfg.position_embedding == "learned" else cfg.seq_length


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
            token = sample_next(logits[:, -1], sampling, generator)
            if eod is not None and int(token) == eod:
                break
            out.append(int(token))
            tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
            step_input = token.view(1, 1)
    finally:
        model.train(was_training)
    return out


# The end-of-training sample (``trainer.generate_sample_tokens``) -----------------------------------
SAMPLE_PROMPT = "def main("
SAMPLE_SAMPLING = SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)


def training_sample(model, cfg, ps) -> Optional[str]:
    """A short continuation of ``SAMPLE_PROMPT`` by the just-trained model, or ``None`` when this
    rank does not hold the whole model (tp, pp or ep > 1, or FSDP-sharded: use ``python -m megatron_hydra.generate``)."""
    from megatron_hydra.parallel.fsdp import is_sharded

    if ps.tp_size > 1 or ps.pp_size > 1 or ps.ep > 1 or any(is_sharded(p) for p in model.parameters()):
        return None
    from megatron_hydra.data.builders import build_tokenizer_for

    tokenizer = build_tokenizer_for(cfg.data)
    prompt = tokenizer.encode(SAMPLE_PROMPT) or [tokenizer.eod]
    n = max(0, min(cfg.trainer.generate_sample_tokens, max_length(model) - len(prompt)))
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(cfg.seed)
    ids = generate(model, prompt, n, SAMPLE_SAMPLING, tokenizer.eod, generator)
    return SAMPLE_PROMPT + tokenizer.decode(ids)


# Command line --------------------------------------------------------------------------------------
def _tokenizer(args: GenerateConfig, cfg):
    from megatron_hydra.checkpoint.standalone import tokenizer_for
    from megatron_hydra.data.tokenizers import HFTokenizer

    if args.tokenizer:
        return HFTokenizer(os.path.expanduser(args.tokenizer))
    tokenizer = tokenizer_for(args.checkpoint, cfg)
    if tokenizer is None:
        raise ConfigError(f"checkpoint={args.checkpoint} was trained on synthetic data and has no tokenizer: "
                          "give tokenizer=PATH/tokenizer.json")
    return tokenizer


def run(args: GenerateConfig) -> str:
    from megatron_hydra.checkpoint import standalone

    check_sampling(args.sampling)
    if args.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={args.max_new_tokens} must be >= 1")
    cfg = standalone.read_config(args.checkpoint)
    tokenizer = _tokenizer(args, cfg)
    prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eod]
    needed = len(prompt) + args.max_new_tokens
    # Rotary tables are built for seq_length positions: make room for the whole generation.
    seq = max(cfg.model.seq_length, needed) if cfg.model.position_embedding == "rope" else None
    _, _, model = standalone.load_model(args.checkpoint, seq_length=seq)
    generator = torch.Generator().manual_seed(args.seed)
    ids = generate(model, prompt, args.max_new_tokens, args.sampling, tokenizer.eod, generator, args.use_cache)
    return args.prompt + tokenizer.decode(ids)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_hydra.config.cli import parse_args

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        print(run(parse_args(GenerateConfig, argv)))
    except MegatronHydraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
