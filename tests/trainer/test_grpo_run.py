"""A GRPO run's inputs and failures: the prompt file's bad lines, each named; a reward function that raises
at step N stops the run with one line naming the function, the step and the prompt, and the checkpoint
written before it stays (a LoRA run with a KL term: its reference is the base, adapters off)."""

import json
from pathlib import Path

import pytest

from polyshard.data.tokenizer import load_tokenizer
from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.data.prompts import read_prompts
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError, DataError
from polyshard.trainer.loop import Trainer
from polyshard.trainer.loop.rollouts import cut_at_stop
from polyshard.trainer.tasks.rewards import RewardError


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", 'expected a JSON object {"prompt": "..."}'),
        ('{"question": "2+2="}', 'no "prompt" text (or "prompt_ids"); got the fields [\'question\']'),
        ('{"prompt": ""}', "the prompt is empty"),
        ('{"prompt": "a very long prompt"}', "the prompt is 18 tokens, but a row leaves 10 beside"),
        ('{"prompt_ids": [1, -2]}', "prompt_ids must be a list of token ids (integers >= 0)"),
        ('{"prompt_ids": [1, 300]}', "token id 300 is past model.vocab_size=256"),
        ("{not json", "not a JSON object"),
    ],
)
def test_a_bad_prompt_line_is_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok>"}\n' + line + "\n")
    with pytest.raises(DataError) as error:
        read_prompts(path, load_tokenizer("bytes"), room=10, vocab=256, field_name="data.source")
    assert message in str(error.value) and f"{path}, line 2" in str(error.value) and "\n" not in str(error.value)


def test_prompt_columns_and_token_ids_are_read(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ab>", "answer": "ba", "level": 2}\n\n{"prompt_ids": [97, 62], "answer": "a"}\n')
    first, second = read_prompts(path, load_tokenizer("bytes"), room=10, vocab=256, field_name="data.source")
    assert first.ids == [97, 98, 62] and first.columns == {"answer": "ba", "level": 2}
    assert second.text == "a>" and second.columns == {"answer": "a"}


def test_a_completion_ends_with_the_token_that_completes_a_stop_string():
    tokenizer = load_tokenizer("bytes")
    ids = tokenizer.encode("cba\nxyz")
    assert cut_at_stop(ids, tokenizer, ["\n"]) == tokenizer.encode("cba\n")
    assert cut_at_stop(ids, tokenizer, ["yz", "a\nx"]) == tokenizer.encode("cba\nx")
    assert cut_at_stop(ids, tokenizer, ["q"]) == ids and cut_at_stop(ids, tokenizer, []) == ids


def failing_at_third_step(prompts, completions, tally, **_):
    """Scores 0.5 twice, then raises: the calls are counted in the file the prompt lines name."""
    count = Path(tally[0])
    calls = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(calls))
    if calls == 3:
        raise ValueError("the grader lost its answers")
    return [0.5] * len(completions)


def _run_until_it_fails(config, out):
    mesh = Mesh(config.parallel.mesh_axes)
    trainer = Trainer(config, mesh, out, log=False)
    assert trainer.rollouts is not None and not list(trainer.rollouts.reference.parameters())  # LoRA: the base
    try:
        trainer.run()
    except RewardError as error:
        return str(error), sorted(p.name for p in (out / "checkpoints").iterdir())
    return None, []


def test_a_reward_that_raises_names_the_step_and_keeps_the_last_checkpoint(distributed, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    tally = str(tmp_path / "calls")
    prompts.write_text("".join(json.dumps({"prompt": f"{w}>", "tally": tally}) + "\n" for w in ("ab", "cd", "ef", "g")))
    config = from_dict(
        {
            "model": {"kind": "gpt", "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 8},
            "training": {"task": "grpo", "steps": 4, "global_batch_size": 2},
            "eval": {"every": 0, "sample_tokens": 0},
            "grpo": {
                "generations": 2,
                "max_completion_length": 4,
                "beta": 0.1,
                "rewards": [{"function": "tests.trainer.test_grpo_run:failing_at_third_step"}],
            },
            "lora": {"rank": 2},
            "data": {"source": str(prompts), "tokenizer": "bytes", "val_fraction": 0.25},
            "checkpoint": {"every": 2},
            "logging": {"progress_bar": False},
        }
    )
    message, kept = distributed.run(1, _run_until_it_fails, config, tmp_path / "run")[0]
    assert message is not None and "\n" not in message
    assert "'failing_at_third_step' raised ValueError: the grader lost its answers at step 3" in message
    assert "(prompt '" in message
    assert kept == ["step_00000002"]


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        ({"pp": 2}, "parallel.pp > 1"),
        ({"cp": 2}, "parallel.cp > 1"),
        ({"tp": 2, "sequence_parallel": True}, "parallel.sequence_parallel"),
    ],
)
def test_layouts_generation_does_not_run_are_refused_by_name(tmp_path, parallel, named):
    """GRPO generates one token at a time on the training mesh: pipeline stages, cp chunks and SP's split
    sequence are refused before any process starts; ZeRO-3 (a sharded reference) is not."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab>"}\n{"prompt": "cd>"}\n')
    sections = {
        "model": {"kind": "gpt", "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 8},
        "training": {"task": "grpo", "steps": 1, "global_batch_size": 2},
        "grpo": {"generations": 2, "beta": 0.1, "rewards": [{"function": "exact_answer"}]},
        "data": {"source": str(prompts), "tokenizer": "bytes"},
    }
    config = from_dict({**sections, "parallel": parallel})
    with pytest.raises(ConfigError) as error:
        validate(config, world_size=config.parallel.world_size)
    assert named in str(error.value) and "\n" not in str(error.value)
    sharded = from_dict({**sections, "parallel": {"dp": 2, "zero_stage": 3}})
    validate(sharded, world_size=2)
