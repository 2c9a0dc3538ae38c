"""Net-benefit guard (paper eq. 2): execute the balanced plan only when it pays for itself.

Balancing saves expert compute on the straggler rank and may speed up or slow down the token transfers; it costs
planning and replica transfers. Per layer call the guard predicts, from the balanced plan and the routing counts
alone, with the per-link model of `topoep.links` (every transfer takes its busiest link's time: one rank's NVLink
port or NIC, in one direction, at the topology's per-byte cost),

    T_saved    = X(static) - X(balanced)           straggler expert and token transfer time saved (or lost)
    X(plan)    = x + m * t - h * min(x, m * t),    x = t_ffn * L_max(plan), t = T_dispatch(plan)
    T_plan     = plan_s                                                            planning estimate (a constant)
    T_transfer = n * (T_fetch(balanced) + transfer_latency_s)                      (0 without replicas)
                 (with relay_fanout: or n * (sum over the relay trees' steps of T_step / C + transfer_latency_s
                 per step; with relay_schedule "async" the longer of the fetch's busiest link and its longest chain
                 of hops, plus transfer_latency_s per level), whichever is smaller (with relay_share always the relayed fetch where the direct one
                 would make a home send more copies of one expert than a tree lets a rank send); the executed plan
                 says which runs; C = relay_chunks, the steps of `topoep.relay.relay_steps`)

with T_dispatch one dispatch's busiest-link time (the combine mirrors it; rows per assignment, or deduplicated as
DeepEP sends them with `token_top_k`), m = token_transfers the dispatches and combines of a call, h = token_overlap
the share of the smaller of x and m * t that the chunked pipeline runs beside the other (0: serial); with
`token_chunks` = n, X(plan) is instead the time paper 3.3's chunk pipeline of n chunks takes for x and the four token
transfers (`topoep.links.pipelined_layer_s`, the simulator's schedule), T_fetch one
replica fetch's busiest-link time (W = expert_bytes bytes from each replica's main rank) and n the replica
transfers the critical path waits for. With `bytes_per_s` every link
runs at that bandwidth instead of the topology's. The balanced plan is used iff T_saved > T_plan + T_transfer;
otherwise the call executes the static plan (no replicas: every assignment on its expert's main rank).

Link times are exact integers (femtoseconds at the topology's integer per-byte costs, `topoep.links.transfer_fs`,
`topoep.relay.relay_fetch_fs`; the token rows per assignment, the direct and the relayed fetch), turned into seconds
by one multiplication; the rest is a fixed sequence of float64 operations. So the GPU kernel
(`topoep.runtime.guard_cuda`, used for CUDA plans) decides bit for bit as this reference does. The deduplicated token
estimate (`token_top_k`) is float and runs here only.

Before planning (`worth_planning`), the guard bounds what any plan could save in expert compute: no plan brings
L_max below the mean rank load, and every plan that moves load has a replica, whose fetch costs at least one
expert's bytes on the cheapest link. When t_ffn * (L_max(static) - ceil(mean)) <= T_plan + n * (W * cheapest
per-byte cost + transfer_latency_s), planning is skipped and the call runs the static plan: balancing aims at
the straggler's compute, and routing this even cannot pay for a replica (uniform routing pays neither the planner
nor its statistics). Token-only gains are not pursued there: they exist (a replica in a domain saves that domain
the tokens it would send over the NICs) but no policy plans for them.

Backend cuda also skips the replica machinery of a call whose guard will fire (`skip_lag`, `SlotSkipHint`):
with the decision on the device, the host still launches the slot fetch, the slot GEMMs and the gradient
return, which then move nothing but cost their launches and barriers (a few % of a layer at 4096 tokens per
rank). The host cannot know this call's decision without a sync, so it uses the decision of the same layer
`skip_lag` calls earlier, made on the same all-gathered counts on every rank: every rank takes the same
branch. When it skips, this call's plan is forced static on the device (the model's math is unchanged), and
the guard's own decision on the balanced plan is recorded for the calls after.

A guarded topoep_plus layer with spread candidates (LayerConfig.plus_spread) gates the spread planner, which takes
far longer than the others (`SpreadGate`, LayerConfig.spread_gate): it runs on every call while the guard keeps a
spread plan that it predicts beats the other candidates' by more than the spread planner's own time (spread_plan_s),
else once every spread_probe calls; on the other calls it writes the static plan at once and the guard chooses among
the other candidates. The gate's state lives on the device and follows the all-gathered counts: every rank decides
alike.

No host synchronisation: the decisions are 0-d bool device tensors and the executed plan's tensors are
`torch.where(use_balanced, balanced, static)` (both plans have the same shapes), so the guard stays
CUDA-graph friendly (the GPU planner reads `worth_planning`'s flag on the device and writes the static plan
when it is False). The decisions are deterministic functions of omega (the same on every rank) and of
constants, never of measured times: every rank must execute the same plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from topoep.links import (_div, _later, chunk_pipeline, link_fs, loads_seconds, overlapped_forward_s, pipelined_layer_s,
                          replica_matrix, token_loads, token_matrix, transfer_fs)
from topoep.plan import Plan, static_route
from topoep.relay import (async_fetch_fs, check_chunks, check_schedule, direct_beyond_tree, max_level, relay_fetch_fs,
                          relay_levels, relay_sources)
from topoep.runtime import worth_triton
from topoep.runtime.guard_cuda import MAX_TOKEN_CHUNKS
from topoep.planners.capacity import region_loads
from topoep.planners.common import static_rank_load
from topoep.topology import FEMTO, MAX_COST_FS, Topology

SECONDS_PER_FS = 1e-15  # link femtoseconds to seconds: one multiplication, the same on every device (csrc/guard.cu)


@functools.lru_cache(maxsize=64)
def _flat_topology(num_domains: int, ranks_per_domain: int, cost: float) -> Topology:
    """A topology whose links all cost `cost` seconds per byte (one object per shape: its device copies are kept)."""
    return Topology(num_domains=num_domains, ranks_per_domain=ranks_per_domain, intra_cost=cost, inter_cost=cost)


# The token_overlap of a layer's own guard (`ExpertParallelMoE` with LayerConfig.guard): both backends run a call's
# dispatch, expert compute and combine one after another, so none of the smaller term hides behind the other. In the
# simulator, under the backend's serial execution (`sim.EXECUTIONS["cuda"]`), this guard's layers are never more than
# 1 % slower than with the default 0.8 and up to 8 % faster (results/link_sweep_cuda_serial_guard.md).
SERIAL_TOKEN_OVERLAP = 0.0


@dataclass(frozen=True, kw_only=True)
class NetBenefitGuard:
    """Constants of the guard's cost prediction (module docstring). Defaults model one H200/H800 node."""

    plan_s: float = 1e-4
    """T_plan, seconds: the planner's latency. 100 us: the CUDA planner measured on an H200 at EP 8-128,
    E 64-640 took 43-61 us for a whole eager call and 28-47 us on the GPU (results/planner_latency.md)."""
    transfer_latency_s: float = 2e-5
    """Seconds added per exposed replica transfer when the plan has a replica: a collective's launch and
    synchronisation (about 20 us for a small NCCL all-to-all inside a node)."""
    bytes_per_s: float | None = None
    """Replica-transfer bandwidth of one rank (bytes/s). None: the topology's per-byte costs, the
    planner's own model (eq. 7; by default NVLink 200 GB/s and RDMA 50 GB/s per direction)."""
    exposed_transfers: int | None = None
    """Replica transfers per layer call (forward + backward) that the critical path waits for. None:
    the backend's `exposed_replica_transfers` (backend torch: 3, the forward fetch, the backward reload
    and the gradient return are blocking collectives; the paper's pipeline (3.3) exposes only the
    forward fetch: 1)."""

    token_transfers: int = 4
    """Token transfers per layer call, each at its busiest link: forward and backward each dispatch and combine
    (4). 0: the guard prices expert compute and replicas only."""

    token_overlap: float = 0.8
    """Share of the smaller of the straggler's expert time and the token transfers' time that runs beside the
    other (module docstring: the chunked pipeline overlaps them; 0 for a serial layer). 0.8 fits the simulator's
    pipelined execution (2 chunks): on four cells of bench/link_sweep.py (static and balanced plans, compute- and
    transfer-bound) it predicts the simulated compute + exposed token time within 4 %. A layer's own guard takes
    SERIAL_TOKEN_OVERLAP instead: its backends do not overlap them."""

    token_chunks: int | None = None
    """How the token transfers and the straggler's expert compute add up: None, X = x + m t - h min(x, m t)
    (token_transfers, token_overlap); an integer n >= 1, as paper 3.3's two-stream chunk pipeline runs them
    (`topoep.links.pipelined_layer_s`: forward and backward each dispatch, compute and combine n chunks of t / n, the
    weight gradients after the last), the schedule the simulator's pipelined execution times, so the guard ranks
    plans as the simulator does (token_transfers must then be 4, or 0 to price no tokens; token_overlap is unused).
    Set it to the layer's chunks where the layer runs that pipeline."""

    token_top_k: int | None = None
    """How the token transfers are priced: None, one row per assignment rank to rank (the runtime's transports);
    the router's top-k, deduplicated per destination rank and domain as DeepEP sends them (`topoep.links.token_loads`,
    an estimate from the route; the simulator's default execution)."""

    relay_fanout: int | None = None
    """Replica fetches may run down relay trees of this fanout (`LayerConfig.relay_fanout`; the layer sets it): per
    plan the guard prices the relayed fetch (the sum of its steps, each at its busiest link, plus transfer_latency_s
    per step that carries a copy: `topoep.relay.relay_fetch_fs`) and the direct one, keeps the faster (or, with
    relay_share, the relayed one wherever the direct one exceeds a tree's share) and says which in the executed
    plan's info["relay"] (`fetch_choice`). None: every copy from its home, one transfer."""

    relay_chunks: int = 1
    """The chunks a relayed copy travels in (`LayerConfig.relay_chunks`; the layer sets it): the relay trees' levels
    run as a pipeline of levels + relay_chunks - 1 steps (`topoep.relay.relay_steps`). 1: level after level."""

    relay_schedule: str = "levels"
    """How a relayed fetch runs (`LayerConfig.relay_schedule`; the layer sets it, `topoep.relay.RELAY_SCHEDULES`):
    "levels", priced as its steps one after the other (`topoep.relay.relay_fetch_fs`); "async", copy by copy, priced
    as the longer of its busiest link over the whole fetch and its longest chain of hops, plus transfer_latency_s per
    level that carries a copy (`topoep.relay.async_fetch_fs`; relay_chunks must be 1). The CUDA kernel prices both
    (`guard_cuda`)."""

    relay_share: bool = False
    """With relay_fanout: relay a plan's fetch wherever the direct one would make a home send more copies of one
    expert than a relay tree lets a rank send (more than relay_fanout into its own domain, more than one into
    another: `topoep.relay.direct_beyond_tree`), even where the model predicts the direct one faster; so no sender
    carries more than a tree's share (`LayerConfig.relay_share`). False: the faster by the model."""

    fetch_overlap: bool = False
    """The forward replica fetch runs beside the dispatch and the main experts' GEMMs (`LayerConfig.fetch_overlap`,
    the simulator's `Execution.fetch_overlap`; the layer sets it): the first of the n exposed transfers is priced at
    what the forward waits for it, `topoep.links.overlapped_forward_s` (its bytes on the links it shares with the
    dispatch, the slot rows waiting for it) less the same forward without it (`topoep.links.chunk_pipeline`), in
    token_chunks chunks (1 without); the others at their whole time. False: every one at its whole time."""

    spread_plan_s: float | None = None
    """The gated planners' time (seconds) that the spread gate (`SpreadGate`, LayerConfig.spread_gate) asks a gated
    plan (a spread or a peer candidate) to save beyond the plan kept without them. None: as measured on one H200 at
    the layer's EP size (`gated_s`: the CUDA spread planner's latency, `topoep.planners.spread.measured_latency_s`,
    with relay trees the relayed layer's four plans; the peers' four plans, `topoep.planners.baselines.peer_set_s`;
    the longer of the two where both run)."""

    skip_lag: int | None = 2
    """Backend cuda: leave out the replica machinery of a call when the guard did not want replicas in the
    call of the same layer `skip_lag` calls earlier (module docstring; `SlotSkipHint`). None: never."""

    def __post_init__(self):
        for name in ("plan_s", "transfer_latency_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")):
                raise ValueError(f"NetBenefitGuard.{name} must be a finite number of seconds >= 0, got {v!r}")
        v = self.spread_plan_s
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")):
            raise ValueError(f"NetBenefitGuard.spread_plan_s must be None (the measured spread planner) or a finite "
                             f"number of seconds >= 0, got {v!r}")
        b = self.bytes_per_s
        if b is not None and not (isinstance(b, (int, float)) and not isinstance(b, bool)
                                  and FEMTO / MAX_COST_FS < b < float("inf")):
            raise ValueError(f"NetBenefitGuard.bytes_per_s must be a number of bytes/s above {FEMTO / MAX_COST_FS:.2g} "
                             f"(the slowest link the integer costs hold) or None (the topology's costs), got {b!r}")
        m = self.token_transfers
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"NetBenefitGuard.token_transfers must be an integer >= 0, got {m!r}")
        h = self.token_overlap
        if not (isinstance(h, (int, float)) and not isinstance(h, bool) and 0 <= h <= 1):
            raise ValueError(f"NetBenefitGuard.token_overlap must be a number in [0, 1], got {h!r}")
        c = self.token_chunks
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= MAX_TOKEN_CHUNKS):
            raise ValueError(f"NetBenefitGuard.token_chunks must be None (the token_overlap formula) or the pipeline's "
                             f"chunks, an integer in [1, {MAX_TOKEN_CHUNKS}], got {c!r}")
        if c is not None and m not in (0, 4):
            raise ValueError(f"NetBenefitGuard.token_chunks={c} prices the four token transfers of the chunk pipeline "
                             f"(forward and backward dispatch and combine): token_transfers must be 4 (or 0: no "
                             f"tokens), got {m}")
        k = self.token_top_k
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"NetBenefitGuard.token_top_k must be None (a row per assignment) or the router's top-k "
                             f"(an integer >= 1), got {k!r}")
        n = self.exposed_transfers
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"NetBenefitGuard.exposed_transfers must be an integer >= 0 or None (the backend's), "
                             f"got {n!r}")

        f = self.relay_fanout
        if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 1):
            raise ValueError(f"NetBenefitGuard.relay_fanout must be None (every copy from its home) or an integer "
                             f">= 1, got {f!r}")
        check_chunks(self.relay_chunks, "NetBenefitGuard.relay_chunks")
        check_schedule(self.relay_schedule, self.relay_chunks, "NetBenefitGuard.relay_schedule")
        if not isinstance(self.fetch_overlap, bool):
            raise ValueError(f"NetBenefitGuard.fetch_overlap must be true or false, got {self.fetch_overlap!r}")
        if not isinstance(self.relay_share, bool):
            raise ValueError(f"NetBenefitGuard.relay_share must be true or false, got {self.relay_share!r}")
        lag = self.skip_lag
        if lag is not None and (not isinstance(lag, int) or isinstance(lag, bool) or lag < 1):
            raise ValueError(f"NetBenefitGuard.skip_lag must be an integer >= 1 (calls) or None (never skip the "
                             f"replica machinery), got {lag!r}")

    def pricing_relays(self, fanout: int, chunks: int, share: bool, schedule: str = "levels") -> "NetBenefitGuard":
        """This guard for a layer whose fetches run down relay trees of `fanout` in `chunks` chunks on `schedule`: it
        prices what runs (the chunks and the schedule always; the fanout unless it has its own) and bounds the
        senders if it or the layer asks."""
        return replace(self, relay_fanout=self.relay_fanout or fanout, relay_chunks=chunks,
                       relay_share=self.relay_share or share, relay_schedule=schedule)

    @staticmethod
    def build(guard) -> "NetBenefitGuard | None":
        """The layer's `guard` argument: True (default constants), False/None (off) or a NetBenefitGuard."""
        if isinstance(guard, NetBenefitGuard):
            return guard
        if guard is True:
            return NetBenefitGuard()
        if guard is False or guard is None:
            return None
        raise ValueError(f"guard must be True, False or a topoep.runtime.NetBenefitGuard, got {guard!r}")

    def _cost_topology(self, topology):
        """The topology whose per-byte costs the guard prices links at: the plan's, or every link at bytes_per_s."""
        if self.bytes_per_s is None:
            return topology
        return _flat_topology(topology.num_domains, topology.ranks_per_domain, 1.0 / self.bytes_per_s)

    def transfer_time(self, plan: Plan, exposed_transfers: int) -> torch.Tensor:
        """float64 0-d: T_transfer of `plan` (seconds) on the plan's device: n fetches at the busiest link (with
        relay_fanout: n fetches each relayed level by level or direct, whichever is faster: `fetch_choice`)."""
        return self.fetch_choice(plan, exposed_transfers)[0]

    def fetch_choice(self, plan: Plan, exposed_transfers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T_transfer float64 0-d, relay bool 0-d): with relay_fanout the faster of the relayed fetch (its steps
        one after the other, a latency each) and the direct one (one transfer, one latency), with relay_share the
        relayed one wherever the direct one exceeds a tree's share (`topoep.relay.direct_beyond_tree`), and whether it
        is the relayed one; without, the direct fetch and False."""
        t, relay = self._fetch_choices((plan,), exposed_transfers)
        return t[0], relay[0]

    def dispatch_time(self, plan: Plan) -> torch.Tensor:
        """float64 0-d: seconds of one dispatch of `plan` at its busiest link (the combine mirrors it)."""
        topo = self._cost_topology(plan.topology)
        if self.token_top_k is None:
            return transfer_fs(token_matrix(plan), plan.token_bytes, topo).double() * SECONDS_PER_FS
        return loads_seconds(token_loads(plan, self.token_top_k), topo)

    def static_dispatch_time(self, plan: Plan) -> torch.Tensor:
        """float64 0-d: `dispatch_time` of the static plan of `plan`'s routing (every assignment on its main rank)."""
        static = Plan(omega=plan.omega, topology=plan.topology, num_slots=plan.num_slots, main_rank=plan.main_rank,
                      slot_expert=torch.full_like(plan.slot_expert, -1), route=static_route(plan.omega, plan.num_slots),
                      policy="static", expert_bytes=plan.expert_bytes, token_bytes=plan.token_bytes)
        return self.dispatch_time(static)

    def predict(self, plan: Plan, t_ffn: float, exposed_transfers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T_saved, T_plan + T_transfer): float64 0-d tensors, the module docstring's prediction for `plan`."""
        saved, cost, _ = self._predict((plan,), t_ffn, exposed_transfers)
        return saved[0], cost[0]

    def _layer(self, x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """X = straggler compute x + token transfers (m dispatch-like transfers of t each), the overlapped part
        counted once (with token_chunks: as the chunk pipeline runs them); x alone without token_transfers."""
        if not self.token_transfers:
            return x
        if self.token_chunks is not None:
            return pipelined_layer_s(x, t, self.token_chunks)
        m, h = self.token_transfers, self.token_overlap
        return x + m * t - h * torch.minimum(x, m * t)

    def _predict(self, plans: tuple[Plan, ...], t_ffn: float, exposed_transfers: int):
        """(T_saved float64[P], T_plan + T_transfer float64[P], relay bool[P]) of plans of one routing and one shape,
        batched (a few kernels for all of them: the guard runs in every layer call's metadata). X(static) is computed
        once; the dispatch times of the static plan and of every plan in one `transfer_fs`."""
        plan = plans[0]
        R, dev = plan.num_ranks, plan.route.device
        topo = self._cost_topology(plan.topology)
        inst_rank = plan.instance_rank  # the same for every plan of these shapes
        routes = torch.stack([p.route for p in plans])  # [P, R, instances]
        loads = torch.zeros(len(plans), R, dtype=routes.dtype, device=dev).index_add_(1, inst_rank, routes.sum(1))
        x = t_ffn * loads.amax(1).to(torch.float64)
        x_static = t_ffn * static_rank_load(plan.omega, plan.main_rank, R).max().to(torch.float64)
        t = t_static = None
        if self.token_transfers:
            if self.token_top_k is None:  # rows per assignment: the static flows and every plan's in one go
                static_rows = torch.zeros(R, R, dtype=plan.omega.dtype, device=dev).index_add_(
                    1, plan.main_rank.to(dev), plan.omega)
                rows = torch.cat([static_rows[None], torch.zeros(len(plans), R, R, dtype=routes.dtype,
                                                                 device=dev).index_add_(2, inst_rank, routes)])
                times = transfer_fs(rows, plan.token_bytes, topo).double() * SECONDS_PER_FS
                t_static, t = times[0], times[1:]
            else:
                t_static = self.static_dispatch_time(plan)
                t = torch.stack([self.dispatch_time(p) for p in plans])
        saved = self._layer(x_static, t_static) - self._layer(x, t)
        t_fetch, relay, occupied = self._fetch_times(plans)
        if self.fetch_overlap and exposed_transfers:
            transfer = self._overlapped(plans, x, t, t_fetch, relay, occupied, t_ffn, exposed_transfers)
        else:
            transfer = exposed_transfers * t_fetch * occupied
        return saved, self.plan_s + transfer, relay

    def _overlapped(self, plans: tuple[Plan, ...], x: torch.Tensor, t: torch.Tensor | None,
                    t_fetch: torch.Tensor, relay: torch.Tensor, occupied: torch.Tensor, t_ffn: float,
                    n: int) -> torch.Tensor:
        """T_transfer of every plan with fetch_overlap, float64[P]: (n - 1) T_fetch plus the forward's wait for the
        fetch (the class docstring), 0 without a replica. Link times in the guard's own units: integer femtoseconds
        with rows per assignment, seconds per link with the deduplicated estimate."""
        topo = self._cost_topology(plans[0].topology).on(plans[0].route.device)
        chunks = self.token_chunks or 1
        out = []
        for i, p in enumerate(plans):
            main, slot = region_loads(p).double().unbind(1)  # each rank's rows on main experts and on slots
            copies = replica_matrix(p)
            if self.relay_fanout is not None:  # the fetch that runs: the trees' copies of every level, or direct
                trees = relay_levels(p, *relay_sources(p, self.relay_fanout),
                                     max_level(p.topology, self.relay_fanout)).sum(0)
                copies = torch.where(relay[i], trees, copies)
            tok, rep = self._token_links(p), link_fs(copies, p.expert_bytes, topo)
            if self.token_top_k is None:  # exact integers, one multiplication (transfer_fs's arithmetic)
                alone = tok.amax()
                delay = ((tok + rep * (tok > 0)).amax() - alone).double() * SECONDS_PER_FS
            else:
                rep_s = rep.double() * SECONDS_PER_FS
                delay = (tok + rep_s * (tok > 0)).amax() - tok.amax()
            t_disp = t[i] if t is not None else torch.zeros((), dtype=torch.float64, device=main.device)
            t_chunk = _div(t_disp, float(chunks))
            compute = _div(_div(x[i], 3.0), float(chunks))
            alone_fwd = _later(*chunk_pipeline([t_chunk] * chunks, [compute] * chunks, [t_chunk] * chunks))
            with_fetch = overlapped_forward_s(main, slot, t_ffn, t_chunk, delay, t_fetch[i], chunks)
            wait = (with_fetch - alone_fwd).clamp(min=0.0)
            out.append(((n - 1) * t_fetch[i] + wait) * occupied[i])
        return torch.stack(out)

    def _token_links(self, plan: Plan) -> torch.Tensor:
        """One dispatch of `plan` on every link (int64[4, R] femtoseconds with rows per assignment; float64[4, R]
        seconds with token_top_k): the loads `dispatch_time` takes the busiest of."""
        topo = self._cost_topology(plan.topology).on(plan.route.device)
        if self.token_top_k is None:
            return link_fs(token_matrix(plan), plan.token_bytes, topo)
        loads = token_loads(plan, self.token_top_k)
        intra, inter = float(topo.intra_cost), float(topo.inter_cost)
        return torch.stack([loads.nvl_out * intra, loads.nvl_in * intra, loads.nic_out * inter, loads.nic_in * inter])

    def _fetch_choices(self, plans: tuple[Plan, ...], exposed_transfers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`fetch_choice` of every plan: (float64[P], bool[P]), every fetch at its whole time."""
        t, relay, occupied = self._fetch_times(plans)
        return exposed_transfers * t * occupied, relay

    def _fetch_times(self, plans: tuple[Plan, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T_fetch float64[P] latency included, relay bool[P], whether the plan has a replica float64[P] 0 or 1): one
        fetch of every plan, relayed or direct as `fetch_choice` chooses; the direct fetches in one `transfer_fs`."""
        plan = plans[0]
        topo = self._cost_topology(plan.topology)
        copies = torch.stack([replica_matrix(p) for p in plans])
        t = transfer_fs(copies, plan.expert_bytes, topo).double() * SECONDS_PER_FS + self.transfer_latency_s
        relay = torch.zeros(len(plans), dtype=torch.bool, device=t.device)
        if self.relay_fanout is not None:
            relayed = []
            for p in plans:
                fs, steps = (async_fetch_fs(p, self.relay_fanout, topo) if self.relay_schedule == "async" else
                             relay_fetch_fs(p, self.relay_fanout, topo, self.relay_chunks))
                relayed.append(fs.double() * SECONDS_PER_FS + steps.double() * self.transfer_latency_s)
            relayed = torch.stack(relayed)
            relay = relayed < t
            if self.relay_share:
                relay = relay | torch.stack([direct_beyond_tree(p, self.relay_fanout) for p in plans])
            t = torch.where(relay, relayed, t)
        occupied = torch.stack([(p.slot_expert >= 0).any() for p in plans]).to(torch.float64)
        return t, relay, occupied

    def worth_planning(self, omega: torch.Tensor, topology, main_rank: torch.Tensor, t_ffn: float, expert_bytes: int,
                       exposed_transfers: int) -> torch.Tensor:
        """bool 0-d on omega's device: False when no plan can save more expert compute than planning and one
        replica fetch cost (module docstring); the call then runs the static plan without planning."""
        R = topology.num_ranks
        if R < 2:
            return torch.zeros((), dtype=torch.bool, device=omega.device)
        # host constants, in the guard's own arithmetic (`_fetch_choices`: integer femtoseconds, one multiplication),
        # so that no plan's replica fetch is priced below the cheapest one assumed here
        cost_fs = self._cost_topology(topology).cost_fs
        cheapest = int(cost_fs.masked_fill(torch.eye(R, dtype=torch.bool), torch.iinfo(torch.int64).max).min())
        fetch = float(expert_bytes * cheapest) * SECONDS_PER_FS + self.transfer_latency_s
        threshold = self.plan_s + exposed_transfers * fetch
        if omega.is_cuda and worth_triton.usable(omega, main_rank):  # one kernel, the same decision
            return worth_triton.worth_planning_triton(omega, t_ffn, threshold)
        load = static_rank_load(omega, main_rank.to(omega.device), R)
        mean_ceil = torch.div(load.sum() + R - 1, R, rounding_mode="floor")
        bound = t_ffn * (load.max() - mean_ceil).to(torch.float64)
        return bound > threshold

    def spread_s(self, num_ranks: int, trees: bool) -> float:
        """The spread planner's time that the spread gate (`SpreadGate`) asks a spread plan to save: spread_plan_s, or
        the measured one at num_ranks (with `trees`: a relayed layer's four plans)."""
        if self.spread_plan_s is not None:
            return float(self.spread_plan_s)
        from topoep.planners.spread import measured_latency_s

        return measured_latency_s(num_ranks, trees)

    def gated_s(self, num_ranks: int, num_slots: int, spread: bool, trees: bool, peers: bool) -> float:
        """The gated planners' time that the spread gate asks their plans to save: spread_plan_s, or the longer of the
        measured spread planner's (`spread_s`, with `spread`) and the peers' four plans at once (with `peers`:
        `topoep.planners.baselines.peer_set_s`) at num_ranks and num_slots."""
        if self.spread_plan_s is not None:
            return float(self.spread_plan_s)
        from topoep.planners.baselines import peer_set_s

        return max(self.spread_s(num_ranks, trees) if spread else 0.0, peer_set_s(num_ranks, num_slots) if peers else 0.0)

    def select(self, plan: Plan, t_ffn: float, exposed_transfers: int, allow: torch.Tensor | None = None,
               candidates: tuple[Plan, ...] = (), backend: str = "auto", planned: torch.Tensor | None = None):
        """(executed plan, fired bool 0-d, T_saved float64 0-d, T_plan + T_transfer float64 0-d).

        `plan` is the balanced plan; `candidates`: other balanced plans of the same routing and shapes (topoep_plus's
        local plan, `topoep.planners.plus`). Of `plan` and the candidates the one with the largest T_saved - T_plan
        - T_transfer is kept (ties: the earliest), and the executed plan's info["guard_choice"] holds its index
        (int64 0-d: 0 for `plan`). `fired` is True when the static plan is executed instead. `allow` (bool 0-d,
        optional): False forces the static plan (the host left out the replica machinery, or `worth_planning`
        skipped the planner); `T_saved > T_plan + T_transfer` of the kept plan is the guard's own decision either
        way. With relay_fanout, info["relay"] (bool 0-d) says whether the kept plan's fetch runs relayed
        (`fetch_choice`; `topoep.relay.executed_sources` reads it), and on the kernel info["relay_trees"] holds the
        executed plan's trees (int64[2, R, N], `executed_sources` of it, from the same launches). `planned` (bool 0-d, optional): False when the
        planners left this call out (`worth_planning`): nothing is priced, the static plan runs, choice is 0, relay
        False and T_saved = T_plan + T_transfer = 0 (the kernel returns at once; the reference masks its results).

        backend: "reference" (torch, any device), "cuda" (csrc/guard.cu, `topoep.runtime.guard_cuda`: the same
        results bit for bit, two launches) or "auto": the kernel where it applies (CUDA plans, token
        rows per assignment: `guard_cuda.usable`)."""
        plans = (plan, *candidates)
        for i, other in enumerate(candidates, start=1):
            if other.route.shape != plan.route.shape or other.slot_expert.shape != plan.slot_expert.shape:
                raise ValueError(f"guard candidates must have the plan's shapes: slot_expert "
                                 f"{list(plan.slot_expert.shape)}, route {list(plan.route.shape)}; candidate {i} has "
                                 f"{list(other.slot_expert.shape)}, {list(other.route.shape)}")
        if backend not in ("auto", "reference", "cuda"):
            raise ValueError(f"backend must be 'auto', 'reference' or 'cuda', got {backend!r}")
        from topoep.runtime import guard_cuda

        kernel = backend != "reference" and guard_cuda.usable(self, plans)
        if backend == "cuda" and not kernel:
            raise ValueError(f"the guard's CUDA kernel needs CUDA plans, token_top_k=None, at most "
                             f"{guard_cuda.MAX_PLANS} plans and {guard_cuda.MAX_LEVELS} relay levels of at most "
                             f"{guard_cuda.MAX_CHUNKS} chunks; use "
                             "backend='reference'")
        if kernel:
            slot_expert, route, choice, fired, relay, saved, cost, trees = guard_cuda.select(
                self, plans, t_ffn, exposed_transfers, allow, planned)
            executed = self._executed(plan, slot_expert, route, choice, relay)
            if trees is not None:  # its relay trees, from the same launches (relay.executed_sources of it)
                executed.info["relay_trees"] = trees
            return executed, fired, saved, cost
        saved, cost, relay = self._predict(plans, t_ffn, exposed_transfers)
        if candidates:  # the largest net saving; argmax returns the first of equal ones (ties: the earliest)
            choice = torch.argmax(saved - cost)
            at = choice.view(1)  # index_select: a device index, never read on the host

            def pick(t):
                return t.index_select(0, at)[0]

            slot_expert = pick(torch.stack([p.slot_expert for p in plans]))
            route = pick(torch.stack([p.route for p in plans]))
            saved, cost, relay = pick(saved), pick(cost), pick(relay)
        else:
            choice = torch.zeros((), dtype=torch.int64, device=saved.device)
            slot_expert, route, saved, cost, relay = plan.slot_expert, plan.route, saved[0], cost[0], relay[0]
        if planned is not None:  # nothing was planned: the kernel prices nothing (zeros, choice 0, direct fetch)
            saved, cost = (torch.where(planned, v, torch.zeros_like(v)) for v in (saved, cost))
            choice, relay = torch.where(planned, choice, torch.zeros_like(choice)), relay & planned
        use = saved > cost
        if allow is not None:
            use = use & allow
        executed = self._executed(plan, torch.where(use, slot_expert, torch.full_like(slot_expert, -1)),
                                  torch.where(use, route, static_route(plan.omega, plan.num_slots)), choice, relay)
        return executed, ~use, saved, cost

    def _executed(self, plan: Plan, slot_expert: torch.Tensor, route: torch.Tensor, choice: torch.Tensor,
                  relay: torch.Tensor) -> Plan:
        """The executed plan of `select`: these tables, `plan`'s routing and shapes, the guard's choices in info."""
        return Plan(omega=plan.omega, topology=plan.topology, num_slots=plan.num_slots, main_rank=plan.main_rank,
                    slot_expert=slot_expert, route=route, policy=plan.policy, expert_bytes=plan.expert_bytes,
                    token_bytes=plan.token_bytes,
                    info={**plan.info, "guard_choice": choice,
                          **({"relay": relay} if self.relay_fanout is not None else {})})


class SpreadGate:
    """One layer's spread gate (LayerConfig.spread_gate): run the spread planner where it pays for itself.

    The spread planner (`topoep.planners.spread`, csrc/spread.cu) takes far longer than topoep_plus's, and on many
    routings the guard keeps topoep_plus's or its local plan anyway. The gate keeps, on the device, whether the spread
    planner is `on`, the net saving (T_saved - T_plan - T_transfer; 0 where the guard fired) of the plan the guard
    kept in the last call with the spread planner (`net_spread`) and in the last call without it (`net_other`), and
    the calls since the last probe. A call runs the spread planner (`enable`, the planner's enable flag) while it is
    on, except on a probe; while it is off, only on a probe; a probe is every `probe`-th planned call. So each state
    measures the other every `probe` calls. After a call (`record`, from the call's own guard pricing): a call with
    the spread planner turns it on iff the guard kept a spread plan whose net saving beats net_other by more than
    the spread planner's time (`spread_s`: NetBenefitGuard.spread_s); a call without it, while on, keeps it on iff
    net_spread still beats this call's net saving by that much. A routing that turns warm is thus found within `probe`
    calls, and one that cools within `probe` calls too. Calls the pre-plan bound leaves out change nothing. Every
    number follows the all-gathered counts, so every rank decides alike; no host synchronisation, and the state is
    updated in place, so a CUDA graph of the call carries it from replay to replay. The first call runs without the
    spread planner, the second probes it."""

    def __init__(self, probe: int, spread_s: float):
        if not isinstance(probe, int) or isinstance(probe, bool) or probe < 2:
            raise ValueError(f"the spread gate's probe period must be an integer >= 2 (calls), got {probe!r}")
        self.probe, self.spread_s = probe, float(spread_s)
        self.state = None  # float64[4] on the device: on, calls since the last probe, net_other, net_spread
        self.flag = None  # bool[1]: whether the next call runs the spread planner where the pre-plan bound lets it
        self._spread_s = None  # float64[1]: spread_s on the device (the kernel's)

    def enable(self, worth: torch.Tensor) -> torch.Tensor:
        """bool 0-d: whether this call runs the spread planner (worth: the guard's pre-plan bound)."""
        if self.state is None or self.state.device != worth.device:
            nan = float("nan")  # nothing measured yet: no comparison holds
            self.state = torch.tensor([0.0, self.probe - 2, nan, nan], dtype=torch.float64, device=worth.device)
            self.flag = torch.zeros(1, dtype=torch.bool, device=worth.device)  # the first call: without it
            self._spread_s = torch.tensor([self.spread_s], dtype=torch.float64, device=worth.device)
        return worth & self.flag[0]

    def record(self, worth: torch.Tensor, ran: torch.Tensor, fired: torch.Tensor, saved: torch.Tensor,
               cost: torch.Tensor, choice: torch.Tensor, first_spread: int) -> None:
        """After a call's guard (`NetBenefitGuard.select` on all candidates: fired, T_saved, T_plan + T_transfer and
        the index of the kept plan; spread candidates from first_spread on): the state as the class says, and the
        next call's flag. On a GPU one Triton kernel (`topoep.runtime.gate_triton`), else this reference."""
        from topoep.runtime import gate_triton

        if gate_triton.usable(self.state):
            gate_triton.record_triton(self.state, self.flag, worth, ran, fired, saved, cost, choice, self._spread_s,
                                      first_spread, self.probe)
            return
        self.record_reference(worth, ran, fired, saved, cost, choice, first_spread)

    def record_reference(self, worth, ran, fired, saved, cost, choice, first_spread: int) -> None:
        """`record` in torch operations (any device)."""
        on, since, net_other, net_spread = self.state.unbind()
        net = torch.where(fired, torch.zeros_like(saved), saved - cost).to(torch.float64)
        kept_spread = (choice >= first_spread) & ~fired
        new_spread = torch.where(ran, torch.where(kept_spread, net, torch.full_like(net, -math.inf)), net_spread)
        new_other = torch.where(ran, net_other, net)
        new_on = torch.where(ran, kept_spread & (net - net_other > self.spread_s),
                             (on > 0) & (net_spread - net > self.spread_s))
        new_since = torch.where(since + 1 >= self.probe, torch.zeros_like(since), since + 1)
        new = torch.stack([new_on.to(torch.float64), new_since, new_other, new_spread])
        self.state.copy_(torch.where(worth, new, self.state))
        self.flag.copy_(((self.state[0] > 0) != (self.state[1] + 1 >= self.probe)).view(1))


class SlotSkipHint:
    """The host's memory of one layer's guard decisions (module docstring), for backend cuda.

    `allow()` says whether this call launches the replica machinery: True for the first `lag` calls, during
    CUDA-graph capture (a captured branch must serve every replay), and whenever the guard wanted replicas
    `lag` calls earlier. `record(wanted)` keeps this call's decision (a bool 0-d device tensor) by an
    asynchronous copy into pinned host memory. The copy of the call `lag` calls back has long finished when
    the next call reads it (the GPU would have to be `lag` whole layer calls behind the host); if it has not,
    the host waits for it (counted in `waits`) rather than guess: every rank must take the same branch.

    A recomputed forward (activation checkpointing) is one more call: it may take the other branch than the
    original forward. Megatron's reentrant recompute is fine with that (same math); torch.utils.checkpoint's
    non-reentrant mode checks that the recomputation saves the same tensors, so use skip_lag=None with it."""

    def __init__(self, lag: int):
        self.lag = lag
        self._host: list[torch.Tensor | None] = [None] * lag
        self._done: list[torch.cuda.Event | None] = [None] * lag
        self.calls = 0  # recorded calls
        self.skipped = 0  # calls that left the replica machinery out
        self.waits = 0  # reads that had to wait for the decision's copy

    def allow(self, device: torch.device) -> bool:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return True
        if self.calls < self.lag:
            return True
        i = self.calls % self.lag  # the slot of call (this call - lag)
        ev = self._done[i]
        if ev is not None and not ev.query():
            self.waits += 1
            ev.synchronize()
        ok = bool(self._host[i].item())  # a host tensor: no device access
        self.skipped += not ok
        return ok

    def record(self, wanted: torch.Tensor) -> None:
        if wanted.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        i = self.calls % self.lag
        if self._host[i] is None:
            self._host[i] = torch.empty((), dtype=torch.bool, pin_memory=wanted.is_cuda)
        self._host[i].copy_(wanted, non_blocking=wanted.is_cuda)
        if wanted.is_cuda:
            ev = self._done[i] = self._done[i] or torch.cuda.Event()
            ev.record()
        self.calls += 1
