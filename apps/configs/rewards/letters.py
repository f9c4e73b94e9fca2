"""A reward function of the GRPO example (apps/configs/gpt-tiny-reverse-grpo.toml), in TRL's signature:
the prompts, the completions, and each other field of the prompt lines as a keyword, all aligned."""


def letters_in_place(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """The share of the answer's letters that the completion has at the same place (partial credit: a
    group of completions that are all wrong still differs, so its advantages still point somewhere)."""
    scores = []
    for completion, expected in zip(completions, answer):
        said = completion.strip()
        scores.append(sum(a == b for a, b in zip(said, expected)) / max(len(expected), len(said), 1))
    return scores
