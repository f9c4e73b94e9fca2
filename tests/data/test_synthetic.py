"""Synthetic rows (data.source = "synthetic"): seeded by index, in the vocabulary, no file read."""

import numpy as np
import pytest

from polyshard.data.synthetic import TRAIN_STREAM, VAL_STREAM, SyntheticTokens


def test_a_row_depends_on_its_index_and_seed_alone():
    rows = SyntheticTokens(1000, 9, 50, seed=3)
    whole = rows.rows(np.arange(50))["tokens"]
    assert whole.shape == (50, 9) and whole.dtype == np.int64
    assert whole.min() >= 0 and whole.max() < 1000
    # Any order, any subset (another rank's share, another loader): the same numbers for the same index.
    picked = SyntheticTokens(1000, 9, 50, seed=3).rows(np.array([41, 2, 2, 17]))["tokens"]
    np.testing.assert_array_equal(picked, whole[[41, 2, 2, 17]])
    assert not np.array_equal(SyntheticTokens(1000, 9, 50, seed=4).rows(np.arange(50))["tokens"], whole)
    val = SyntheticTokens(1000, 9, 50, seed=3, stream=VAL_STREAM).rows(np.arange(50))["tokens"]
    assert not np.array_equal(val, whole)  # validation never repeats a training row
    assert len(np.unique(whole[:, 0])) > 30  # rows differ from each other


def test_segments_mark_one_document_per_row_and_bad_sizes_are_refused():
    rows = SyntheticTokens(7, 5, 3, segments=True, stream=TRAIN_STREAM).rows(np.arange(3))
    np.testing.assert_array_equal(rows["segments"], np.zeros((3, 5), dtype=np.int64))
    with pytest.raises(IndexError):
        SyntheticTokens(7, 5, 3).row(3)
    with pytest.raises(ValueError, match="vocab_size >= 1"):
        SyntheticTokens(0, 5, 3)


def test_a_run_on_synthetic_data_reads_its_vocabulary_and_one_row_per_example():
    from polyshard.models.gpt.config import GPTConfig
    from polyshard.trainer.config import Config, DataConfig, EvalConfig, LRScheduleConfig, TrainingConfig
    from polyshard.trainer.data import check_language_data, language_data

    config = Config(
        model=GPTConfig(vocab_size=50_000, context_length=16),
        training=TrainingConfig(steps=5, global_batch_size=4),
        lr_schedule=LRScheduleConfig(warmup_steps=1),
        eval=EvalConfig(batches=2),
        data=DataConfig(source="synthetic"),
    )
    check_language_data(config)  # no file, no cache: nothing to prepare
    data = language_data(config)
    assert data.names == ["synthetic"] and len(data.train[0]) == 5 * 4 and len(data.val) == 2 * 4
    tokens = data.train[0].rows(np.arange(20))["tokens"]
    assert tokens.shape == (20, 17) and tokens.max() < 50_000 and tokens.max() > 256  # the model's vocabulary
