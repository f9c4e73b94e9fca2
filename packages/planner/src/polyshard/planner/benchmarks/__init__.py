"""Benchmarks of whole-model behaviour (not tests): run under torchrun by ``polyshard bench``."""
