"""polyshard.trainer: config, models, data and the training loop."""
