"""Generation and scoring with a rank's model stage, at the job's layout (TP, PP, DP).

Every rank of the job calls ``Engine.generate`` and ``Engine.score`` with the same arguments
(SPMD) and every rank returns the whole result. The requests are sorted longest first and dealt
round-robin over the data-parallel ranks; each rank runs its share in batches, and the shares are
gathered at the end. Within a model replica, requests go through the pipeline stages in
micro-batches of up to ``batch_size`` sequences, one per stage in flight (``stage_link``), and
through the tensor-parallel layers as in training.

Generation batches prompts of different lengths by padding them on the left: a row's real tokens
take positions 0, 1, ... (``position_ids``) and its pads are masked out of attention (the KV cache's
``pads``, or ``document_ids`` when the whole sequence is recomputed), so each row gets the tokens
it would get alone. Prompt i draws from its own generator seeded with ``seed + i``: its tokens do
not depend on the batch, the layout or the other prompts. Scoring pads on the right, where causal
attention already keeps pads out of every real token's view. Its log-probabilities come from the
vocabulary-parallel logits without gathering them (``logprobs``), in float64; sampling gathers the
newest position's logits over TP, and every TP rank draws the same token from the same generator.

Sequence parallelism is switched off while the engine runs: a generation step is one token long,
which cannot be split along the sequence; the weights are the same either way.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron_hydra.config.schema import SamplingConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.inference.logprobs import gathered_logits, token_logprobs
from megatron_hydra.inference.sampling import check_sampling, sample_next
from megatron_hydra.inference.stage_link import StageLink
from megatron_hydra.models.kv_cache import KVCache
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.fsdp import is_sharded
from megatron_hydra.parallel.state import ParallelState

Stop = Callable[[int, List[int]], bool]
PAD = 0  # the id fed at padded positions; nothing real attends to it
SCORE_CHUNK = 1024  # scored tokens whose logits are taken to float64 at once


def model_positions(tcfg: TransformerConfig) -> int:
    """The longest sequence the model has positions for (learned embeddings or rotary tables)."""
    return tcfg.max_position_embeddings if tcfg.position_embedding == "learned" else tcfg.seq_length


def check_layout(chunks: Sequence[nn.Module], ps: ParallelState, tcfg: TransformerConfig) -> None:
    if len(chunks) != 1:
        raise ConfigError(f"parallel.virtual_pipeline_size={len(chunks)}: generation and evaluation run one model "
                          "chunk per rank: set parallel.virtual_pipeline_size=null")
    if ps.cp_size > 1:
        raise ConfigError(f"parallel.context_parallel_size={ps.cp_size}: generation and evaluation do not split "
                          "sequences: set parallel.context_parallel_size=1")
    if tcfg.arch != "gpt":
        raise ConfigError(f"model.arch={tcfg.arch}: generation and evaluation need a decoder-only model (gpt)")


def forward_spans_dp(model: nn.Module, ps: ParallelState, tcfg: TransformerConfig) -> bool:
    """Whether a forward communicates over the data-parallel ranks (experts split over them,
    FSDP's parameter gathers, FP8's amax reduction): they must then run the same passes, so each
    runs every request instead of its share."""
    return ps.ep > 1 or tcfg.fp8 is not None or any(is_sharded(p) for p in model.parameters())


class Engine:
    """``chunks``: this rank's model chunk (``models.stages.build_stage_chunks``), the training
    model's own objects too: each call puts it in eval mode and restores its mode after.
    ``batch_size``: sequences per forward pass on each data-parallel rank (a pipeline holds up to
    pp such micro-batches at once)."""

    def __init__(self, chunks: Sequence[nn.Module], ps: ParallelState, tcfg: TransformerConfig, batch_size: int = 8):
        check_layout(chunks, ps, tcfg)
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        self.model, self.ps, self.tcfg, self.batch_size = chunks[0], ps, tcfg, batch_size
        self.link = StageLink(ps)
        self.device = next(self.model.parameters()).device
        self.max_length = model_positions(tcfg)
        self.pad_left = tcfg.transformer_impl == "local"  # prompts of different lengths share a batch
        self.dp_group = ps.group("dp") if ps.dp_size > 1 and not forward_spans_dp(self.model, ps, tcfg) else None

    # The public calls -------------------------------------------------------------------------
    def score(self, requests: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        """Per (context, continuation): the sum of log p(continuation tokens) given what precedes
        each, and whether every continuation token was the greedy choice. A sequence longer than
        the model's positions keeps its last ones (the context is cut from the left)."""
        if not requests:
            return []
        inputs = [self._score_input(context, continuation) for context, continuation in requests]
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        mine = self._share(order)
        values = torch.zeros(len(mine), 2, dtype=torch.float64, device=self.device)
        size = self._micro_batch_size(len(mine))
        with self._running():
            for start in range(0, len(mine), size):
                rows = mine[start:start + size]
                out = self._score_batch([inputs[i] for i in rows])
                if out is not None:
                    values[start:start + len(rows)] = out
            self.link.flush()
        values = self.link.from_last(values)
        return [(float(v[0]), bool(v[1])) for v in self._gather_scores(values, order, len(requests))]

    def generate(self, prompts: List[List[int]], max_new_tokens: int, sampling: SamplingConfig, seed: int = 0,
                 eod: Optional[int] = None, stop: Optional[Stop] = None, use_cache: bool = True) -> List[List[int]]:
        """The new tokens of each prompt: up to ``max_new_tokens``, ending before ``eod`` (not
        returned) or with the token after which ``stop(i, tokens so far)`` holds."""
        check_sampling(sampling)
        if not prompts:
            return []
        for prompt in prompts:
            if not prompt:
                raise ConfigError("a prompt is empty: give at least one token (the end-of-document token)")
            if len(prompt) + max_new_tokens > self.max_length:
                raise ConfigError(f"prompt ({len(prompt)} tokens) + max_new_tokens={max_new_tokens} exceeds the "
                                  f"model's {self.max_length} positions: shorten them")
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        mine = self._share(order)
        out: Dict[int, List[int]] = {i: [] for i in mine}
        if max_new_tokens > 0:
            micro = list(self._generation_micro_batches(mine, prompts))
            pp = self.ps.pp_size
            with self._running():
                for start in range(0, len(micro), pp):  # pp micro-batches in flight: one per stage
                    run = _Generation(self, micro[start:start + pp], prompts, max_new_tokens, sampling, seed, eod,
                                      stop, use_cache)
                    out.update(run.finish())
        return self._gather_generated(out, len(prompts))

    # Batches, data parallelism, modes -------------------------------------------------------
    def _share(self, order: List[int]) -> List[int]:
        """This data-parallel rank's requests: every dp-th of the sorted ones (all of them when a
        forward spans the data-parallel ranks, ``forward_spans_dp``)."""
        if self.dp_group is None:
            return order
        return order[self.ps.dp_rank::self.ps.dp_size]

    def _micro_batch_size(self, count: int) -> int:
        """Rows per forward pass: ``batch_size``, or fewer when that leaves a pipeline stage idle
        (``count`` requests make at least pp micro-batches, one per stage)."""
        return max(1, min(self.batch_size, -(-count // self.ps.pp_size)))

    def _generation_micro_batches(self, rows: List[int], prompts) -> Iterator[List[int]]:
        size = self._micro_batch_size(len(rows))
        buckets: Dict[int, List[int]] = {}
        for i in rows:  # Transformer Engine's attention takes no position ids: one prompt length per batch
            buckets.setdefault(0 if self.pad_left else len(prompts[i]), []).append(i)
        for bucket in buckets.values():
            for start in range(0, len(bucket), size):
                yield bucket[start:start + size]

    def _gather_scores(self, values: torch.Tensor, order: List[int], n: int) -> List[torch.Tensor]:
        """Every request's [log-probability, greedy] row, from this rank's ``values`` (its share of
        ``order``, in that order) and the other data-parallel ranks'."""
        out: List[Optional[torch.Tensor]] = [None] * n
        if self.dp_group is None:
            for i, v in zip(order, values):
                out[i] = v
            return out
        dp, per = self.ps.dp_size, -(-n // self.ps.dp_size)
        padded = torch.cat([values, values.new_zeros(per - len(values), 2)])
        every = C.all_gather(padded, 0, self.dp_group).view(dp, per, 2)
        for rank in range(dp):
            for i, v in zip(order[rank::dp], every[rank]):
                out[i] = v
        return out

    def _gather_generated(self, out: Dict[int, List[int]], n: int) -> List[List[int]]:
        if self.dp_group is not None:
            parts: List[Optional[Dict[int, List[int]]]] = [None] * self.ps.dp_size
            dist.all_gather_object(parts, out, group=self.dp_group)
            out = {i: tokens for part in parts for i, tokens in part.items()}
        return [out[i] for i in range(n)]

    @contextmanager
    def _running(self):
        """Eval mode, no autograd and sequence parallelism off, each restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), sequence_parallel_off(self.model):
                yield
        finally:
            self.model.train(was_training)

    # Scoring ----------------------------------------------------------------------------------
    def _score_input(self, context: List[int], continuation: List[int]) -> Tuple[List[int], List[int]]:
        """The tokens fed (the sequence but its last token, cut to the model's positions) and the
        continuation, whose tokens are the last ``len(continuation)`` targets."""
        if not context:
            raise ValueError("a scoring request has an empty context: start it with the end-of-document token")
        whole = (list(context) + list(continuation))[-(self.max_length + 1):]
        if len(continuation) >= len(whole):
            raise ConfigError(f"a continuation of {len(continuation)} tokens does not fit the model's "
                              f"{self.max_length} positions: shorten it")
        return whole[:-1], list(continuation)

    def _score_batch(self, items: List[Tuple[List[int], List[int]]]) -> Optional[torch.Tensor]:
        """[rows, 2]: log-probability and greedy flag per row, on the last stage (None elsewhere)."""
        length = max(len(fed) for fed, _ in items)
        tokens = torch.full((len(items), length), PAD, dtype=torch.long, device=self.device)
        for r, (fed, _) in enumerate(items):
            tokens[r, :len(fed)] = torch.tensor(fed, dtype=torch.long)
        logits = self._stage_forward(tokens, (len(items), length))
        if logits is None:
            return None
        rows, positions, targets = [], [], []
        for r, (fed, continuation) in enumerate(items):
            rows += [r] * len(continuation)
            positions += range(len(fed) - len(continuation), len(fed))
            targets += continuation
        rows, positions, targets = (torch.tensor(v, dtype=torch.long, device=self.device)
                                    for v in (rows, positions, targets))
        per_row = torch.zeros(len(items), 2, dtype=torch.float64, device=self.device)  # log p, greedy misses
        for start in range(0, len(targets), SCORE_CHUNK):  # bounds the float64 copies of the logits
            part = slice(start, start + SCORE_CHUNK)
            logprob, greedy = token_logprobs(logits[rows[part], positions[part]], targets[part], self.ps.tp_group)
            per_row.index_add_(0, rows[part], torch.stack([logprob, (~greedy).double()], dim=-1))
        per_row[:, 1] = (per_row[:, 1] == 0).double()
        return per_row

    # One stage's forward ----------------------------------------------------------------------
    def _stage_forward(self, tokens: torch.Tensor, shape: Tuple[int, int], **kwargs) -> Optional[torch.Tensor]:
        """Run this stage on ``tokens`` [b, s] (stage 0) or the previous stage's output, send the
        result on; the last stage returns its logits shard [b, s, vocab / tp], the others None."""
        if self.link.first:
            x = tokens
        else:
            x = self.link.recv_forward((*shape, self.tcfg.hidden_size), self.tcfg.params_dtype, self.device)
        out = self.model(x, **kwargs)
        if not self.link.last:
            self.link.send_forward(out.to(self.tcfg.params_dtype))
            return None
        return out


class _Generation:
    """Micro-batches of prompts generated together, up to one per pipeline stage."""

    def __init__(self, engine: Engine, micro: List[List[int]], prompts, max_new: int, sampling: SamplingConfig,
                 seed: int, eod: Optional[int], stop: Optional[Stop], use_cache: bool):
        self.engine, self.max_new, self.sampling, self.eod, self.stop = engine, max_new, sampling, eod, stop
        self.groups = [_Rows(engine, rows, prompts, seed, use_cache) for rows in micro]

    def finish(self) -> Dict[int, List[int]]:
        """Run every micro-batch to its end; the new tokens per prompt index. Step k of micro-batch
        m runs after the tokens of its step k - 1 are known, so the stages work on different
        micro-batches at once."""
        link = self.engine.link
        for step in range(self.max_new):
            for rows in self.groups:
                if not rows.live:
                    continue
                if step > 0:
                    rows.absorb(self._tokens(rows), self.eod, self.stop, self.max_new)
                    if not rows.live:
                        continue
                self._step(rows)
        for rows in self.groups:
            if rows.live:
                rows.absorb(self._tokens(rows), self.eod, self.stop, self.max_new)
        link.flush()
        return {i: out for rows in self.groups for i, out in zip(rows.indices, rows.out)}

    def _tokens(self, rows: "_Rows") -> torch.Tensor:
        link = self.engine.link
        return rows.sampled if link.last else link.recv_tokens(len(rows.indices), self.engine.device)

    def _step(self, rows: "_Rows") -> None:
        engine = self.engine
        tokens, kwargs = rows.next_input()
        logits = engine._stage_forward(tokens, tuple(tokens.shape), **kwargs)
        if logits is None:
            return
        # Without the padded entries (their number depends on tp): a draw consumes its generator
        # according to the number of entries, and the tokens must not depend on the layout.
        newest = gathered_logits(logits[:, -1], engine.ps.tp_group)[:, :engine.tcfg.vocab_size]
        rows.sampled = sample_next(newest, self.sampling, rows.generators)
        engine.link.send_tokens(rows.sampled)


class _Rows:
    """A micro-batch of left-padded prompts and what they have generated so far."""

    def __init__(self, engine: Engine, indices: List[int], prompts, seed: int, use_cache: bool):
        self.indices, self.device = indices, engine.device
        lengths = [len(prompts[i]) for i in indices]
        width = max(lengths)
        self.tokens = torch.full((len(indices), width), PAD, dtype=torch.long, device=self.device)
        for r, i in enumerate(indices):
            self.tokens[r, width - lengths[r]:] = torch.tensor(prompts[i], dtype=torch.long)
        self.pads = torch.tensor([width - n for n in lengths], dtype=torch.long, device=self.device)
        self.padded = bool(self.pads.any())
        self.cache = KVCache(self.pads) if use_cache else None
        self.generators = [torch.Generator(device=self.device).manual_seed(seed + i) for i in indices]
        self.out: List[List[int]] = [[] for _ in indices]
        self.done = [False] * len(indices)
        self.live, self.fed = True, 0  # tokens (padded columns) already in the cache
        self.sampled: Optional[torch.Tensor] = None

    def next_input(self):
        """The tokens to feed now ([b, s]: the whole sequence first, or without a cache; then the
        newest token) and the model's keyword arguments for them."""
        start = self.fed if self.cache is not None else 0
        tokens = self.tokens[:, start:]
        self.fed = self.tokens.shape[1]
        kwargs = {"kv_cache": self.cache} if self.cache is not None else {}
        if self.padded:
            columns = torch.arange(start, self.tokens.shape[1], device=self.device).unsqueeze(0)
            kwargs["position_ids"] = (columns - self.pads.unsqueeze(1)).clamp(min=0)
            if self.cache is None:
                kwargs["document_ids"] = (columns >= self.pads.unsqueeze(1)).long()  # pads: 0, tokens: 1
        return tokens, kwargs

    def absorb(self, tokens: torch.Tensor, eod: Optional[int], stop: Optional[Stop], max_new: int) -> None:
        """Take the newest token of every row: a row ends at ``eod``, when ``stop`` says so, or at
        ``max_new`` tokens; the micro-batch ends with its last row."""
        self.tokens = torch.cat([self.tokens, tokens.view(-1, 1)], dim=1)
        for r, token in enumerate(tokens.tolist()):
            if self.done[r]:
                continue
            if eod is not None and token == eod:
                self.done[r] = True
                continue
            self.out[r].append(token)
            self.done[r] = len(self.out[r]) >= max_new or bool(stop is not None and stop(self.indices[r], self.out[r]))
        self.live = not all(self.done)


@contextmanager
def sequence_parallel_off(model: nn.Module):
    """``model`` with every layer's sequence-parallel layout switched off (and its config's), then
    restored: the same weights, each rank running the whole sequence."""
    changed = []
    off: Dict[int, TransformerConfig] = {}
    for module in model.modules():
        if getattr(module, "sequence_parallel", None) is True:
            changed.append((module, "sequence_parallel", True))
            module.sequence_parallel = False
        cfg = getattr(module, "cfg", None)
        if isinstance(cfg, TransformerConfig) and cfg.sequence_parallel:
            changed.append((module, "cfg", cfg))
            module.cfg = off.setdefault(id(cfg), dataclasses.replace(cfg, sequence_parallel=False))
    try:
        yield
    finally:
        for module, name, value in changed:
            setattr(module, name, value)
