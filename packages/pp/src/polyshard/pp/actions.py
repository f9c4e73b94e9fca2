"""The vocabulary of schedules: small actions that print compactly.

A compute action is ``F`` (forward), ``B`` (backward) or ``W`` (weight
gradient). When a schedule has a ``W`` for a (stage, microbatch), its ``B``
computes only the input gradient (zero-bubble split); otherwise ``B`` is the
full backward. Communication actions are added by the lowering pass:

    SF  stage s sends its output of microbatch k to stage s+1      "0SF3"
    RF  stage s receives its input of microbatch k from stage s-1  "1RF3"
    SB  stage s sends the gradient of its input to stage s-1       "1SB3"
    RB  stage s receives the gradient of its output from stage s+1 "0RB3"

Every action prints as ``{stage}{kind}{microbatch}`` (torch.distributed.pipelining's
convention); grids of one-stage-per-rank schedules drop the stage: ``F3``.
Stage ``s`` lives on rank ``s % num_ranks`` (interleaved stages loop around).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def short(self, with_stage: bool) -> str:
        return str(self) if with_stage else f"{self.kind}{self.microbatch}"

    def message_key(self) -> tuple[str, int, int]:
        """Identity of the tensor a send/receive carries, equal on both sides of the wire.

        ("F", s, k): activation from stage s to s+1; ("B", s, k): gradient from stage s to s-1.
        """
        if self.kind == "SF":
            return ("F", self.stage, self.microbatch)
        if self.kind == "RF":
            return ("F", self.stage - 1, self.microbatch)
        if self.kind == "SB":
            return ("B", self.stage, self.microbatch)
        if self.kind == "RB":
            return ("B", self.stage + 1, self.microbatch)
        raise ValueError(f"{self} is a compute action and carries no message")


@dataclass(frozen=True)
class Exchange:
    """Sends and receives posted together (batched isend/irecv), then waited on."""

    ops: tuple[Action, ...]

    def __str__(self) -> str:
        return "[" + " ".join(str(op) for op in self.ops) + "]"

    def short(self, with_stage: bool) -> str:
        return "[" + " ".join(str(op) for op in self.ops) + "]"


Step = Action | Exchange


@dataclass(frozen=True)
class Schedule:
    """Per-rank compute order of one training step (what a schedule function returns).

    ``actions[r]`` lists rank r's F/B/W actions in the order it runs them. ``virtual_stages``
    model stages live on each rank, so the model has ``num_ranks * virtual_stages`` stages.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]
    split_backward: frozenset[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        split = {(a.stage, a.microbatch) for rank in self.actions for a in rank if a.kind == "W"}
        object.__setattr__(self, "split_backward", frozenset(split))

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        return [rank + chunk * self.num_ranks for chunk in range(self.virtual_stages)]

    def grid(self) -> str:
        """One line per rank: its compute actions in order."""
        with_stage = self.virtual_stages > 1
        return "\n".join(
            f"rank {r}: " + " ".join(a.short(with_stage) for a in actions) for r, actions in enumerate(self.actions)
        )
