"""Tolerances from a stated bound: float32 round-off, counted, instead of one machine's figure.

Two runs of the same maths that take their sums in another order (a mean split over ranks, a matmul
sharded over tp, another CPU's kernels blocking a product differently: AVX-512, AVX2 and the default
kernels each do) differ by round-off only. Every float32 operation rounds its result to within
U = 2**-24 of its size (the unit round-off), so:

- a sum of ``terms`` values whose magnitudes add up to ``size``, taken in any order, is within
  ``(terms - 1) * U * size`` of the exact sum (Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., eq. 4.4); two orders are within twice that of each other: ``reordered_sum``.
- a chain of such sums (a layer's forward, then its backward) adds the bounds of its links:
  ``terms`` is then the total of the fan-ins on the longest path, and ``size`` the largest
  magnitude on it.
- AdamW moves each element by ``lr * m / (sqrt(v) + eps)``, the gradient divided by its own running
  size: a relative change ``rel`` in the gradients moves a step by ``lr * rel`` at most, compounded
  over ``steps``: ``adamw_drift``. An element whose gradient is as small as its own round-off is the
  exception (its step's direction is round-off); the tests that compare parameters after AdamW say
  how far from that their gradients are, or bound such elements by a stated fraction of a step.

A real bug (a missed or doubled average, a stale or wrong shard, a mask off by one) changes values
by their own size (1e-1 to 1e0 relative) or a whole step (``lr``): each test's comment says how far
its bound stays below that.
"""

U = 2.0**-24  # float32 unit round-off: one rounding moves a result by at most this fraction of it


def reordered_sum(terms: int, size: float = 1.0) -> float:
    """Worst case distance between two float32 sums of ``terms`` values whose magnitudes add to
    ``size``, taken in two different orders (each within ``(terms - 1) U size`` of the exact sum)."""
    if terms < 1 or size < 0:
        raise ValueError(f"terms must be >= 1 and size >= 0, got terms={terms}, size={size}")
    return 2 * (terms - 1) * U * size


def adamw_drift(lr: float, steps: int, rel: float, size: float = 1.0) -> float:
    """How far ``steps`` AdamW steps of learning rate ``lr`` may move two copies of a parameter of
    magnitude ``size`` apart, when their gradients differ by ``rel`` relative: each step's update
    ``lr * m / sqrt(v)`` moves by ``lr * rel`` (AdamW divides by the gradient's own size, so the
    relative error passes through without growing), and the update itself rounds the parameter
    (``p * (1 - lr * wd) - step``: two roundings of ``size``)."""
    return steps * (lr * rel + 2 * U * size)


class AdamWDrift:
    """The elementwise bound on how far AdamW's parameters may drift from a reference's when every
    gradient is off by round-off of relative size ``grad_rel`` (of the tensor's largest gradient, which
    stands for the magnitudes its sums add), accumulated step by step from the reference optimizer's own
    state: this run's numbers, not a figure read off one machine.

    Each step's update ``lr * m / (sqrt(v) + eps)`` (bias-corrected) moves by ``lr * dm / (sqrt(v) + eps)``
    through the first moment and by ``lr * |m| dv / (2 v^1.5)`` through the second, where ``dm <= dg`` (an
    average of the gradients' errors) and ``dv <= 2 |g|max dg``: together ``lr * dg * (1 + |m| |g|max / v) /
    (sqrt(v) + eps)``, plus two roundings of the parameter. It is large only where a gradient is as small
    as its own round-off (there the step's direction is round-off). Second-order terms (the drift changing
    later gradients) are smaller by the learning rate and are left out.

        drift = AdamWDrift(reference_optimizer, grad_rel=reordered_sum(terms))
        ...; reference_optimizer.step(); drift.after_step(); reference_optimizer.zero_grad()
        assert ((mine - reference).abs() <= drift.bound[reference_param]).all()
    """

    def __init__(self, optimizer, grad_rel: float):
        self.optimizer, self.grad_rel = optimizer, grad_rel
        self.bound: dict = {}
        self._g_max: dict = {}
        self._dg_max: dict = {}

    def after_step(self) -> None:
        """Call after the reference optimizer's step, while its gradients are still there."""
        import torch

        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.detach().abs()
                self._g_max[p] = torch.maximum(self._g_max.get(p, g), g)
                dg = self._dg_max[p] = max(self._dg_max.get(p, 0.0), self.grad_rel * float(g.max()))
                state, step = self.optimizer.state[p], float(self.optimizer.state[p]["step"])
                m = state["exp_avg"].abs() / (1 - beta1**step)
                root = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt() + group["eps"]
                moved = group["lr"] * dg * (1 + m * self._g_max[p] / root**2) / root + 2 * U * p.detach().abs()
                self.bound[p] = self.bound.get(p, 0.0) + moved
