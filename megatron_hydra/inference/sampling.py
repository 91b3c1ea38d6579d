"""How the next token is chosen from the logits: greedy, or sampled with temperature, top-k and
top-p (nucleus).

A batch's rows may each draw from a generator of their own (``generators``), so that a prompt's
tokens depend on its seed alone, not on which prompts share its batch or how many ranks there are.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch

from megatron_hydra.config.schema import SamplingConfig
from megatron_hydra.errors import ConfigError

Generators = Union[None, torch.Generator, List[Optional[torch.Generator]]]


def check_sampling(s: SamplingConfig) -> None:
    if not s.greedy and s.temperature <= 0:
        raise ConfigError(f"sampling.temperature={s.temperature} must be > 0 (or set sampling.greedy=true)")
    if s.top_k < 0:
        raise ConfigError(f"sampling.top_k={s.top_k} must be >= 0 (0 keeps every token)")
    if not 0.0 < s.top_p <= 1.0:
        raise ConfigError(f"sampling.top_p={s.top_p} must be in (0, 1]")


def filtered_probabilities(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / temperature) over its top_k
    tokens and, among those, the fewest whose probability reaches top_p (padded entries: -inf)."""
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
    return logits.softmax(dim=-1)


def sample_next(logits: torch.Tensor, s: SamplingConfig, generators: Generators = None) -> torch.Tensor:
    """One token id per row of ``logits`` [batch, vocab] (padded entries are -inf).
    ``generators``: one per row (each row's draw comes from its own), or one for the whole batch,
    or None (torch's default generator). A draw consumes its generator according to the number of
    entries: pass the real vocabulary's logits only, for tokens that do not depend on tp's padding."""
    if s.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_probabilities(logits, s)
    if generators is None or isinstance(generators, torch.Generator):
        return torch.multinomial(probs, 1, generator=generators).squeeze(-1)
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{len(generators)} generators for {probs.shape[0]} rows")
    return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g).view(1) for i, g in enumerate(generators)])
