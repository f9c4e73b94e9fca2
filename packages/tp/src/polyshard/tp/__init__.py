"""polyshard.tp: Tensor and sequence parallelism."""
