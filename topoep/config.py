"""`LayerConfig`: every option of one balanced MoE layer, typed and validated in one place.

`ExpertParallelMoE(config=...)` (or its fields as keywords), the megatron adapter (`TopoEPMoELayer`) and the
trainer's Hydra group `eplb` (`app.config.EplbConfig`, this dataclass plus the group's `name`) all read it, so a
run's `config.yaml` records every option of its layers. `docs/config.md` is generated from this file
(`python tools/config_reference.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

BACKENDS = ("torch", "cuda")
TRANSPORTS = ("peer", "a2a", "deepep")
DEFAULT_CAPACITY_FACTOR = 1.25
"""Receive rows per region per T x top_k (topoep.planners.capacity; results/capacity.md): with 2 slots every
policy's plan fits after the capacity step on every routing of the planners' tests, from uniform to megatron's
skew -4 at EP 8-128, so the step seldom changes a balanced plan."""
CUDA_MAX_CHUNKS = 2


@dataclass(kw_only=True)
class LayerConfig:
    """Options of one TopoEP MoE layer (`ExpertParallelMoE`). Every field is checked when the config is made; an
    error names the field and what to set."""

    prefix: ClassVar[str] = "LayerConfig"  # how errors name a field: LayerConfig.<field>, or eplb.<field> in training

    policy: str = "topoep"
    """Planner policy: static (no balancing), topoep (the paper's), topoep_plus (topoep with free load moves across
    domains and its own-rank-first route; with the guard, the layer also plans topoep_plus_local at the same time and
    keeps whichever the per-link model predicts faster, on more than one NVLink domain: on one it is the same plan),
    topoep_plus_local (topoep_plus without the paper's
    inter-domain replicas: every replica in its main's domain), topoep_plus_spread (load moved across the whole EP
    group, priced on the busiest link; a GPU planner, csrc/spread.cu), topoep_plus_spread_tree (the same, its remote
    copies priced as relay trees fetch them: for relay_fanout), deepseek, fastermoe, flexmoe (peer policies on the
    same runtime; fastermoe plans on the host, the others on the GPU for CUDA tensors)."""
    num_slots: int = 2
    """Replica slots per rank (shared by all layers of a process through one replica pool)."""
    backend: str = "torch"
    """Execution: torch (torch.distributed collectives; CPU and GPU) or cuda (GPU-native, bf16, no host
    synchronisation)."""
    transport: str = "peer"
    """Backend cuda's data movement: peer (peer pointers; the EP group on one host), a2a (NVSHMEM all-to-alls with
    device-side splits; across hosts) or deepep (DeepEP's dispatch and combine, optional: tools/build_deepep.sh; the
    replicas move by TopoEP's own transfers). a2a and deepep need capacity_factor=null, deepep one token chunk."""
    num_chunks: int | None = None
    """Token chunks per call, each dispatched, computed and combined in turn (paper 3.3's pipeline). None: the
    backend's default, 2 for torch and 1 for cuda; backend cuda takes 1 or 2."""
    capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR
    """Receive rows per region (a rank's main experts', its replica slots') in units of T x top_k: backend cuda's
    buffers and the tensors it keeps for backward hold capacity_factor x T x top_k rows each, so its memory does not
    grow with the EP size. The planner's capacity step fits every plan to it; rows it cannot place are computed on
    the spill path (slower, never dropped; logged as capacity_overflow). None: no capacity step, buffers for the
    worst case (EP size x T x top_k rows). Transport a2a needs None."""
    guard: bool = True
    """Net-benefit guard (paper eq. 2): execute the static plan when balancing is predicted not to pay (saving of
    straggler expert time <= planning + replica transfer time). Its constants model GPUs
    (`topoep.runtime.NetBenefitGuard`; the library also takes an instance with other constants); it prices a call's
    dispatch, expert compute and combine one after another, as both backends run them (token_overlap 0)."""
    t_ffn: float | None = None
    """Seconds of expert compute per assignment (forward + backward) for cost-aware policies, the guard and the
    modelled-time statistics. None: the trainer derives it from the model's shape, the library takes
    `topoep.DEFAULT_T_FFN`."""
    planner_blocks: int = 0
    """Blocks of the CUDA planner's cooperative grid (0: half the GPU's SMs). A block takes a whole SM and the grid
    starts only when every block has one, so lower it where collectives on other streams hold many SMs. The plans
    do not depend on it."""
    plan_domain: int | None = 32
    """The refining planners (topoep, and topoep_plus with its local plan) balance inside groups of at most this many
    ranks of each NVLink domain (the largest divisor of the domain's size not above it; `topoep.Topology.planning_groups`)
    instead of whole domains. Their refinement makes one move at a time inside a domain, and a larger domain needs
    more moves, each slower beyond 32 ranks (the CUDA kernel keeps a domain of up to 32 ranks in a warp's registers,
    a rank per lane): on an H100 one domain of 64 ranks (GB200 NVL72) refines for about 0.63 ms per call, of 32 for
    86 us, of 8 for a few. Smaller groups plan faster but balance less (replicas reach other groups only where the
    paper's stage 1 asks); 32 keeps every domain of up to 32 ranks whole and was the simulator's best choice on GB200
    (results/plan_domain.md). The guard and the transfers use the real domains. null: whole domains (the paper's)."""
    max_tokens: int | None = None
    """Backend cuda: the most tokens per rank of one call (its receive regions are sized from it). None: the
    largest first call's T over the EP group."""
    prefetch: bool = False
    """Backend cuda: a second bank of replica slots (twice the slot memory); each backward refills the bank it
    releases with the replicas of the layer whose backward comes after the next one, beside that next backward."""
    combine_side_stream: bool = False
    """Backend cuda, transport peer: the backward combine (token gradients going home) on a side stream beside the
    weight-gradient GEMMs."""
    fetch_overlap: bool = False
    """Backend cuda, transport peer: the forward replica fetch (and the backward reload) runs on a high-priority side
    stream beside the dispatch and the main experts' GEMMs (data gradients in backward) and publishes the slots with
    its own barrier; only the slot GEMMs wait for it. False: it runs on the layer's stream before the dispatch, whose
    barriers publish it. The results are the same bit for bit. The layer's guard then prices what the forward waits for
    the fetch instead of its whole time (`NetBenefitGuard.fetch_overlap`)."""
    cuda_graphs: bool = True
    """Backend cuda: replay each call's metadata (counts, plan, guard, statistics, layout) as a CUDA graph; false
    runs it eagerly (debugging). Policies without a GPU planner always run it eagerly."""
    layer_graphs: bool = False
    """Backend cuda: capture the whole layer call, forward and backward, as CUDA graphs on the layer's first call
    (`topoep.graph_layer`; its warm-up calls run first) and replay them in every later call: the host then issues a
    call in about a millisecond, however many kernels the layer launches. Every call must have the first call's
    shapes (a fixed micro-batch size and sequence length); not with prefetch."""
    plus_spread: bool = False
    """Policy topoep_plus with the guard: the layer also plans topoep_plus_spread (load moved across the whole EP
    group, priced on the busiest link; with relay_fanout also topoep_plus_spread_tree) beside topoep_plus and
    topoep_plus_local, each on its own stream (csrc/spread.cu on a GPU: no host synchronisation), and the guard keeps
    the fastest plan by its per-link model (the share that ran a spread plan: the plan_spread statistic)."""
    plus_peers: bool = False
    """Policy topoep_plus with the guard: the layer also plans FlexMoE's and DeepSeek EPLB's placements (`flexmoe` and
    `deepseek` of topoep.planners.baselines, csrc/peers.cu on a GPU: no host synchronisation) beside topoep_plus and
    topoep_plus_local, each on its own stream, and the guard keeps the fastest plan by its per-link model: where hot
    experts cluster in one domain a topology-unaware spread of replicas can beat ours (the share that ran a peer's plan:
    the plan_peer statistic). Their planners take 130-240 us per call at EP 16-64 (results/peer_latency.md), so
    they run behind the spread gate (spread_gate). Backend cuda: at most 256 ranks (the GPU flexmoe planner's limit)."""
    spread_gate: bool = True
    """With plus_spread or plus_peers: run those gated planners (the spread planner, the peers' planners) only where
    they pay for themselves (`topoep.runtime.guard.SpreadGate`, on the device): while the guard keeps a gated plan
    that it predicts beats topoep_plus's and the local plan by more than the gated planners' own time
    (`NetBenefitGuard.gated_s`), on every call but one in spread_probe (which measures the other two plans again);
    otherwise on one call in spread_probe only, and the other calls' gated planners write the static plan at once
    (the share of calls that ran them: the spread_planned statistic). false: every planner on every planned call."""
    spread_probe: int = 256
    """With spread_gate: every this many planned calls the gate tries the other state (the spread planner on while it
    is off, off while it is on), so a routing that turns warm or cools is found within them (>= 2)."""
    relay_fanout: int | None = None
    """Fetch replicas down relay trees of this many children per node (topoep.relay: one NIC crossing per expert and
    domain, the domains' first copies a tree of this many children below the home, then NVLink inside each domain),
    level by level, and return their gradients up the same trees; None: every copy from its home. Both backends and
    both transports of backend cuda; backend cuda runs a fixed number of levels (topoep.relay.max_level: the log of
    the domain size plus that of the number of domains), each ending with a barrier of the group."""
    relay_chunks: int = 1
    """With relay_fanout: every relayed copy travels in this many chunks, and a relay forwards each chunk as soon as
    it has it, so the trees' levels overlap (levels + relay_chunks - 1 steps instead of one level after the other,
    `topoep.relay.relay_steps`); the gradient return runs up the trees alike. Backend cuda pays a barrier of the
    group per step. The guard prices the fetch this way. Results do not depend on it (1 to 64)."""
    relay_schedule: str = "levels"
    """With relay_fanout: how a relayed fetch runs (topoep.relay.RELAY_SCHEDULES). "levels": level after level (a
    relay sends on once its whole level arrived; relay_chunks overlap the levels). "async": copy by copy, each copy
    sent on as soon as its relay holds it, and the gradient return up the trees alike (a node sends once its
    children's gradients arrived), so a deep tree's second hop runs beside its first level's other copies; the guard
    prices it as the longer of the fetch's busiest link and its longest chain of hops (`NetBenefitGuard.relay_schedule`).
    Backend torch (point-to-point sends) and backend cuda's peer transport (one kernel per weight, a flag per chunk
    in symmetric memory); relay_chunks must be 1. Results do not depend on it."""
    relay_share: bool = False
    """With relay_fanout: the guard relays every fetch whose direct form would make a home send more copies of one
    expert than a relay tree lets a rank send (more than relay_fanout into its own domain, more than relay_fanout over
    its NIC into the others), even where its per-link model predicts the direct fetch faster: no sender carries more than a
    tree's share. False: the guard keeps the faster fetch by its model."""
    deepep_deterministic: bool = False
    """Transport deepep: DeepEP sorts each expert's received rows into a fixed order, so the weight gradients are the
    same bit for bit at every call (and equal a static layer's where the guard fires), at the price of a host
    synchronisation in every dispatch (DeepEP's sort). False: no host synchronisation; the weight gradients equal
    up to the order in which each expert's rows are summed."""

    def __post_init__(self):
        self._check_values()
        self._check_combinations()

    def _check_values(self, policy: bool = True) -> None:
        """Every field on its own: its type, range or choice (an error names the field and what to set); `policy`
        False leaves the policy out (the trainer's eplb=none has none)."""
        from topoep.planners import OFFLINE_POLICIES, POLICIES
        from topoep.relay import RELAY_SCHEDULES

        p = self.prefix
        if not policy:
            pass
        elif self.policy in OFFLINE_POLICIES:
            raise ValueError(f"{p}.policy={self.policy!r} is an offline planner (seconds per plan), not for the runtime; "
                             f"use it through topoep.solve or bench/plan_quality.py, and choose one of "
                             f"{', '.join(POLICIES)} here")
        elif self.policy not in POLICIES:
            raise ValueError(f"{p}.policy={self.policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        _check_int(self, "num_slots", 0)
        _check_choice(self, "backend", BACKENDS)
        _check_choice(self, "transport", TRANSPORTS)
        if self.num_chunks is not None:
            _check_int(self, "num_chunks", 1)
        if isinstance(self.capacity_factor, int) and not isinstance(self.capacity_factor, bool):
            self.capacity_factor = float(self.capacity_factor)  # YAML gives 2 for 2.0
        if self.capacity_factor is not None and (not isinstance(self.capacity_factor, float)
                                                 or not 1.0 <= self.capacity_factor < math.inf):
            raise ValueError(f"{p}.capacity_factor must be a number >= 1 (receive rows per region, in units of the "
                             f"rows a rank sends: T x top_k) or null (buffers for the worst case, R x T x top_k), got "
                             f"{self.capacity_factor!r}")
        for name in ("guard", "prefetch", "combine_side_stream", "fetch_overlap", "cuda_graphs", "layer_graphs",
                     "plus_spread", "plus_peers", "spread_gate", "relay_share", "deepep_deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{p}.{name} must be true or false, got {getattr(self, name)!r}")
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", 1)
        if self.plan_domain is not None:
            _check_int(self, "plan_domain", 1)
        if not isinstance(self.spread_probe, int) or isinstance(self.spread_probe, bool) or self.spread_probe < 2:
            raise ValueError(f"{p}.spread_probe must be an integer >= 2 (calls between the spread gate's probes), got "
                             f"{self.spread_probe!r}")
        if isinstance(self.t_ffn, int) and not isinstance(self.t_ffn, bool):
            self.t_ffn = float(self.t_ffn)
        if self.t_ffn is not None and (not isinstance(self.t_ffn, float) or not 0 < self.t_ffn < math.inf):
            raise ValueError(f"{p}.t_ffn must be a positive number of seconds per assignment or null, got "
                             f"{self.t_ffn!r}")
        _check_int(self, "planner_blocks", 0)
        if self.relay_fanout is not None:
            _check_int(self, "relay_fanout", 1)
        _check_int(self, "relay_chunks", 1)
        if self.relay_chunks > 64:
            raise ValueError(f"{p}.relay_chunks={self.relay_chunks}: at most 64 chunks per relayed copy (the guard "
                             f"kernel's bound); 2-8 already overlap the levels")
        _check_choice(self, "relay_schedule", RELAY_SCHEDULES)

    def _check_combinations(self) -> None:
        """The fields that only work together (an error names them and what to set)."""
        p = self.prefix
        if self.transport != "peer" and self.backend != "cuda":
            raise ValueError(f"{p}.transport={self.transport} applies to {p}.backend=cuda (got backend "
                             f"{self.backend}): set {p}.backend=cuda, or leave {p}.transport=peer")
        if self.num_chunks is not None and self.backend == "cuda" and self.num_chunks > CUDA_MAX_CHUNKS:
            raise ValueError(f"{p}.num_chunks={self.num_chunks}: backend cuda runs 1 or 2 token chunks; set "
                             f"{p}.num_chunks to 1 or 2 (or null for its default, 1)")
        if self.capacity_factor is not None and self.transport == "a2a":
            raise ValueError(f"{p}.transport=a2a sizes its buffers for the worst case and has no spill path: set "
                             f"{p}.capacity_factor=null with it (or use {p}.transport=peer on one host)")
        for name, default in (("prefetch", False), ("combine_side_stream", False), ("max_tokens", None)):
            if getattr(self, name) != default and self.backend != "cuda":
                raise ValueError(f"{p}.{name}={_yaml_value(getattr(self, name))} applies to {p}.backend=cuda (backend "
                                 f"{self.backend} would ignore it): set {p}.backend=cuda or {p}.{name}="
                                 f"{_yaml_value(default)}")
        if self.combine_side_stream and self.transport != "peer":
            raise ValueError(f"{p}.combine_side_stream=true runs the peer-pointer combine on a side stream (transport "
                             f"{self.transport} combines through its own collectives, which would ignore it): set "
                             f"{p}.transport=peer or {p}.combine_side_stream=false")
        if self.layer_graphs and self.backend != "cuda":
            raise ValueError(f"{p}.layer_graphs=true captures backend cuda's calls (backend {self.backend} reads the "
                             f"routing's sizes on the host): set {p}.backend=cuda or {p}.layer_graphs=false")
        if self.layer_graphs and self.prefetch:
            raise ValueError(f"{p}.layer_graphs=true cannot capture a call while a prefetch is in flight: set "
                             f"{p}.prefetch=false or {p}.layer_graphs=false")
        if self.fetch_overlap and (self.backend != "cuda" or self.transport != "peer"):
            raise ValueError(f"{p}.fetch_overlap=true runs backend cuda's peer-pointer fetch on a side stream (got "
                             f"backend {self.backend}, transport {self.transport}, whose fetch keeps its place in the "
                             f"layer's stream): set {p}.backend=cuda and {p}.transport=peer, or "
                             f"{p}.fetch_overlap=false")
        if self.plus_spread and (self.policy != "topoep_plus" or not self.guard or self.num_slots == 0):
            raise ValueError(f"{p}.plus_spread=true adds candidates to the guarded topoep_plus layer (got policy "
                             f"{self.policy}, guard {str(self.guard).lower()}, num_slots {self.num_slots}): set "
                             f"{p}.policy=topoep_plus, {p}.guard=true and {p}.num_slots >= 1, or "
                             f"{p}.plus_spread=false (policy topoep_plus_spread plans it alone)")
        if self.plus_peers and (self.policy != "topoep_plus" or not self.guard or self.num_slots == 0):
            raise ValueError(f"{p}.plus_peers=true adds candidates to the guarded topoep_plus layer (got policy "
                             f"{self.policy}, guard {str(self.guard).lower()}, num_slots {self.num_slots}): set "
                             f"{p}.policy=topoep_plus, {p}.guard=true and {p}.num_slots >= 1, or "
                             f"{p}.plus_peers=false (policies flexmoe and deepseek plan them alone)")
        if self.deepep_deterministic and self.transport != "deepep":
            raise ValueError(f"{p}.deepep_deterministic=true orders DeepEP's received rows, but {p}.transport="
                             f"{self.transport}: set {p}.transport=deepep or {p}.deepep_deterministic=false")
        if self.transport == "deepep":
            if self.capacity_factor is not None:
                raise ValueError(f"{p}.transport=deepep: DeepEP sizes its own buffers for the worst case, so it takes no "
                                 f"capacity: set {p}.capacity_factor=null with it")
            if self.num_chunks not in (None, 1):
                raise ValueError(f"{p}.transport=deepep runs one token chunk per call (DeepEP overlaps its own "
                                 f"transfers): set {p}.num_chunks=1 or null")
            if self.layer_graphs:
                raise ValueError(f"{p}.transport=deepep cannot be captured whole (DeepEP allocates its outputs at "
                                 f"every call): set {p}.layer_graphs=false")
        if self.relay_share and self.relay_fanout is None:
            raise ValueError(f"{p}.relay_share=true bounds the senders of relay trees, but {p}.relay_fanout is null "
                             f"(nothing relayed): set {p}.relay_fanout (e.g. 2) or {p}.relay_share=false")
        if self.relay_schedule == "async":
            if self.relay_fanout is None:
                raise ValueError(f"{p}.relay_schedule=async runs the relay trees copy by copy, but {p}.relay_fanout is "
                                 f"null (nothing relayed): set {p}.relay_fanout (e.g. 2) or {p}.relay_schedule=levels")
            if self.relay_chunks != 1:
                raise ValueError(f"{p}.relay_schedule=async moves whole copies, each as soon as its relay holds it: set "
                                 f"{p}.relay_chunks=1 (got {self.relay_chunks}) or {p}.relay_schedule=levels")
            if self.backend == "cuda" and self.transport != "peer":
                raise ValueError(f"{p}.relay_schedule=async runs on backend torch and on backend cuda's peer transport "
                                 f"(flags in symmetric memory); transport {self.transport} runs the trees level by "
                                 f"level: set {p}.transport=peer (one host) or {p}.relay_schedule=levels")
        if self.relay_chunks > 1 and self.relay_fanout is None:
            raise ValueError(f"{p}.relay_chunks={self.relay_chunks} chunks the relayed replica fetch, but "
                             f"{p}.relay_fanout is null (every copy from its home, nothing relayed): set "
                             f"{p}.relay_fanout (e.g. 2) or {p}.relay_chunks=1")

    @property
    def chunks(self) -> int:
        """num_chunks, or the backend's default."""
        if self.num_chunks is not None:
            return self.num_chunks
        return 1 if self.backend == "cuda" else 2

    def replace(self, **changes) -> "LayerConfig":
        """A copy with `changes` (checked again); an unknown name raises and lists the fields."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown {self.prefix} field(s) {', '.join(unknown)}; the fields are "
                             f"{', '.join(sorted(known))}")
        return dataclasses.replace(self, **changes)


def _yaml_value(v) -> str:
    """A field's value as the config.yaml / command line spells it (true, false, null, 3)."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _check_int(cfg, name: str, low: int) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{cfg.prefix}.{name} must be an integer >= {low}, got {v!r}")


def _check_choice(cfg, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(cfg, name)
    if v not in choices:
        raise ValueError(f"{cfg.prefix}.{name}={v!r} is unknown; choose one of {', '.join(choices)}")
