"""The layout planner: what each rank holds and how long a step takes, for any candidate layout.

layout.py       a candidate: dp, tp, pp, ep, cp, ZeRO stage, microbatches, schedule
memory.py       parameters, gradients and optimizer state per rank (ZeRO paper; polyshard's engine, exact)
"""
