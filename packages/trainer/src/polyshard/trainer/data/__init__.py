"""Data: the built-in Shakespeare corpus, local text, fine-tuning pairs, the digits images, per-rank loaders."""

from polyshard.trainer.data.digits import digits_splits
from polyshard.trainer.data.loader import ShardedLoader
from polyshard.trainer.data.pairs import check_pairs_source, pair_splits
from polyshard.trainer.data.text import VOCAB_SIZE, check_text_source, decode, encode, packed_splits

__all__ = [
    "VOCAB_SIZE",
    "ShardedLoader",
    "check_pairs_source",
    "check_text_source",
    "decode",
    "digits_splits",
    "encode",
    "packed_splits",
    "pair_splits",
]
