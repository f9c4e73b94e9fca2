"""Seeing where time goes: ``logging.profile_steps`` (a Chrome trace per rank, the pipeline's measured
timeline beside the simulator's) and ``logging.tensorboard`` (the metrics as TensorBoard scalars)."""

import pytest

from polyshard.trainer.config import load_config
from polyshard.trainer.constraints import validate
from polyshard.trainer.errors import ConfigError


@pytest.mark.parametrize(
    "override, message",
    [
        ("logging.profile_steps=[3,1]", r"logging.profile_steps=\[3, 1\]: the first step comes after the last"),
        ("logging.profile_steps=[0,2]", r"logging.profile_steps=\[0, 2\]: steps count from 1"),
        ("logging.profile_steps=[2]", r"logging.profile_steps=\[2\] must be two steps \[first, last\]"),
        ("logging.profile_steps=[1,2,3]", r"logging.profile_steps=\[1, 2, 3\] must be two steps"),
        ("logging.profile_steps=3", r"logging.profile_steps=3 must be a list of integers or unset"),
        ("logging.profile_steps=[1.5,2]", r"logging.profile_steps=\[1.5, 2\] must be a list of integers"),
        ('logging.profile_steps="2-3"', r"logging.profile_steps='2-3' must be a list of integers"),
    ],
)
def test_bad_logging_fields_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_profile_steps_past_the_run_are_refused_before_launch():
    config = load_config(None, ["training.steps=10", "logging.profile_steps=[5,12]"])
    with pytest.raises(ConfigError, match=r"logging.profile_steps=\[5, 12\] ends past training.steps=10"):
        validate(config, world_size=1)
    validate(load_config(None, ["training.steps=10", "logging.profile_steps=[10,10]"]), world_size=1)
