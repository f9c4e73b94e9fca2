"""Data: the built-in Shakespeare corpus, local text, the digits images, per-rank loaders."""

from polyshard.trainer.data.digits import digits_splits
from polyshard.trainer.data.loader import ShardedLoader
from polyshard.trainer.data.text import VOCAB_SIZE, check_text_source, decode, encode, packed_splits

__all__ = ["VOCAB_SIZE", "ShardedLoader", "check_text_source", "decode", "digits_splits", "encode", "packed_splits"]
