"""Placement: which rows are replicated on every worker (hot) and which stay sharded (and cached).

Modules: plan.py (Plan, FAE, plan_run), profile.py (access profiles), sca.py (cost model).
A planner is a pure function from an access profile (profile.py), the world size, the table
shapes, the optimizer and a per-worker memory budget to a Plan. Plans are checked up front and fail
with a clear message when they cannot fit. Planners:
- none: every row sharded (the default);
- fae:  FAE's hot embeddings: the most read rows that fit the budget are replicated; with
        placement.hot_batches the scheduler forms hot batches (trainer/sparse/schedule/feed.py);
- sca:  the cost-model planner (sca.py): replicate / cache / shard per frequency bucket, by
        predicted bytes per step under the budget.
Rank 0 plans and broadcasts the plan, so every rank applies the very same plan.
"""
from .plan import PLANNERS, Plan, fae_plan, make_plan, plan_run, register, row_bytes
from .profile import AccessProfile, flat_ids, profile_stream
from .sca import sca_plan

__all__ = ["AccessProfile", "PLANNERS", "Plan", "fae_plan", "flat_ids", "make_plan", "plan_run", "profile_stream",
           "register", "row_bytes", "sca_plan"]
