"""Which sample construction feeds ``model.arch``: GPT windows (``gpt_dataset``), BERT masked
sentence pairs (``bert_dataset``) or T5 span corruption (``t5_dataset``), as a factory that
``builders.build_datasets`` calls for each corpus and split."""

from __future__ import annotations

from typing import Callable, Optional

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.data.bert_dataset import BERT_SPECIALS, BertDataset, check_vocab_covers, special_tokens
from megatron_hydra.data.builders import build_tokenizer_for
from megatron_hydra.data.t5_dataset import T5_SPECIALS, T5Dataset


def dataset_factory(data_cfg, tcfg: TransformerConfig, seed: int) -> Optional[Callable]:
    """``(indexed, documents, num_samples, split name) -> Dataset`` for BERT and T5; None for GPT.
    Fails here (before any worker starts) when the model's vocabulary cannot hold the special
    tokens the tokenizer lacks."""
    if tcfg.arch == "gpt":
        return None
    d, tok = data_cfg, build_tokenizer_for(data_cfg)
    if tcfg.arch == "bert":
        ids = special_tokens(tok, BERT_SPECIALS)
        check_vocab_covers(ids, tcfg.vocab_size, "BERT")
        return lambda indexed, docs, n, name: BertDataset(
            indexed, docs, n, tcfg.seq_length, seed, tok, ids, d.masked_lm_prob, d.short_seq_prob,
            tcfg.binary_head, d.whole_word_masking, name)
    ids = special_tokens(tok, T5_SPECIALS)
    check_vocab_covers(ids, tcfg.vocab_size, "T5")
    return lambda indexed, docs, n, name: T5Dataset(
        indexed, docs, n, tcfg.seq_length, tcfg.decoder_seq_length, seed, ids, tok.eod, d.masked_lm_prob,
        d.mean_noise_span_length, d.short_seq_prob, name)
