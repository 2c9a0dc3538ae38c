"""bench/joint_work.py: its counters see the joint reference's search and leave the planner as they found it."""

import topoep_research.joint as joint_mod
import topoep_research.joint_search as search_mod
from bench.joint_work import count_work
from topoep import Topology, solve
from topoep.workloads import biased_routing


def test_count_work_counts_the_search_and_restores_the_reference():
    before = (search_mod.search, search_mod._step, search_mod._evict, joint_mod.search)
    r = count_work(ep=4, experts=16, slots=2, rpd=2)
    assert (search_mod.search, search_mod._step, search_mod._evict, joint_mod.search) == before
    assert r["search_calls"] >= 2 and r["steps"] >= r["search_calls"]  # the threshold rounds search at least once each
    assert r["elements"] > 0
    assert r["ep"] == 4 and r["experts"] == 16 and r["seconds"] > 0
    # the counted plan is the policy's plan: the same instance solved again without counters
    topo = Topology(num_domains=2, ranks_per_domain=2)
    plan = solve(biased_routing(4, 16, 1024, 8, -2.5, seed=13), topo, num_slots=2, policy="joint")
    assert plan.info.get("work_left") == r["work_left"]
