"""A balancing plan: which ranks host replicas of which experts, and how every (source, expert) demand
is split over that expert's instances. Plus the invariant checker (C1-C5 of paper 4.2).

Compact representation (what planners produce and the runtime consumes; all int64, on omega's device)
-----------------------------------------------------------------------------------------------------
Physical *instances* are numbered p in [0, P) with P = E + R * N (N = num_slots):

    p = e                 (0 <= e < E)   the main instance of expert e, on rank main_rank[e]
    p = E + r * N + j     (0 <= j < N)   replica slot j of rank r

    slot_expert: int64[R, N]   expert held by slot j of rank r, or -1 if the slot is empty
    route:       int64[R, P]   route[s, p] = assignments of source rank s executed by instance p
                               (of expert instance_expert[p]); zero for empty slots

This is R * (E + R * N) entries (about R * E * k with k = average instances per expert), not the
R * E * R of the dense q, and its size depends only on (R, E, N), so a GPU planner can allocate it
once. Instances of one expert are ordered by p (main first, then slots by rank, then slot index):
the runtime splits the omega[s, e] assignments of source s, taken in token order, over the
instances of e in that order, route[s, p] at a time.

Dense view (tests, metrics, MILP): x: bool[E, R] (rank r hosts an instance of e), q: int64[R, E, R].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from topoep.topology import Topology

# Policies bound by C4 (the topology-aware ones); the topology-unaware baselines are exempt.
C4_POLICIES = frozenset({"topoep", "topoep_plus", "topoep_plus_local", "topoep_plus_spread", "topoep_plus_spread_tree",
                         "joint"})


@dataclass(eq=False, kw_only=True)
class Plan:
    """Replica placement and token split for one MoE layer and microbatch.

    omega: int64[R, E] the routing counts the plan was made for.
    slot_expert: int64[R, N]; route: int64[R, E + R * N] (see module docstring).
    """

    omega: torch.Tensor
    topology: Topology
    num_slots: int
    main_rank: torch.Tensor
    slot_expert: torch.Tensor
    route: torch.Tensor
    policy: str
    expert_bytes: int
    token_bytes: int
    info: dict = field(default_factory=dict)
    """Policy-specific diagnostics (e.g. refinement iterations); never used by the runtime."""

    # -- shapes --------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.omega.shape[0]

    @property
    def num_experts(self) -> int:
        return self.omega.shape[1]

    @property
    def num_instances(self) -> int:
        return self.num_experts + self.num_ranks * self.num_slots

    # -- derived views (cached; plans are immutable once made) ---------------------------------
    @cached_property
    def instance_expert(self) -> torch.Tensor:
        """int64[P]: logical expert of each physical instance, -1 for an empty slot."""
        E = self.num_experts
        return torch.cat([torch.arange(E, device=self.omega.device), self.slot_expert.reshape(-1)])

    @cached_property
    def instance_rank(self) -> torch.Tensor:
        """int64[P]: rank hosting each physical instance (for empty slots: the slot's rank)."""
        R, N = self.num_ranks, self.num_slots
        slot_rank = torch.arange(R, device=self.omega.device).repeat_interleave(N)
        return torch.cat([self.main_rank.to(self.omega.device), slot_rank])

    @cached_property
    def instance_load(self) -> torch.Tensor:
        """int64[P]: U, assignments executed by each instance."""
        return self.route.sum(0)

    @cached_property
    def rank_load(self) -> torch.Tensor:
        """int64[R]: L, assignments executed by each rank."""
        return torch.zeros(self.num_ranks, dtype=torch.int64, device=self.omega.device).index_add_(
            0, self.instance_rank, self.instance_load
        )

    @property
    def num_replicas(self) -> int:
        return int((self.slot_expert >= 0).sum())

    # -- dense view ----------------------------------------------------------------------------
    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x: bool[E, R], q: int64[R, E, R]). For tests and small cases: q is R * E * R."""
        R, E = self.num_ranks, self.num_experts
        dev = self.omega.device
        valid = self.instance_expert >= 0
        pe, pr = self.instance_expert[valid], self.instance_rank[valid]
        x = torch.zeros(E, R, dtype=torch.bool, device=dev)
        x[pe, pr] = True
        q = torch.zeros(R, E * R, dtype=torch.int64, device=dev)
        q.index_add_(1, pe * R + pr, self.route[:, valid])
        return x, q.view(R, E, R)

    @classmethod
    def from_dense(cls, x, q, omega, topology, *, num_slots, main_rank=None, policy="dense",
                   expert_bytes=1, token_bytes=1, info=None) -> "Plan":
        """Build the compact plan from a dense (x[E, R], q[R, E, R]); replicas fill each rank's slots
        in increasing expert order. Raises ValueError if a rank hosts more than num_slots replicas."""
        omega = torch.as_tensor(omega, dtype=torch.int64)
        R, E = omega.shape
        main_rank = default_main_rank(E, R, omega.device) if main_rank is None else main_rank.to(torch.int64)
        x = torch.as_tensor(x, dtype=torch.bool).clone()
        q = torch.as_tensor(q, dtype=torch.int64)
        x[torch.arange(E), main_rank] = False  # main instances are implicit
        slot_expert = torch.full((R, num_slots), -1, dtype=torch.int64)
        route = torch.zeros(R, E + R * num_slots, dtype=torch.int64)
        route[:, :E] = q[:, torch.arange(E), main_rank]
        for r in range(R):
            experts = torch.nonzero(x[:, r]).flatten().tolist()
            if len(experts) > num_slots:
                raise ValueError(f"C3 (replica capacity) violated: rank {r} hosts {len(experts)} replicas "
                                 f"{experts} but num_slots={num_slots}")
            for j, e in enumerate(experts):
                slot_expert[r, j] = e
                route[:, E + r * num_slots + j] = q[:, e, r]
        return cls(omega=omega, topology=topology, num_slots=num_slots, main_rank=main_rank,
                   slot_expert=slot_expert, route=route, policy=policy, expert_bytes=expert_bytes,
                   token_bytes=token_bytes, info=dict(info or {}))

    # -- invariants ----------------------------------------------------------------------------
    def check(self, c4: bool | None = None) -> "Plan":
        """Raise ValueError naming the violated constraint; returns self when the plan is valid.

        C1 token conservation, C2 instance reachability (no assignment to an empty slot), C3 replica
        capacity, C5 fixed main placement, no duplicate instance of an expert on a rank, and C4 (cross-
        domain replica only if expert_bytes < 2 * D[d, e] * token_bytes) when `c4` is True (default:
        only for the topology-aware policies). Replicas placed by the capacity step
        (`topoep.planners.capacity`, listed in info["capacity"]["new_replicas"]) are exempt from C4 and may
        replicate an expert on its own main rank (a self-replica: the same rank's other receive region).
        """
        R, E, N = self.num_ranks, self.num_experts, self.num_slots
        P = E + R * N
        om, se, rt = self.omega, self.slot_expert, self.route
        for name, t, shape in (("slot_expert", se, (R, N)), ("route", rt, (R, P)), ("main_rank", self.main_rank, (E,))):
            if t.dtype != torch.int64 or tuple(t.shape) != shape:
                raise ValueError(f"plan.{name} must be int64{list(shape)}, got {t.dtype}{list(t.shape)}")
        if ((self.main_rank < 0) | (self.main_rank >= R)).any():
            raise ValueError("C5 (fixed main placement) violated: main_rank has values outside [0, R)")
        if ((se < -1) | (se >= E)).any():
            raise ValueError(f"C3 (replica capacity) violated: slot_expert has values outside [-1, {E})")
        # C3 holds by construction (N slots per rank); C5 too (instance p = e is always the main).
        rank_ids = torch.arange(R, device=se.device)[:, None].expand(R, N)
        occupied = se >= 0
        fitted = torch.zeros(R, N, dtype=torch.bool, device=se.device)  # placed by the capacity step
        for r, j in self.info.get("capacity", {}).get("new_replicas", ()):
            fitted[r, j] = True
        own = occupied & (self.main_rank[se.clamp(min=0)] == rank_ids) & ~fitted
        if own.any():
            r, j = torch.nonzero(own)[0].tolist()
            raise ValueError(f"duplicate instance: slot {j} of rank {r} replicates expert {se[r, j].item()}, "
                             "whose main instance is already on that rank")
        if N > 1:
            s_sorted = torch.where(occupied, se, -torch.arange(1, N + 1, device=se.device)[None, :]).sort(1).values
            dup = (s_sorted[:, 1:] == s_sorted[:, :-1]) & (s_sorted[:, 1:] >= 0)
            if dup.any():
                r = torch.nonzero(dup.any(1))[0].item()
                raise ValueError(f"duplicate instance: rank {r} holds expert {s_sorted[r][1:][dup[r]][0].item()} "
                                 "in two replica slots")
        if (rt < 0).any():
            raise ValueError("C1 (token conservation) violated: route has negative counts")
        empty = self.instance_expert < 0
        if (rt[:, empty] != 0).any():
            s, p = torch.nonzero(rt * empty[None, :])[0].tolist()
            raise ValueError(f"C2 (instance reachability) violated: source {s} sends {rt[s, p].item()} "
                             f"assignments to empty slot {(p - E) % N} of rank {(p - E) // N}")
        got = torch.zeros(R, E, dtype=torch.int64, device=om.device)
        got.index_add_(1, self.instance_expert[~empty], rt[:, ~empty])
        if not torch.equal(got, om):
            s, e = torch.nonzero(got != om)[0].tolist()
            raise ValueError(f"C1 (token conservation) violated: source {s} expert {e}: the plan executes "
                             f"{got[s, e].item()} assignments, omega has {om[s, e].item()}")
        if c4 is None:
            c4 = self.policy in C4_POLICIES
        if c4 and N > 0:
            dom = self.topology.domain_of.to(om.device)
            demand = domain_demand(om, self.topology)
            e = se.clamp(min=0)
            remote = occupied & (dom[:, None] != dom[self.main_rank[e]])
            allowed = self.expert_bytes < 2 * demand[dom[:, None].expand(R, N), e] * self.token_bytes
            bad = remote & ~allowed & ~fitted
            if bad.any():
                r, j = torch.nonzero(bad)[0].tolist()
                ee = se[r, j].item()
                raise ValueError(
                    f"C4 (cross-domain replica criterion) violated: expert {ee} replicated on rank {r} "
                    f"(domain {dom[r].item()}) outside its main's domain {dom[self.main_rank[ee]].item()}, "
                    f"but expert_bytes={self.expert_bytes} >= 2 * D={demand[dom[r], ee].item()} * "
                    f"token_bytes={self.token_bytes}"
                )
        return self

    def __repr__(self) -> str:
        L = self.rank_load.double()
        mean = L.mean().item()
        imb = L.max().item() / mean if mean > 0 else 1.0
        return (f"Plan(policy={self.policy!r}, R={self.num_ranks}, E={self.num_experts}, "
                f"num_slots={self.num_slots}, replicas={self.num_replicas}, imbalance={imb:.3f})")


_MAIN_RANK_CACHE: dict = {}


def default_main_rank(num_experts: int, num_ranks: int, device=None) -> torch.Tensor:
    """main_rank[e] = e // (E // R): megatron's placement of local experts. One cached tensor per
    (E, R, device), shared by every plan (no kernel launch per planner call): never modify it in place."""
    key = (num_experts, num_ranks, str(torch.device(device) if device is not None else "cpu"))
    t = _MAIN_RANK_CACHE.get(key)
    if t is None:
        t = torch.arange(num_experts, dtype=torch.int64, device=device) // (num_experts // num_ranks)
        if len(_MAIN_RANK_CACHE) < 64:
            _MAIN_RANK_CACHE[key] = t
    return t


def static_route(omega: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The static plan's route: every assignment on its expert's main instance, no slot used."""
    R, E = omega.shape
    route = torch.zeros(R, E + R * num_slots, dtype=torch.int64, device=omega.device)
    route[:, :E] = omega
    return route


def domain_demand(omega: torch.Tensor, topology: Topology) -> torch.Tensor:
    """D: int64[M, E], omega summed over the (contiguous) ranks of each domain (eq. 4)."""
    R, E = omega.shape
    return omega.view(topology.num_domains, topology.ranks_per_domain, E).sum(1)
