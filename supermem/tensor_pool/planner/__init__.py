"""The planner: from one profiled step, keep / offload / recompute for every saved tensor. A pure
function of a profile and a budget: make_plan(profile, budget_bytes) -> Plan.

- plan.py: the plan (data) and a simulated run of one.
- simulate.py: the simulator: a plan's memory curve and the seconds it adds to the step.
- greedy.py: make_plan, the greedy over the simulated curve.
- unseen.py: the region calls a plan lets run unseen by the pool (light, bypassed, lean).
"""

from .greedy import _plan_once as _plan_once
from .greedy import make_plan as make_plan
from .plan import Plan as Plan
from .plan import Simulated as Simulated
from .simulate import _Index as _Index
from .simulate import simulate as simulate
