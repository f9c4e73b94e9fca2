"""Data of a run: the built-in Shakespeare corpus, every language source as a prepared dataset (prepared
on first use), the digits images. Reading, the order and the loader are polyshard.data's."""

from polyshard.trainer.data.digits import digits_splits
from polyshard.trainer.data.language import RunData, check_language_data, language_data, local_files, prepared_folder

__all__ = ["RunData", "check_language_data", "digits_splits", "language_data", "local_files", "prepared_folder"]
