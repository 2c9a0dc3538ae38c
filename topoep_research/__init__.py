"""TopoEP's research code beside the library: the offline `joint` planner (`joint`, `joint_search`), the exact
MILP of problem (8) and its lower bounds (`milp`, `bound`), and the cluster-scale cost simulator (`sim`).

The library (`topoep`) imports nothing from here. Importing this package registers policy "joint" for
`topoep.solve` (`topoep.planners.register_policy`); the benchmarks in bench/ import it where they plan
with joint or simulate.
"""

from topoep.planners import register_policy
from topoep_research.joint import solve_joint

# the policies this package registers for topoep.solve (all offline: topoep.OFFLINE_POLICIES)
POLICIES = ("joint",)
register_policy("joint", solve_joint, offline=True, takes_t_ffn=True)

__all__ = ["POLICIES", "solve_joint"]
