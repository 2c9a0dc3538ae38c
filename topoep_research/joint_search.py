"""The move search of the `joint` policy (`topoep_research.joint`): K plans under construction, the
rank graph of one step, the moves, the search loop and destroy-and-repair.

Costs are integer femtoseconds (fs) of the tree formula (see `joint`): for instance loads U[e, r],
T_token = a2 sum (omega - U)^+ + bb sum_d (D - U_d)^+, a replica of e on r costs rho[e, r].

Moves (`search`), one per plan per step, all evaluated data-parallel on a rank graph whose arc r1 -> r2
carries the cheapest expert hosted on both (marginal fs per assignment from the tree formula, and the
number of assignments until that marginal changes):
  relief   while a rank exceeds the plan's cap T: push its excess along the cheapest path of <= 2 arcs
           to a rank with room, or open a replica (on the source rank or one arc away) on a rank with
           room and fill it to the cap (MoonEP's fill-to-cap pairing); choose the lowest cost per
           relieved assignment (replica transfer amortised over it, in 1/UNIT fs), then the larger
           amount (plans with amount_first: the larger amount, then the cost);
  locality when every rank is <= T: open a replica for one value segment (its own rank's demand, or
           its domain's) and push the overflow back along <= 2 arcs (a cycle) or to a rank with room;
           open two replicas that swap load (loads unchanged); cancel a negative 2-cycle; send load
           along a negative path into room. Largest gain first.
A locality move that does not lower the cost (or a relief move that does not lower the overflow) is
undone and ends that plan's search. Replicas whose load drops to 0 free their slot.

Destroy and repair (`lns`, the exchange moves of LPT-style local search): from the best plan, variants
each empty one replica slot, a pair of slots, or every replica of one expert (their load returns to the
main), or open one of the best-valued replicas not placed (evicting the rank's lightest replica if it
is full); `search` repairs them at caps around the current L_max, and the best variant is kept while
it lowers the objective (stop after a round gaining < 0.1 %).

Memory: a step holds K x R x Q x R arc tensors and K x R^3 two-arc paths (K >= 4 plans, Q = main
experts + slots per rank): about 100 GB at EP 1024 with its temporaries, an eighth of that at EP 512.
An offline planner.

Mapping to a kernel (not built; for a CUDA port)
------------------------------------------------
Caps and LNS variants are independent: one thread block each (they differ only in T and a few slots).
Inside a block the state is U (E x R, int32 fits), rank loads, slot table and per-domain loads; a step
is (a) arc evaluation, data-parallel over (rank, hosted expert, target rank) with a block min-reduction
per arc (lowest index on ties), (b) a 2-arc min-plus over R^3 (R <= 128: R^2 threads x R), (c) a
block argmax over the candidate moves, (d) at most 3 hops applied by one thread. Steps are bounded; all
arithmetic is int64 (fs), ties by lowest index, no atomics whose order matters. For EP 128 the state per
block does not fit shared memory; the arc table (R x R) and rank loads do, U stays in global memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topoep.plan import domain_demand
from topoep.planners.common import static_rank_load, two_level_costs
from topoep.topology import FEMTO, Topology

BIG = 1 << 40  # "no arc": larger than any real per-assignment cost (< 2^35 fs)
UNIT = 1024  # fixed-point scale of per-assignment costs that include an amortised replica transfer
EXCLUDED = 1 << 62  # objective of a plan that must not be chosen (real objectives stay below it)


class Data:
    """Integer data of one instance, shared by every cap and variant.

    omt: int64[E, R] omega transposed; Dt: int64[E, M] domain demand; tot: int64[E]; rho: int64[E, R]
    replica transfer fs; c4ok: bool[E, R] a replica of e may go on r (C4, not the main); mains_tab:
    int64[R, max main experts] each rank's main experts, -1 padded; L0: int64[R] static rank loads;
    a2, bb, t: fs (see `joint`); work_left: the remaining work budget (elements, see `step_size`)."""

    def __init__(self, omega: torch.Tensor, topology: Topology, num_slots: int, main_rank: torch.Tensor,
                 expert_bytes: int, token_bytes: int, t_ffn: float, work_budget: int):
        R, E = omega.shape
        dev = omega.device
        self.R, self.E, self.N, self.M, self.dev = R, E, num_slots, topology.num_domains, dev
        a, b, self.exact = two_level_costs(topology)
        S, W = int(token_bytes), int(expert_bytes)
        self.a2, self.bb = 2 * S * a, 2 * S * (b - a)
        self.t = int(round(t_ffn * FEMTO))
        self.omt = omega.t().contiguous()  # [E, R]
        self.Dt = domain_demand(omega, topology).t().contiguous()  # [E, M]
        self.tot = omega.sum(0)  # [E]
        self.main = main_rank
        self.dom = topology.domain_of.to(dev)
        self.rho = W * topology.cost_fs.to(dev)[main_rank]  # [E, R]
        same = self.dom[main_rank][:, None] == self.dom[None, :]
        not_main = torch.arange(R, device=dev)[None, :] != main_rank[:, None]
        self.c4ok = (same | (W < 2 * S * self.Dt[:, self.dom])) & not_main  # C4, and never on the main
        cnt = torch.bincount(main_rank, minlength=R)
        order = torch.sort(main_rank, stable=True).indices  # rank-major, experts in index order
        pos = torch.arange(E, device=dev) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
        self.mains_tab = torch.full((R, int(cnt.max())), -1, dtype=torch.int64, device=dev)
        self.mains_tab[main_rank[order], pos] = order
        self.L0 = static_rank_load(omega, main_rank, R)
        self.work_left = work_budget

    def plan_size(self) -> int:
        """Tensor elements one plan adds to a search step: the arcs (R x Q x R), the two-arc paths (R^3)
        and the passes over the loads (E x R, fewer operations: weight 4)."""
        Q = self.mains_tab.shape[1] + self.N
        return self.R * self.R * (Q + self.R) + 4 * self.E * self.R

    def step_size(self, K: int) -> int:
        """Work of one search step on K plans (plus a fixed cost per step: the operations' overhead)."""
        return K * self.plan_size() + 100_000


class State:
    """K independent plans under construction (one per cap T[k]).

    U: int64[K, E, R] instance loads (0 where no instance); host: bool[K, E, R]; L: int64[K, R] rank
    loads; Ud: int64[K, E, M] per-domain loads; slot: int64[K, R, N] replica slots (occupied first,
    -1 = free); free: int64[K, R] free slots; amount_first: bool[K] the relief rule of the plan."""

    FIELDS = ("T", "U", "host", "L", "Ud", "free", "slot", "amount_first")

    def __init__(self, d: Data, T: torch.Tensor):
        K, R, E, N, M, dev = T.numel(), d.R, d.E, d.N, d.M, d.dev
        ar = torch.arange(E, device=dev)
        self.T = T
        self.U = torch.zeros(K, E, R, dtype=torch.int64, device=dev)
        self.U[:, ar, d.main] = d.tot
        self.host = torch.zeros(K, E, R, dtype=torch.bool, device=dev)
        self.host[:, ar, d.main] = True
        self.L = d.L0[None, :].repeat(K, 1)
        self.Ud = torch.zeros(K, E, M, dtype=torch.int64, device=dev)
        self.Ud[:, ar, d.dom[d.main]] = d.tot
        self.free = torch.full((K, R), N, dtype=torch.int64, device=dev)
        self.slot = torch.full((K, R, N), -1, dtype=torch.int64, device=dev)
        self.amount_first = torch.zeros(K, dtype=torch.bool, device=dev)

    @property
    def K(self) -> int:
        return self.T.numel()

    def select(self, idx: torch.Tensor) -> "State":
        """A new state holding plans idx (copies)."""
        out = object.__new__(State)
        for f in self.FIELDS:
            setattr(out, f, getattr(self, f)[idx].clone())
        return out

    def assign(self, idx: torch.Tensor, other: "State") -> None:
        for f in self.FIELDS:
            getattr(self, f)[idx] = getattr(other, f)

    def apply(self, d: Data, e, r1, r2, delta, new) -> None:
        """Plan k moves delta[k] assignments of expert e[k] from rank r1[k] to r2[k] (a new replica
        there if new[k]); delta 0 = no move."""
        k = torch.arange(self.K, device=d.dev)
        for t, idx in ((self.U, (k, e, r1)), (self.L, (k, r1)), (self.Ud, (k, e, d.dom[r1]))):
            t.index_put_(idx, -delta, accumulate=True)
        for t, idx in ((self.U, (k, e, r2)), (self.L, (k, r2)), (self.Ud, (k, e, d.dom[r2]))):
            t.index_put_(idx, delta, accumulate=True)
        new = new & (delta > 0) & ~self.host[k, e, r2]
        if bool(new.any()):
            kn, en, rn = k[new], e[new], r2[new]
            self.host[kn, en, rn] = True
            self.slot[kn, rn, (self.slot[kn, rn] >= 0).sum(1)] = en  # first free slot
            self.free[kn, rn] -= 1

    def release_empty(self, d: Data) -> None:
        """Replica slots whose load is 0 become free (occupied slots stay first, in their order)."""
        K, R, N = self.slot.shape
        kk = torch.arange(K, device=d.dev)[:, None, None]
        load = self.U[kk, self.slot.clamp(min=0), torch.arange(R, device=d.dev)[None, :, None]]
        empty = (self.slot >= 0) & (load == 0)
        if bool(empty.any()):
            ke, re, je = torch.nonzero(empty, as_tuple=True)
            self.host[ke, self.slot[ke, re, je], re] = False
            self.slot[ke, re, je] = -1
            order = torch.sort((self.slot < 0).long(), dim=2, stable=True).indices
            self.slot = self.slot.gather(2, order)
            self.free = (self.slot < 0).sum(2)

    def cost(self, d: Data) -> tuple[torch.Tensor, torch.Tensor]:
        """(T_token + T_replica, assignments above the cap), int64[K] each (fs, assignments)."""
        tok = d.a2 * (d.omt[None] - self.U).clamp(min=0).sum((1, 2)) + d.bb * (d.Dt[None] - self.Ud).clamp(min=0).sum((1, 2))
        rep = self.host & (self.U > 0)
        rep[:, torch.arange(d.E, device=d.dev), d.main] = False
        return tok + (rep * d.rho[None]).sum((1, 2)), (self.L - self.T[:, None]).clamp(min=0).sum(1)

    def objective(self, d: Data) -> torch.Tensor:
        """int64[K]: modelled time t L_max + T_token + T_replica in fs (exact on two-level topologies)."""
        return d.t * self.L.max(1).values + self.cost(d)[0]


def dominated(d: Data, st: State, ref: tuple[int, int]) -> torch.Tensor:
    """bool[K]: plan k has both a larger L_max and more inter-domain assignments than ref."""
    inter = (d.Dt[None] - st.Ud).clamp(min=0).sum((1, 2))
    return (st.L.max(1).values > ref[0]) & (inter > ref[1])


# ---------------------------------------------------------------------------------------------------
# The cost of moving delta assignments of one expert from rank r1 to rank r2 (tree formula).
# Us, Ut: loads of the expert on r1, r2; w1, w2: omega of r1, r2 for it; s_d1 = (U_d1 - D_d1)^+ (BIG
# inside one domain), g_d2 = (D_d2 - U_d2)^+ (0 inside one domain).

def move_cost(d, Us, Ut, w1, w2, s_d1, g_d2, cross, new_rho, delta):
    """fs of moving delta assignments (all arguments broadcast): token change + new replica."""
    s1, g2 = (Us - w1).clamp(min=0), (w2 - Ut).clamp(min=0)
    c = d.a2 * ((delta - s1).clamp(min=0) - torch.minimum(delta, g2))
    c = c + torch.where(cross, d.bb * ((delta - s_d1).clamp(min=0) - torch.minimum(delta, g_d2)), 0)
    return c + new_rho


def breakpoints(Us, Ut, w1, w2, s_d1, g_d2, dmax):
    """The amounts (<= dmax, >= 1) at which the marginal cost of a move changes; [..., 5]."""
    bp = torch.stack(torch.broadcast_tensors(dmax, (Us - w1).clamp(min=0), (w2 - Ut).clamp(min=0), s_d1, g_d2), -1)
    return torch.minimum(bp.clamp(min=1), dmax[..., None])


def _per_unit(total: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """floor(total * UNIT / amount) (amount >= 1) without forming total * UNIT, which could overflow."""
    q = torch.div(total, amount, rounding_mode="floor")
    return q * UNIT + torch.div(torch.remainder(total, amount) * UNIT, amount, rounding_mode="floor")


# ---------------------------------------------------------------------------------------------------
# The rank graph of one step.

def _arcs(d: Data, st: State):
    """Marginal fs per assignment of moving expert src[k, r1, q] from r1 to r2, for every hosted
    (r1, q) and every r2: src [K,R,Q], c [K,R,Q,R], cap [K,R,Q,R] (assignments until the marginal
    changes), ex (r2 hosts it) and op (a new replica on r2 is allowed) [K,R,Q,R], and the segment data
    (U1, w1, w2, s_d1, g_d2, cross) for multi-segment costs."""
    K, R = st.K, d.R
    rr = torch.arange(R, device=d.dev)
    src = torch.cat([d.mains_tab[None].expand(K, -1, -1), st.slot], 2)
    Q = src.shape[2]
    e_ = src.clamp(min=0)
    ef = e_.reshape(K, R * Q, 1)

    def rows(t):  # t[k, e_[k, r, q], :] -> [K, R, Q, t.shape[2]]
        return t.gather(1, ef.expand(-1, -1, t.shape[2])).view(K, R, Q, t.shape[2])

    def const(t):  # t[e_] for a per-expert table t [E, X]
        return t.index_select(0, e_.reshape(-1)).view(K, R, Q, t.shape[1])

    Ut = rows(st.U)  # [K,R,Q,R]
    U1 = Ut.gather(3, rr[None, :, None, None].expand(K, R, Q, 1))[..., 0]
    w2 = const(d.omt)
    w1 = w2.gather(3, rr[None, :, None, None].expand(K, R, Q, 1))[..., 0]
    Ude, De = rows(st.Ud), const(d.Dt)
    d1 = d.dom[None, :, None, None].expand(K, R, Q, 1)
    Ud1, D1 = Ude.gather(3, d1)[..., 0], De.gather(3, d1)[..., 0]
    Ud2, D2 = Ude[..., d.dom], De[..., d.dom]
    cross = (d.dom[:, None] != d.dom[None, :])[None, :, None, :]
    src_loc, dst_loc = (U1 <= w1)[..., None], Ut < w2  # the unit removed is local / the unit added is
    src_dom, dst_dom = (Ud1 <= D1)[..., None], Ud2 < D2
    c = d.a2 * (src_loc.long() - dst_loc.long()) + torch.where(cross, d.bb * (src_dom.long() - dst_dom.long()), 0)
    cap = torch.where(src_loc, U1[..., None], (U1 - w1)[..., None])
    cap = torch.minimum(cap, torch.where(dst_loc, w2 - Ut, BIG))
    cap = torch.minimum(cap, torch.where(cross & ~src_dom, (Ud1 - D1)[..., None], BIG))
    cap = torch.minimum(cap, torch.where(cross & dst_dom, D2 - Ud2, BIG))
    cap = torch.minimum(cap, U1[..., None])
    base = ((src >= 0) & (U1 > 0))[..., None] & (rr[None, :, None, None] != rr[None, None, None, :])
    host2 = rows(st.host)
    ex = base & host2
    op = base & ~host2 & (st.free[:, None, None, :] > 0) & const(d.c4ok)
    seg = (U1, w1, w2, torch.where(cross, (Ud1 - D1).clamp(min=0)[..., None], BIG),
           torch.where(cross, (D2 - Ud2).clamp(min=0), 0), cross)
    return src, c, cap, ex, op, seg


def _two_hop(C: torch.Tensor, Cap: torch.Tensor):
    """Cheapest path of at most two arcs: cost [K,R,R] (BIG if none), mid [K,R,R] (-1 = direct),
    capacity [K,R,R]."""
    K, R, _ = C.shape
    a, b = C[:, :, :, None], C[:, None, :, :]
    s = torch.where((a < BIG) & (b < BIG), a + b, BIG)  # [K, r1, m, r2]
    best2, mid = s.min(2)  # (first mid on ties)
    direct = C <= best2
    kk = torch.arange(K, device=C.device)[:, None, None]
    r1 = torch.arange(R, device=C.device)[None, :, None]
    r2 = torch.arange(R, device=C.device)[None, None, :]
    cap2 = torch.minimum(Cap[kk, r1, mid], Cap[kk, mid, r2])
    return torch.where(direct, C, best2), torch.where(direct, -1, mid), torch.where(direct, Cap, cap2)


@dataclass(eq=False)
class _Graph:
    """One step's rank graph of K plans: the arcs of `_arcs` (src [K,R,Q]; c, cap, ex, op [K,R,Q,R];
    seg), the cheapest arc of each rank pair (C, the slot of its expert Aq, its capacity Acap:
    [K,R,R]), the cheapest paths of <= 2 arcs (D2, mid, Cap2: [K,R,R]), the room under each plan's
    cap (room, roomp = room^+, roomy = room > 0: [K,R]) and the replica transfer rho [K,R,Q,R] of
    expert src[k, r1, q] to r2."""

    src: torch.Tensor
    c: torch.Tensor
    cap: torch.Tensor
    ex: torch.Tensor
    op: torch.Tensor
    seg: tuple
    C: torch.Tensor
    Aq: torch.Tensor
    Acap: torch.Tensor
    D2: torch.Tensor
    mid: torch.Tensor
    Cap2: torch.Tensor
    room: torch.Tensor
    roomp: torch.Tensor
    roomy: torch.Tensor
    rho: torch.Tensor

    @property
    def Q(self) -> int:
        return self.src.shape[2]

    def arc_expert(self, kk, r1, r2):
        """The expert carried by the arc r1 -> r2 of each plan."""
        return self.src[kk, r1, self.Aq[kk, r1, r2]]

    def path_hops(self, kk, mask, r1, r2, delta) -> list:
        """The (one or two) hops of the cheapest path r1 -> r2 of each plan, moving delta."""
        zero = torch.zeros_like(mask)
        m = self.mid[kk, r1, r2]
        a_to = torch.where(m < 0, r2, m.clamp(min=0))
        mm = m.clamp(min=0)
        return [(mask, self.arc_expert(kk, r1, a_to), r1, a_to, delta, zero),
                (mask & (m >= 0), self.arc_expert(kk, mm, r2), mm, r2, delta, zero)]


def _graph(d: Data, st: State) -> _Graph:
    K, R = st.K, d.R
    src, c, cap, ex, op, seg = _arcs(d, st)
    C, Aq = torch.where(ex, c, BIG).min(2)  # arc costs [K, r1, r2], cheapest expert (first q on ties)
    Acap = cap.gather(2, Aq[:, :, None, :])[:, :, 0, :]
    D2, mid, Cap2 = _two_hop(C, Acap)
    room = st.T[:, None] - st.L
    rho = d.rho.index_select(0, src.clamp(min=0).reshape(-1)).view(K, R, -1, R)  # [K, R, Q, R]
    return _Graph(src=src, c=c, cap=cap, ex=ex, op=op, seg=seg, C=C, Aq=Aq, Acap=Acap, D2=D2, mid=mid, Cap2=Cap2,
                  room=room, roomp=room.clamp(min=0), roomy=room > 0, rho=rho)


# ---------------------------------------------------------------------------------------------------
# The moves of one step.

@dataclass(eq=False)
class _Relief:
    """The relief move of each plan: over (the busiest rank rb exceeds T), idx into the candidates
    [R paths (a)] + [R x Q x R new replicas (b)], amount, ok (a move exists)."""

    over: torch.Tensor
    rb: torch.Tensor
    idx: torch.Tensor
    amount: torch.Tensor
    ok: torch.Tensor


def _relief(d: Data, st: State, g: _Graph, stuck: torch.Tensor) -> _Relief:
    """Relief of each plan's busiest rank rb; plans over their cap without a move become stuck."""
    K, R = st.K, d.R
    kk, rr = torch.arange(K, device=d.dev), torch.arange(R, device=d.dev)
    rb = torch.argmax(st.L, 1)
    X = st.L[kk, rb] - st.T
    over = (X > 0) & ~stuck
    # (a) along an existing path of <= 2 arcs to a rank with room
    dA = torch.minimum(torch.minimum(g.Cap2[kk, rb], g.roomp), X[:, None]).clamp(min=1)
    costA = torch.where((g.D2[kk, rb] < BIG) & g.roomy, g.D2[kk, rb] * UNIT, BIG * UNIT)
    # (b) open a replica on a rank with room, from rb or one arc away, filled to the cap
    allU, allD = costA, dA
    if bool(over.any()):
        own = rr[None, :] == rb[:, None]
        hop = torch.where(own, 0, g.C[kk, rb])
        hopcap = torch.where(own, BIG, g.Acap[kk, rb])
        U1, w1, w2, sd1, gd2, cross = g.seg
        dB = torch.minimum(torch.minimum(U1[..., None], hopcap[:, :, None, None]), g.roomp[:, None, None, :])
        dB = torch.minimum(dB, X[:, None, None, None]).clamp(min=1)
        totB = move_cost(d, U1[..., None], torch.zeros_like(dB), w1[..., None], w2, sd1, gd2, cross, g.rho, dB)
        unitB = hop[:, :, None, None] * UNIT + _per_unit(totB, dB)
        okB = g.op & (hop < BIG)[:, :, None, None] & g.roomy[:, None, None, :] & over[:, None, None, None]
        unitB = torch.where(okB, unitB, BIG * UNIT)
        allU = torch.cat([costA, unitB.view(K, -1)], 1)
        allD = torch.cat([dA, dB.view(K, -1)], 1)
    valid = allU < BIG * UNIT
    bu = allU.min(1).values
    idx = torch.argmax(torch.where(allU == bu[:, None], allD, -1), 1)  # then the larger amount
    # plans with amount_first relieve as much as possible per move (UltraEP-like), then cheapest
    bd = torch.where(valid, allD, -1).max(1).values
    idx2 = torch.argmin(torch.where(valid & (allD == bd[:, None]), allU, BIG * UNIT), 1)
    idx = torch.where(st.amount_first, idx2, idx)
    ok = over & (bu < BIG * UNIT)
    stuck |= over & ~ok
    return _Relief(over=over, rb=rb, idx=idx, amount=allD[kk, idx], ok=ok)


@dataclass(eq=False)
class _Locality:
    """The locality move of each plan: ok, jdx into the gains [R x Q x R new replicas] + [R x R
    2-cycles] + [R x R paths into room] + [R x R swaps], and what the hops need: the new replica's
    amount segL and overflow overL [K,R,Q,R], where overflow goes (to_room, tgt_room [K,R]), the
    amounts of the other families (capcyc, capP, dsw [K,R,R]) and the swaps' slots qo [K,R,R]."""

    ok: torch.Tensor
    jdx: torch.Tensor
    segL: torch.Tensor | None = None
    overL: torch.Tensor | None = None
    to_room: torch.Tensor | None = None
    tgt_room: torch.Tensor | None = None
    capcyc: torch.Tensor | None = None
    capP: torch.Tensor | None = None
    dsw: torch.Tensor | None = None
    qo: torch.Tensor | None = None


def _locality(d: Data, st: State, g: _Graph, over: torch.Tensor, done: torch.Tensor) -> _Locality:
    """Best locality move of each calm plan (no relief to do); calm plans without a gain become done."""
    K, R = st.K, d.R
    kk, rr = torch.arange(K, device=d.dev), torch.arange(R, device=d.dev)
    calm = ~over & ~done
    if not bool(calm.any()):
        return _Locality(ok=torch.zeros_like(calm), jdx=torch.zeros(K, dtype=torch.int64, device=d.dev))
    NEG = -BIG * UNIT
    # completion of an overflowing new replica on r2: back to r1 or on to the cheapest rank with room
    Dr = torch.where(g.roomy[:, None, :] & (g.D2 < BIG), g.D2, BIG)
    to_room = Dr.min(2).values  # [K, R]
    tgt_room = torch.argmin(Dr * R + rr[None, None, :], 2)
    room_cap = torch.minimum(g.Cap2.gather(2, tgt_room[:, :, None])[..., 0], g.roomp.gather(1, tgt_room))
    D2t = g.D2.transpose(1, 2)[:, :, None, :]  # [K, r1, 1, r2] = D2[r2, r1]
    back = D2t <= to_room[:, None, None, :]
    comp = torch.where(back, D2t, to_room[:, None, None, :])
    compcap = torch.where(back, g.Cap2.transpose(1, 2)[:, :, None, :], room_cap[:, None, None, :])
    r2room = g.roomp[:, None, None, :]
    segL = torch.minimum(g.cap, r2room + torch.where(comp < BIG, compcap, 0))
    overL = (segL - r2room).clamp(min=0)
    gainL = -(g.c * segL) - torch.where(overL > 0, comp * overL, 0) - g.rho
    gainL = torch.where(g.op & (g.c < 0) & ((overL == 0) | (comp < BIG)), gainL, NEG)
    # negative 2-cycle among existing instances
    Ct = g.C.transpose(1, 2)
    cyc = torch.where((g.C < BIG) & (Ct < BIG), g.C + Ct, BIG)
    capcyc = torch.minimum(g.Acap, g.Acap.transpose(1, 2))
    gainC = torch.where(cyc < 0, -cyc * capcyc, NEG)
    # negative path into room
    capP = torch.minimum(g.Cap2, g.roomp[:, None, :])
    gainP = torch.where((g.D2 < 0) & g.roomy[:, None, :], -g.D2 * capP, NEG)
    # two new replicas swapping load (r1 -> r2 and r2 -> r1), loads unchanged
    bo, qo = torch.where(g.op, g.c, BIG).min(2)
    capo = g.cap.gather(2, qo[:, :, None, :])[:, :, 0, :]
    rhoo = g.rho.gather(2, qo[:, :, None, :])[:, :, 0, :]
    dsw = torch.minimum(capo, capo.transpose(1, 2))
    okS = (bo < BIG) & (bo.transpose(1, 2) < BIG) & (rr[:, None] < rr[None, :])[None]
    gainS = torch.where(okS, -(bo + bo.transpose(1, 2)) * dsw - rhoo - rhoo.transpose(1, 2), NEG)
    gains = torch.cat([gainL.view(K, -1), gainC.view(K, -1), gainP.view(K, -1), gainS.view(K, -1)], 1)
    jdx = torch.argmax(gains, 1)
    ok = calm & (gains[kk, jdx] > 0)
    done |= calm & ~ok
    return _Locality(ok=ok, jdx=jdx, segL=segL, overL=overL, to_room=to_room, tgt_room=tgt_room, capcyc=capcyc,
                     capP=capP, dsw=dsw, qo=qo)


def _relief_hops(d: Data, g: _Graph, rel: _Relief) -> list:
    K, R, Q = g.src.shape[0], d.R, g.Q
    kk = torch.arange(K, device=d.dev)
    nA, nL = R, R * Q * R
    hops = []
    isA = rel.ok & (rel.idx < nA)
    if bool(isA.any()):
        hops += g.path_hops(kk, isA, rel.rb, rel.idx.clamp(max=nA - 1), rel.amount)
    isB = rel.ok & (rel.idx >= nA)
    if bool(isB.any()):
        j = (rel.idx - nA).clamp(0, nL - 1)
        r1, q, r2 = j // (Q * R), (j // R) % Q, j % R
        hops.append((isB & (r1 != rel.rb), g.arc_expert(kk, rel.rb, r1), rel.rb, r1, rel.amount, torch.zeros_like(isB)))
        hops.append((isB, g.src[kk, r1, q], r1, r2, rel.amount, isB))
    return hops


def _locality_hops(d: Data, g: _Graph, loc: _Locality) -> list:
    K, R, Q = g.src.shape[0], d.R, g.Q
    kk = torch.arange(K, device=d.dev)
    nL, nRR = R * Q * R, R * R
    hops = []
    isL = loc.ok & (loc.jdx < nL)
    if bool(isL.any()):  # a new replica, its overflow back to r1 or on into room
        j = loc.jdx.clamp(max=nL - 1)
        r1, q, r2 = j // (Q * R), (j // R) % Q, j % R
        ov = loc.overL[kk, r1, q, r2]
        hops.append((isL, g.src[kk, r1, q], r1, r2, loc.segL[kk, r1, q, r2], isL))
        tgt = torch.where(g.D2[kk, r2, r1] <= loc.to_room[kk, r2], r1, loc.tgt_room[kk, r2])
        hops += g.path_hops(kk, isL & (ov > 0), r2, tgt, ov)
    zero = torch.zeros_like(loc.ok)
    for n, (lo, amounts) in enumerate(((nL, loc.capcyc), (nL + nRR, loc.capP), (nL + 2 * nRR, loc.dsw))):
        sel = loc.ok & (loc.jdx >= lo) & (loc.jdx < lo + nRR)
        if not bool(sel.any()):
            continue
        j = (loc.jdx - lo).clamp(0, nRR - 1)
        r1, r2 = j // R, j % R
        amount = amounts[kk, r1, r2]
        if n == 0:  # 2-cycle
            hops += [(sel, g.arc_expert(kk, r1, r2), r1, r2, amount, zero),
                     (sel, g.arc_expert(kk, r2, r1), r2, r1, amount, zero)]
        elif n == 1:  # path into room
            hops += g.path_hops(kk, sel, r1, r2, amount)
        else:  # swap of two new replicas
            hops += [(sel, g.src[kk, r1, loc.qo[kk, r1, r2]], r1, r2, amount, sel),
                     (sel, g.src[kk, r2, loc.qo[kk, r2, r1]], r2, r1, amount, sel)]
    return hops


def _step(d: Data, st: State, stuck: torch.Tensor, done: torch.Tensor):
    """Choose one move per plan: (hops [(mask, e, r_from, r_to, delta, new)], moved, relief), all [K];
    updates the stuck (relief impossible) and done (no improving locality move) flags in place."""
    g = _graph(d, st)
    rel = _relief(d, st, g, stuck)
    loc = _locality(d, st, g, rel.over, done)
    hops = _relief_hops(d, g, rel)
    if bool(loc.ok.any()):
        hops += _locality_hops(d, g, loc)
    return hops, rel.ok | loc.ok, rel.ok


def search(d: Data, st: State, max_steps: int) -> int:
    """Apply `_step` moves until no plan has an improving move, max_steps, or the work budget is spent.
    Plans that are finished leave the working batch. Returns the number of steps."""
    dev = d.dev
    K = st.K
    stuck = torch.zeros(K, dtype=torch.bool, device=dev)
    done = torch.zeros(K, dtype=torch.bool, device=dev)
    active = torch.arange(K, device=dev)
    work = st
    steps = 0
    for steps in range(1, max_steps + 1):
        if d.work_left <= 0:
            break
        d.work_left -= d.step_size(work.K)
        s_stuck, s_done = stuck[active], done[active]
        hops, moved, relief = _step(d, work, s_stuck, s_done)
        if not bool(moved.any()):
            stuck[active], done[active] = s_stuck, s_done
            break
        before = work.select(torch.arange(work.K, device=dev))
        cost0, over0 = work.cost(d)
        kk = torch.arange(work.K, device=dev)
        for mask, e, ra, rb, dl, new in hops:
            e = e.clamp(min=0)
            dl = torch.minimum(torch.where(mask, dl, 0), work.U[kk, e, ra])
            work.apply(d, e, ra, rb, dl, new & mask)
        work.release_empty(d)
        cost1, over1 = work.cost(d)
        bad = moved & torch.where(relief, over1 >= over0, (cost1 >= cost0) | (over1 > over0))
        if bool(bad.any()):  # undo moves that did not pay; that plan's search ends
            b = torch.nonzero(bad).flatten()
            work.assign(b, before.select(b))
            s_stuck |= bad & relief
            s_done |= bad & ~relief
        stuck[active], done[active] = s_stuck, s_done
        live = ~(s_done & (s_stuck | (work.L.max(1).values <= work.T)))
        fin = ~live
        if bool(fin.any()):  # finished plans leave the batch
            st.assign(active[fin], work.select(torch.nonzero(fin).flatten()))
            keep = torch.nonzero(live).flatten()
            if keep.numel() == 0:
                return steps
            work, active = work.select(keep), active[keep]
    if work is not st:
        st.assign(active, work)
    return steps


# ---------------------------------------------------------------------------------------------------
# Destroy and repair.

def _evict(d: Data, st: State, mask: torch.Tensor) -> None:
    """Plan b empties the replica slots mask[b] (bool [R, N]); their load returns to the main."""
    K, R, N = mask.shape
    for j in range(N):
        for r in range(R):
            sel = mask[:, r, j] & (st.slot[:, r, j] >= 0)
            if not bool(sel.any()):
                continue
            e = st.slot[:, r, j].clamp(min=0)
            rr = torch.full((K,), r, dtype=torch.int64, device=d.dev)
            amount = torch.where(sel, st.U[torch.arange(K, device=d.dev), e, rr], 0)
            st.apply(d, e, rr, d.main[e], amount, torch.zeros_like(sel))
    st.release_empty(d)


def _force_open(d: Data, st: State, pairs: torch.Tensor) -> None:
    """Plan b opens a replica of expert pairs[b, 0] on rank pairs[b, 1] (evicting that rank's lightest
    replica when it has no free slot) holding that rank's demand for it, taken from the main."""
    B = st.K
    bb = torch.arange(B, device=d.dev)
    e, r = pairs[:, 0], pairs[:, 1]
    full = st.free[bb, r] == 0
    if bool(full.any()):
        load = torch.where(st.slot[bb, r] >= 0, st.U[bb[:, None], st.slot[bb, r].clamp(min=0), r[:, None]], BIG)
        j = torch.argmin(load, 1)
        mask = torch.zeros(B, d.R, d.N, dtype=torch.bool, device=d.dev)
        mask[bb[full], r[full], j[full]] = True
        _evict(d, st, mask)
    ok = ~st.host[bb, e, r] & (st.free[bb, r] > 0)
    m = d.main[e]
    amount = torch.where(ok, torch.minimum(st.U[bb, e, m], d.omt[e, r].clamp(min=1)), 0)
    st.apply(d, e, m, r, amount, ok)


def lns(d: Data, st: State, rounds: int, max_batch: int, max_steps: int, ref: tuple[int, int] | None = None,
        opens: torch.Tensor | None = None) -> State:
    """Destroy and repair on one plan (st.K == 1); see the module docstring. ref = (L_max, inter-domain
    assignments) of a plan that a variant must not be worse than in both; opens: int64[X, 2] (expert,
    rank) replicas to try opening, best first."""
    R, dev = d.R, d.dev
    best = int(st.objective(d)[0])
    lb = -(-int(d.tot.sum()) // R)
    for _ in range(rounds):
        idx = torch.nonzero(st.slot[0] >= 0)
        n = idx.shape[0]
        if n == 0 or d.work_left <= 0:
            break
        e = st.slot[0][idx[:, 0], idx[:, 1]]
        order = torch.sort(st.U[0, e, idx[:, 0]], stable=True).indices  # light ones first
        idx, e = idx[order], e[order]
        one = torch.zeros(n, R, d.N, dtype=torch.bool, device=dev)
        one[torch.arange(n, device=dev), idx[:, 0], idx[:, 1]] = True
        ia, ib = torch.triu_indices(n, n, 1, device=dev)
        masks = torch.cat([one, one[ia] | one[ib], st.slot[0][None] == torch.unique(e)[:, None, None]])
        Lmax = int(st.L[0].max())
        caps = sorted({max(lb, Lmax - (Lmax - lb) // f) for f in (1, 2, 4, 8)} | {Lmax})
        nf = 0
        if opens is not None:  # forced openings of the best candidates not placed
            fo = opens[~st.host[0, opens[:, 0], opens[:, 1]]]
            nf = min(fo.shape[0], max(1, max_batch // len(caps)) // 4)
            fo = fo[:nf]
        masks = masks[:max(1, max_batch // len(caps) - nf)]
        B = (masks.shape[0] + nf) * len(caps)
        var = st.select(torch.zeros(B, dtype=torch.int64, device=dev))
        var.T = torch.tensor(caps, dtype=torch.int64, device=dev).repeat(masks.shape[0] + nf)
        nm = masks.shape[0] * len(caps)
        ev = var.select(torch.arange(nm, device=dev))
        _evict(d, ev, masks.repeat_interleave(len(caps), 0))
        var.assign(torch.arange(nm, device=dev), ev)
        if nf:
            fv = var.select(torch.arange(nm, B, device=dev))
            _force_open(d, fv, fo.repeat_interleave(len(caps), 0))
            var.assign(torch.arange(nm, B, device=dev), fv)
        search(d, var, max_steps)
        J = var.objective(d)
        if ref is not None:
            J = torch.where(dominated(d, var, ref), EXCLUDED, J)
        k = int(torch.argmin(J))
        if int(J[k]) >= best:
            break
        small_gain = best - int(J[k]) < best // 1000  # < 0.1 %: one more round is not worth it
        best = int(J[k])
        st = var.select(torch.tensor([k], device=dev))
        if small_gain:
            break
    return st
