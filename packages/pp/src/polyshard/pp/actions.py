"""The vocabulary of schedules: small actions that print compactly.

A compute action is one of four :class:`Kind`\\ s: ``FORWARD``, ``BACKWARD``
(the full backward: input and weight gradients at once), or the zero-bubble
split of it, ``BACKWARD_INPUT`` (the input gradient only, which the stage
before is waiting for) followed later by ``BACKWARD_WEIGHT`` (the weight
gradient, run whenever the rank would otherwise idle). Communication actions
are added by the lowering pass:

    SEND_FORWARD   stage s sends its output of microbatch k to stage s+1      "0SF3"
    RECV_FORWARD   stage s receives its input of microbatch k from stage s-1  "1RF3"
    SEND_BACKWARD  stage s sends the gradient of its input to stage s-1       "1SB3"
    RECV_BACKWARD  stage s receives the gradient of its output from stage s+1 "0RB3"

Every action prints as ``{stage}{letter}{microbatch}`` (torch.distributed.pipelining's
convention) with the letters users know from the drawings: F, B, W (both backward
kinds print as B; a W beside it says the B was the input half). Grids of
one-stage-per-rank schedules drop the stage: ``F3``.

Where stages live is data too: ``Schedule.placement[s]`` is the rank of stage s.
Megatron's loop puts stage s on rank ``s % p`` (:func:`loop_placement`); a V puts
stages r and 2p-1-r on rank r (:func:`v_placement`), so the first and the last
stage share rank 0 and a microbatch turns around on rank p-1 without a hop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from polyshard.pp.errors import ScheduleError


class Kind(enum.Enum):
    """What an action does; the value is a short code, :attr:`letter` what drawings print."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input gradient and weight gradients
    BACKWARD_INPUT = "I"  # input gradient only; a BACKWARD_WEIGHT of the same (stage, microbatch) follows
    BACKWARD_WEIGHT = "W"  # weight gradients of an earlier BACKWARD_INPUT
    SEND_FORWARD = "SF"
    RECV_FORWARD = "RF"
    SEND_BACKWARD = "SB"
    RECV_BACKWARD = "RB"

    @property
    def letter(self) -> str:
        """How the kind prints: F, B, W (both backward kinds as B), SF, RF, SB, RB."""
        return "B" if self is Kind.BACKWARD_INPUT else self.value

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_FORWARD, Kind.RECV_BACKWARD)

    @property
    def ends_activation(self) -> bool:
        """A backward that consumes the stored activation's gradient path (full or input half)."""
        return self in (Kind.BACKWARD, Kind.BACKWARD_INPUT)

    @property
    def accumulates_weight_grads(self) -> bool:
        """Writes into parameters' ``.grad`` (a data-parallel reducer's hooks fire here)."""
        return self in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})


@dataclass(frozen=True, slots=True)
class Action:
    kind: Kind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(f"action kind {self.kind!r} is not a polyshard.pp.Kind; use e.g. Kind.FORWARD")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.letter}{self.microbatch}"

    def short(self, with_stage: bool) -> str:
        return str(self) if with_stage else f"{self.kind.letter}{self.microbatch}"

    def message_key(self) -> Action:
        """The send that carries this send's or receive's tensor: equal on both sides of the wire.

        A stage's input always comes from stage s-1 and its output gradient from stage s+1,
        whichever ranks they live on, so the key is independent of placement.
        """
        if self.kind.is_send:
            return self
        if self.kind is Kind.RECV_FORWARD:
            return activation(self.stage - 1, self.microbatch)
        if self.kind is Kind.RECV_BACKWARD:
            return gradient(self.stage + 1, self.microbatch)
        raise ValueError(f"{self} is a compute action and carries no message")


def activation(stage: int, microbatch: int) -> Action:
    """The message holding ``stage``'s output of ``microbatch`` (stage+1's input)."""
    return Action(Kind.SEND_FORWARD, stage, microbatch)


def gradient(stage: int, microbatch: int) -> Action:
    """The message holding the gradient of ``stage``'s input (stage-1's output gradient)."""
    return Action(Kind.SEND_BACKWARD, stage, microbatch)


@dataclass(frozen=True)
class Exchange:
    """Sends and receives posted together (one batch of isend/irecv); posting never waits."""

    ops: tuple[Action, ...]

    def __str__(self) -> str:
        return "[" + " ".join(str(op) for op in self.ops) + "]"

    def short(self, with_stage: bool) -> str:
        return str(self)


@dataclass(frozen=True)
class Wait:
    """Wait until receives posted by an earlier :class:`Exchange` hold their data (before the compute
    that reads them)."""

    ops: tuple[Action, ...]

    def __str__(self) -> str:
        return "(" + " ".join(str(op) for op in self.ops) + ")"

    def short(self, with_stage: bool) -> str:
        return str(self)


Step = Action | Exchange | Wait


def loop_placement(num_ranks: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Stage s on rank s % p: rank r holds r, r+p, ..., r+(v-1)p (Megatron-LM's interleaving).

    p=2, v=2: (0, 1, 0, 1).
    """
    return tuple(stage % num_ranks for stage in range(num_ranks * virtual_stages))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank r holds stages r and 2p-1-r.

    p=2: (0, 1, 1, 0); p=4: (0, 1, 2, 3, 3, 2, 1, 0). A microbatch runs down the ranks
    and back up; rank 0 holds the first and the last stage.
    """
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank compute order of one training step (what a schedule function returns).

    ``actions[r]`` lists rank r's compute actions in the order it runs them. ``placement[s]``
    is the rank holding stage s (default :func:`loop_placement`); every rank holds
    ``virtual_stages`` of the ``num_ranks * virtual_stages`` stages. ``overlapped`` holds
    (forward, backward) pairs, adjacent on their rank, that a runtime may run as one
    overlapped unit (DualPipe's F&B); the simulator can cost them so, the executor runs
    them one after the other.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()
    overlapped: frozenset[tuple[Action, Action]] = frozenset()
    _stages: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p, v = self.num_ranks, self.virtual_stages
        if not self.placement:
            object.__setattr__(self, "placement", loop_placement(p, v))
        stages = tuple(tuple(s for s, r in enumerate(self.placement) if r == rank) for rank in range(p))
        if len(self.placement) != p * v or any(len(mine) != v for mine in stages):
            raise ScheduleError(
                f"placement {self.placement} must give each of the {p} ranks exactly virtual_stages={v} "
                f"of the {p * v} stages, e.g. {loop_placement(p, v)}"
            )
        object.__setattr__(self, "_stages", stages)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank holds, in increasing order."""
        return list(self._stages[rank])

    def grid(self) -> str:
        """One line per rank: its compute actions in order."""
        with_stage = self.virtual_stages > 1
        return "\n".join(
            f"rank {r}: " + " ".join(a.short(with_stage) for a in actions) for r, actions in enumerate(self.actions)
        )


def check_positive(**values: int) -> None:
    """Schedule arguments: each must be a positive integer (``num_ranks=2, num_microbatches=0`` raises)."""
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def build_schedule(
    name: str, num_microbatches: int, per_rank: list[list[Action]], placement: tuple[int, ...]
) -> Schedule:
    """A :class:`Schedule` from per-rank lists; ranks and stages per rank follow from ``placement``."""
    num_ranks = len(per_rank)
    return Schedule(
        name, num_ranks, num_microbatches, len(placement) // num_ranks, tuple(map(tuple, per_rank)), placement
    )
