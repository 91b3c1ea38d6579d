"""Preference pairs for DPO (``data=preference``): a prompt, a chosen and a rejected answer.

Each line of ``data.path`` is one pair, ``{"prompt": ..., "chosen": ..., "rejected": ...}`` with an
optional ``"system": "..."``. Each of the three is a string or a list of messages as ``data=sft``
has them (``{"role": "system" | "user" | "assistant", "content": "..."}``): a string prompt is one
user message, a string answer one assistant message; a list is taken as it is (a prompt may carry
a multi-turn history, an answer several turns), and ``system`` goes first. Blank lines are
skipped; a line that is not such a pair, or whose chosen or rejected answer has no assistant
text, stops the run in one line naming the file and line (``conversations``).

Each answer is appended to the prompt and rendered as one conversation with the chat template
``data=sft`` uses (``chat_template``). The loss covers the answer's assistant tokens only:
assistant turns inside the prompt are context for both answers, so their tokens are not learned.
Rendering prefixes keeps a template's earlier turns alike whatever follows them, so those turns
are the first learned tokens of the whole render, as many as the prompt alone has.

A pair of ``c`` and ``r`` ids occupies ``(c - 1) + (r - 1)`` positions: chosen, then rejected, each
a document of its own (``SFTSamples`` with two documents per sample), so a pair is never split
between sequences and its two answers never attend to each other. A pair longer than
``seq_length`` is cut, beginnings kept, so that both fit: each keeps half the positions, and a
side shorter than its half leaves the rest to the other. A pair with no learned token left in
either answer is dropped (the log counts them): DPO compares the two, so one without the other
is nothing to learn from.

Packing, splits (by pairs), epochs, seeds and resumption are ``data=sft``'s (``SFTDataset``), so
item ``k`` is a pure function of the file, the tokenizer, ``seq_length``, the seed and ``k``. A
sequence holds documents ``2j`` (chosen) and ``2j + 1`` (rejected) for its pairs ``j``, then one
padding document when room is left (``loss_mask`` 0); the fields are SFT's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Tuple

import numpy as np

from megatron_hydra.data.chat_template import Message, load_template
from megatron_hydra.data.conversations import MESSAGE_FORM, check_token_ids, checked_messages, jsonl_rows, tokens_of
from megatron_hydra.data.sft_dataset import SFTSamples, concatenate
from megatron_hydra.data.tokenizers import Tokenizer
from megatron_hydra.errors import DataError

log = logging.getLogger(__name__)
FORM = '{"prompt": ..., "chosen": ..., "rejected": ...}'
ANSWERS = ("chosen", "rejected")


@dataclass
class Pair:
    """One line of the file, checked: ``where`` is its ``file:line``."""

    where: str
    prompt: List[Message]
    chosen: List[Message]
    rejected: List[Message]


def _side(obj: dict, key: str, where: str, role: str) -> List[Message]:
    """The messages of ``obj[key]``: a string is one message of ``role``."""
    value = obj[key]
    if isinstance(value, str):
        value = [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise DataError(f"{where}: '{key}' is a JSON {type(value).__name__}, expected a string or a list of "
                        f"{MESSAGE_FORM} messages")
    return checked_messages(value, where, f"'{key}'")


def _pair(obj: Any, where: str) -> Pair:
    """The pair of one parsed jsonl line, checked."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, expected {FORM}")
    for key in ("prompt", *ANSWERS):
        if key not in obj:
            raise DataError(f"{where}: no '{key}': every line is {FORM}; add it or remove the line")
    prompt = _side(obj, "prompt", where, "user")
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f"{where}: 'system' is a JSON {type(system).__name__}, expected a string")
        if prompt and prompt[0]["role"] == "system":
            raise DataError(f"{where}: both 'system' and a system message in 'prompt'; keep one of them")
        prompt = checked_messages([{"role": "system", "content": system}], where, "'system'") + prompt
    answers = [_side(obj, key, where, "assistant") for key in ANSWERS]
    for key, messages in zip(ANSWERS, answers):
        if not any(m["role"] == "assistant" and m["content"] for m in messages):
            raise DataError(f"{where}: '{key}' has no assistant text, so there is nothing to compare; give it a "
                            "non-empty answer or remove the line")
    return Pair(where, prompt, *answers)


def read_pairs(path: str) -> List[Pair]:
    """Every preference pair of the jsonl file ``path``; a bad line is a one-line DataError naming
    the file and line."""
    out = [_pair(obj, where) for where, obj in jsonl_rows(path, "preference pairs")]
    if not out:
        raise DataError(f"data.path={path}: no preference pairs in the file")
    return out


def _render(template, pair: Pair) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(ids, learned) of prompt + chosen and prompt + rejected, learning the answers alone."""
    history = 0  # the learned tokens of the prompt's own assistant turns
    if any(m["role"] == "assistant" for m in pair.prompt):
        history = int(tokens_of(template, pair.prompt, pair.where)[1].sum())
    out = []
    for answer in (pair.chosen, pair.rejected):
        ids, learned = tokens_of(template, pair.prompt + answer, pair.where)
        learned = learned.copy()
        learned[np.flatnonzero(learned)[:history]] = False
        out.append((ids, learned))
    return out


def pair_positions(chosen: int, rejected: int, seq_length: int) -> Tuple[int, int]:
    """The positions a pair keeps of ``chosen`` and ``rejected`` (each a document's ids minus one):
    all when they fit ``seq_length`` together, else half each, a shorter side leaving the rest of
    its half to the other (the chosen side takes the odd position)."""
    if chosen + rejected <= seq_length:
        return chosen, rejected
    kept = min(chosen, max(seq_length - rejected, seq_length - seq_length // 2))
    return kept, min(rejected, seq_length - kept)


def tokenize_pairs(path: str, tokenizer: Tokenizer, seq_length: int, vocab_size: int) -> SFTSamples:
    """Read, render, cut (see the module docstring) and tokenize ``path``: two documents a pair."""
    template = load_template(tokenizer)
    ids, flags, dropped = [], [], 0
    for pair in read_pairs(path):
        (c_ids, c_learned), (r_ids, r_learned) = _render(template, pair)
        c, r = pair_positions(len(c_ids) - 1, len(r_ids) - 1, seq_length)
        if not (c_learned[1:c + 1].any() and r_learned[1:r + 1].any()):
            dropped += 1
            continue
        ids += [c_ids[:c + 1], r_ids[:r + 1]]
        flags += [c_learned[:c + 1], r_learned[:r + 1]]
    if dropped:
        log.warning("%s: %d preference pair(s) left out: an answer had no token within model.seq_length=%d "
                    "(raise it, or shorten the prompts, to keep them)", path, dropped, seq_length)
    if not ids:
        raise DataError(f"{path}: no preference pair has tokens of both answers within model.seq_length="
                        f"{seq_length}; raise model.seq_length or shorten the prompts")
    samples = concatenate(ids, flags, group=2)
    check_token_ids(samples.ids, path, tokenizer, template, vocab_size)
    log.info("%s: %d preference pairs, chat template: %s", path, len(samples), template.name)
    return samples
