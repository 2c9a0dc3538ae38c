"""Cluster-scale cost simulator: what one MoE layer costs (forward + backward) under a plan on 8-1024 GPUs.

A plan (`topoep.solve`) fixes every rank's expert load and every (source rank, destination rank) token
flow; this module turns it into times on a described cluster, term by term, so that policies and slot
counts can be compared at scales we cannot run. Three typed configs describe what is simulated:

    Cluster     hardware: GPUs per NVLink domain, per-GPU NVLink and RDMA (NIC) bandwidth and latency
                (effective, per direction), expert GEMM throughput. Presets in CLUSTERS.
    ModelShape  the MoE layer: hidden and expert FFN size, experts, top-k, tokens per rank, and the
                non-expert FLOPs of one transformer layer (for end-to-end estimates). Presets in MODELS.
    Execution   the software that runs the plan: two-chunk pipeline or serial, which replica transfers
                are hidden, fixed overheads, how long planning takes. Presets in EXECUTIONS:
                "topoep" (paper 3.3 / 5: DeepEP-style dispatch, TMA/GIN replica transfers, GPU planner),
                "megatron" (no-EPLB baseline: NCCL all-to-all, no overlap, no planner), and "torch" and
                "cuda" (our two runtime backends as measured on the GPU machine; their constants come
                from `calibrate`).

Usage (no build step; CPU only):

    from topoep_research import sim
    cluster, model = sim.CLUSTERS["paper_h800"], sim.MODELS["qwen3"]
    omega = sim.sample_routing(32, model.num_experts, model.tokens_per_rank, model.top_k, router_skew=-4.0)
    res = sim.simulate(omega, cluster, model=model, policy="topoep", num_slots=2)
    res.layer_s, res.exposed, res.terms, res.traffic      # seconds / per-term dicts / bytes
    base = sim.simulate(omega, cluster, model=model, policy="static", execution=sim.EXECUTIONS["megatron"])
    base.layer_s / res.layer_s                             # throughput ratio of the MoE layer
    # a recorded trace (workloads.load_trace): [sim.simulate(om, cluster, model=model) for om in trace.flatten(0, 1)]
    cache = sim.PlanCache("build/plan_cache")              # reference plans on disk (seconds each at EP 1024)
    sim.simulate(omega, cluster, model=model, policy="topoep", num_slots=4, plan_cache=cache)  # solved once, then read

    cases = sim.measured_cases("results/moe_layer.json", backend="cuda")  # the GPU machine's bench, plans rebuilt
    cal = sim.calibrate(cases)                              # fitted constants: cal.fitted, cal.cluster
    sim.predict(cases[0], cal).layer_s                      # vs cases[0].measured_ms / 1e3
    sim.presets(cal.cluster.gemm_flops_per_s, cal.cluster.nvlink_bytes_per_s)  # CLUSTERS from that fit

`python bench/simulate.py` runs the calibration report and the EP 8-1024 sweep (results/simulation.md).

The model (all per layer call, forward + backward, one microbatch):
    compute    rank r executes L_r assignments: t_ffn * L_r (forward 1/3, data + weight gradient 2/3),
               t_ffn = 18 H F / gemm_flops_per_s (`metrics.ffn_time_per_assignment`); the straggler sets it.
    tokens     four transfers (dispatch, combine; forward, backward) of the rows s -> r the plan gives
               (one per assignment; with Execution.dedup, DeepEP-style: one per token and destination
               rank, one per token and destination domain across the NIC, forwarded over NVLink; see
               `token_link_loads`). One transfer takes latency + the busiest link's bytes / its
               bandwidth, over every GPU's NVLink out, NVLink in, NIC out and NIC in (own rank: free).
    replicas   forward fetch and backward reload of W bytes main(e) -> slot rank, gradient return
               back; same busiest-link rule (a main rank sending one hot expert to many slots is a
               hotspot); plus `replica_latency_s` per transfer.
    plan       count all-gather (R * E int64 over the same links), paid by every policy: megatron's
               alltoall token dispatcher all-gathers the same [EP, E] counts in every call (its
               `preprocess`), and ours plans from them; + planner latency for the balancing policies: the
               measured GPU planner (results/planner_latency.md, H200) for policies with a CUDA kernel; for
               the others a host round trip + omega over PCIe + a solve as fast as the GPU planner (or, with
               Execution.measured_host_plan, the CPU reference's measured wall time: an upper bound). With
               the guard, a call whose routing no plan can pay for (`NetBenefitGuard.worth_planning`) runs
               the static plan and pays no planner.
    schedule   paper 3.3: plan and fetch precede dispatch (Execution.fetch_overlap: the fetch beside the
               dispatch and the main experts' GEMMs, first on shared links, `overlapped_forward`); tokens
               in `num_chunks` chunks on a comm stream (all dispatches, then each combine after its chunk's
               compute) beside a compute
               stream; backward: data gradients per chunk, combines after them, weight gradients last;
               reload and gradient return hidden (overlap with other layers) or on the critical path.
               Communication ops are collective: they wait for the straggler. Serial executions add
               every phase.
The exposed breakdown (`SimResult.exposed`) splits the layer time into plan + replica (exposed part) +
compute (straggler) + token (what the pipeline does not hide) + overhead; `terms` holds the raw times.
Not modelled: GEMM efficiency varying with rows per expert, link contention between concurrent token
and replica transfers other than the overlapped forward fetch's (strict priority), the correlation of a
token's k choices beyond "distinct experts" (dedup), NIC rail imbalance beyond the same-local-index rule,
tree or multicast replica broadcast.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import time
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

import topoep
from topoep import links, workloads
from topoep.metrics import DEFAULT_T_FFN, FLOPS_PER_ASSIGNMENT_FACTOR, metrics
from topoep.links import chunk_pipeline, replica_matrix, token_matrix
from topoep.plan import Plan, default_main_rank
from topoep.relay import copy_arrival, executed_sources, relay_levels, relay_steps, sender_copies
from topoep.planners import POLICIES, REFINED_POLICIES, solve, validate
from topoep.planners import spread as spread_planner
from topoep.planners.baselines import peer_solo_s
from topoep.planners.capacity import region_loads
from topoep.planners.cuda import CUDA_POLICIES, PEER_POLICIES, SPREAD_POLICIES
from topoep.topology import Topology

# -- configs ---------------------------------------------------------------------------------------


def _check(obj, name: str, kind: str, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
    v = getattr(obj, name)
    what = f"{type(obj).__name__}.{name}"
    if kind == "int":
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or v > hi:
            raise ValueError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
        return
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= hi
    ok = ok and (v > lo if lo_open else v >= lo)
    if not ok:
        raise ValueError(f"{what} must be a finite number {'>' if lo_open else '>='} {lo:g}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Hardware of an expert-parallel group. Bandwidths are *effective* (what an all-to-all achieves),
    per GPU and per direction; an EP group of R GPUs spans R / domain_size(R) NVLink domains."""

    name: str = "custom"
    gpus_per_domain: int
    """GPUs that share one NVLink/NVSwitch domain (a node; 72 for an NVL72 rack)."""
    nvlink_bytes_per_s: float
    """Effective NVLink bandwidth of one GPU, per direction (bytes/s)."""
    nvlink_latency_s: float = 20e-6
    """Fixed time of one intra-domain collective step (launch + synchronisation)."""
    rdma_bytes_per_s: float
    """Effective inter-domain (NIC) bandwidth of one GPU, per direction (bytes/s)."""
    rdma_latency_s: float = 30e-6
    """Fixed time of one transfer that crosses domains."""
    gemm_flops_per_s: float
    """Effective grouped-GEMM throughput of the expert FFNs (BF16 FLOP/s)."""
    host_bytes_per_s: float = 25e9
    """Device <-> host copy bandwidth (PCIe) for host-side planners."""
    note: str = ""

    def __post_init__(self):
        _check(self, "gpus_per_domain", "int", 1)
        for name in ("nvlink_bytes_per_s", "rdma_bytes_per_s", "gemm_flops_per_s", "host_bytes_per_s"):
            _check(self, name, "float", 0.0, lo_open=True)
        for name in ("nvlink_latency_s", "rdma_latency_s"):
            _check(self, name, "float", 0.0)

    def domain_size(self, num_ranks: int) -> int:
        """Ranks per domain for an EP group of num_ranks: all of them if they fit in one domain, else
        the largest divisor of num_ranks <= gpus_per_domain (domains must be equal; 128 ranks on NVL72
        racks use 64 GPUs of each of 2 racks)."""
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
        if num_ranks <= self.gpus_per_domain:
            return num_ranks
        return max(d for d in range(1, self.gpus_per_domain + 1) if num_ranks % d == 0)

    def topology(self, num_ranks: int) -> Topology:
        """The planners' view: domains of domain_size(num_ranks), costs 1 / effective bandwidth."""
        d = self.domain_size(num_ranks)
        return Topology(num_domains=num_ranks // d, ranks_per_domain=d, intra_cost=1.0 / self.nvlink_bytes_per_s,
                        inter_cost=1.0 / self.rdma_bytes_per_s)

    def t_ffn(self, model: "ModelShape") -> float:
        """Seconds of expert compute per assignment, forward + backward."""
        return FLOPS_PER_ASSIGNMENT_FACTOR * model.hidden_size * model.ffn_hidden_size / self.gemm_flops_per_s


def dense_flops_per_token(*, hidden: int, attn_params: float, num_heads: int, qk_dim: int, v_dim: int, seq_len: int,
                          num_experts: int, shared_ffn: int = 0, vocab: int = 0, num_layers: int = 1) -> float:
    """Forward + backward FLOPs per token of one transformer layer's non-routed part: attention
    projections (attn_params weights, 6 FLOPs each), causal attention (half the keys; backward 2.5x the
    forward, flash-style recompute), router, shared experts (SwiGLU of width shared_ffn) and the
    embedding + output layer amortised over num_layers. Rough: for end-to-end estimates only."""
    proj = 6.0 * attn_params
    core = 3.5 * 2 * (seq_len / 2) * num_heads * (qk_dim + v_dim)
    router = 6.0 * hidden * num_experts
    shared = FLOPS_PER_ASSIGNMENT_FACTOR * hidden * shared_ffn
    head = 6.0 * hidden * vocab / num_layers
    return proj + core + router + shared + head


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """One MoE layer's shape and per-rank batch."""

    name: str = "custom"
    hidden_size: int
    ffn_hidden_size: int
    """Expert FFN width F (SwiGLU: 3 matrices H x F)."""
    num_experts: int
    top_k: int
    tokens_per_rank: int = 4096
    dtype_bytes: int = 2
    dense_flops_per_token: float = 0.0
    """Non-expert FLOPs of one transformer layer per token (fwd + bwd; `dense_flops_per_token()`);
    0: simulate the MoE layer alone."""

    def __post_init__(self):
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k", "tokens_per_rank", "dtype_bytes"):
            _check(self, name, "int", 1)
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelShape.top_k={self.top_k} must be <= num_experts={self.num_experts}")
        _check(self, "dense_flops_per_token", "float", 0.0)

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden_size * self.ffn_hidden_size * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        return self.hidden_size * self.dtype_bytes

    def with_experts(self, num_experts: int) -> "ModelShape":
        return replace(self, num_experts=num_experts)


@dataclass(frozen=True, kw_only=True)
class Execution:
    """How a plan is executed: overlap and fixed costs of the runtime (module docstring)."""

    name: str = "custom"
    pipelined: bool = True
    """Two-stream chunk pipeline of paper 3.3 (False: every phase waits for the previous one)."""
    num_chunks: int = 2
    reload_hidden: bool = True
    """Backward replica reload overlaps earlier backward work (paper 3.3.2); else it delays the first
    data gradient (pipelined: overlapping the first gradient dispatch)."""
    grad_return_hidden: bool = True
    """Replica gradient return overlaps later backward work; else it ends the layer's backward."""
    layer_overhead_s: float = 0.0
    """Fixed time per layer call (host work, launches, synchronisations outside the phases)."""
    row_overhead_s: float = 0.0
    """Time per routed assignment of the busiest source rank (memory-bound permutes, weighting)."""
    expert_overhead_s: float = 0.0
    """Fixed expert-compute time per layer call on every rank (kernel launches, small GEMM tails)."""
    comm_overhead_s: float = 0.0
    """Fixed time of all token phases of one call together (layouts, count exchange, host syncs)."""
    replica_latency_s: float = 0.0
    """Added to each replica transfer (fetch, reload, return) when the plan has a replica."""
    static_plan_s: float = 0.0
    """Planning time when the policy is static, besides the count all-gather (no planner runs: 0)."""
    plan_s: float | None = None
    """Planning time of the balancing policies, all included (the static plan then takes static_plan_s, all
    included: the calibrated executions, whose constants were fitted on measured layers); None: count all-gather + planner
    latency: the GPU planner's (policies with a CUDA kernel) or a host planner's (round trip + copy of
    omega over PCIe + solve time, see measured_host_plan)."""
    host_round_trip_s: float = 50e-6
    """Device -> host -> device round trip of a host-side planner (launch, synchronisation)."""
    measured_host_plan: bool = False
    """Host planners' solve time: the CPU reference's measured wall time in this process (pure Python:
    an upper bound, seconds at EP 1024) if True, else the GPU planner's latency (as if the policy had a
    compiled solver as fast as ours: its plan quality, not its implementation, is compared)."""
    dedup: bool = True
    """Token transfers as DeepEP's: a token goes once to each destination rank and, across domains,
    once to each destination domain (to the GPU of the same local index, which forwards it over
    NVLink); False: one row per assignment, rank to rank (NCCL all-to-all of permuted tokens)."""
    capacity_factor: float | None = 1.25
    """Backend cuda's receive regions for `SimResult.memory` (topoep.memory; None: sized for the worst case).
    The times do not model the capacity step (it changes only plans that overflow a region)."""
    relay_fanout: int | None = None
    """Replica fetches down relay trees of this many children per node (topoep.relay; the levels one after the
    other, each at its busiest link; the traffic columns stay the direct fetch's); None: every copy from its home in
    one transfer."""
    relay_chunks: int = 1
    """With relay_fanout: each relayed copy in this many chunks, the levels overlapping (topoep.relay.relay_steps:
    levels + relay_chunks - 1 steps, each a transfer of 1/relay_chunks of the copies it carries, at its busiest link
    with the cluster's transfer latency; `replica_latency_s` once per fetch, as for the levels). The guard prices the
    same steps with its own `transfer_latency_s` per step."""
    relay_share: bool = False
    """With relay_fanout: the guard relays every fetch whose direct form exceeds a tree's share
    (`NetBenefitGuard.relay_share`)."""
    relay_schedule: str = "levels"
    """With relay_fanout: how a relayed fetch runs. "levels" (both runtimes): level after level, each waiting for the
    one before (relay_chunks overlap them). "async" (`LayerConfig.relay_schedule`: backend torch, backend cuda's peer
    transport): every copy leaves as soon as its source holds it, so the fetch takes the longer of its busiest link's
    bytes over all levels and its longest chain of hops (`async_fetch_s`), an optimistic estimate of a copy-by-copy
    schedule; the guard prices the fetch the same way (`NetBenefitGuard.relay_schedule`,
    `topoep.relay.async_fetch_fs`)."""
    fetch_overlap: bool = False
    """Pipelined executions: the forward replica fetch runs beside the dispatch and the main experts' GEMMs, first on
    the links they share (`overlapped_forward`; backend cuda's LayerConfig.fetch_overlap); each rank's slot GEMMs
    wait for it. False: the fetch precedes the dispatch. The backward reload follows `reload_hidden` either way (the
    runtime's overlapped reload is not modelled: an upper bound where it is exposed)."""
    spread_planner: str = "plus"
    """How the spread planner (`topoep.planners.spread`: standalone, or a guarded topoep_plus layer's candidate) is
    timed: "plus", as fast as topoep_plus's CUDA planner (a layer's candidates run at once: one planner latency) and
    standalone as a host planner, as the runtime would run it with a planner of that speed; "measured", the CUDA
    spread planner (csrc/spread.cu) as measured on one H200 (gpu_spread_s: it, or the four plans of a relayed
    layer, at once, set the layer's planning time), for the moves its greedy made in the call."""
    peer_planner: str = "plus"
    """How a guarded topoep_plus layer's peer candidates (flexmoe, deepseek: LayerConfig.plus_peers) are timed:
    "plus", as fast as topoep_plus's CUDA planner (the what-if: the candidates cost no time beyond the pair's);
    "measured", the four plans at once as csrc/peers.cu runs them on one H200 (`baselines.peer_set_s`)."""
    peers_on_gpu: bool = False
    """The peers' own layers (policies deepseek and flexmoe, which have CUDA planners in csrc/peers.cu) plan on the GPU
    as this runtime runs them: their measured planner alone (`baselines.peer_solo_s`), no host round trip. False:
    as their own systems plan them, on the host (host_round_trip_s, the counts' copy, a planner as fast as ours).
    fastermoe plans on the host either way."""
    spread_speedup: float = 1.0
    """With spread_planner="measured": the measured spread planner's time divided by this (what a planner this many
    times faster would give; 1: as measured)."""
    spread_gate: bool = True
    """A guarded topoep_plus layer with spread candidates gates the spread planner as the runtime does
    (`topoep.runtime.guard.SpreadGate`, LayerConfig.spread_gate), in steady state (one routing stands for every call):
    on where the guard keeps a spread plan that it predicts beats the other candidates' by more than the spread
    planner's time (the spread planner beside the others on every call, but one in spread_probe, which runs the other
    candidates' layer: averaged in), off elsewhere (the other candidates' plan; the spread planner's time beyond
    theirs on one call in spread_probe, amortised). False: every candidate on every planned call."""
    spread_probe: int = 256
    """With spread_gate: the spread gate's probe period (LayerConfig.spread_probe; >= 2)."""
    slot_hint: bool = True
    """A guarded call whose pre-plan bound leaves planning out runs as backend cuda's slot hint runs it once the
    bound has said so for `skip_lag` calls (`SlotSkipHint`): the bound and the static plan, no planner, no guard
    (gpu_hint_s). One routing stands for every call here, so the bound's verdict is taken as steady; where it flips
    from call to call the hint lags, which this does not model. False: the whole skipped decision (gpu_decision_s)."""
    plan_domain: int | None = 32
    """The refining planners (topoep, topoep_plus, topoep_plus_local: REFINED_POLICIES) balance inside groups of at
    most this many ranks of each NVLink domain (`topoep.solve`'s plan_domain, LayerConfig.plan_domain, whose default
    this is) and are timed at the groups' size (gpu_planner_s); the plans run on the real domains. None: whole
    domains (the paper's; a GB200 domain of 64 then refines for about 0.65 ms: GPU_DOMAIN_EXTRA_US)."""

    def __post_init__(self):
        _check(self, "num_chunks", "int", 1)
        if self.relay_fanout is not None:
            _check(self, "relay_fanout", "int", 1)
        _check(self, "relay_chunks", "int", 1)
        if self.relay_schedule not in RELAY_SCHEDULES:
            raise ValueError(f"Execution.relay_schedule={self.relay_schedule!r}: one of {', '.join(RELAY_SCHEDULES)}")
        if self.relay_schedule == "async" and self.relay_chunks != 1:
            raise ValueError("Execution.relay_schedule='async' moves whole copies: relay_chunks must be 1")
        _check(self, "spread_probe", "int", 2)
        if self.plan_domain is not None:
            _check(self, "plan_domain", "int", 1)
        if not isinstance(self.peers_on_gpu, bool):
            raise ValueError(f"Execution.peers_on_gpu must be True or False, got {self.peers_on_gpu!r}")
        for name in ("layer_overhead_s", "row_overhead_s", "expert_overhead_s", "comm_overhead_s",
                     "replica_latency_s", "static_plan_s", "host_round_trip_s"):
            _check(self, name, "float", 0.0)
        if self.plan_s is not None:
            _check(self, "plan_s", "float", 0.0)
        _check(self, "spread_speedup", "float", 0.0, lo_open=True)
        if self.spread_speedup != 1.0 and self.spread_planner != "measured":
            raise ValueError(f"Execution.spread_speedup={self.spread_speedup} scales the measured spread planner: set "
                             f"spread_planner='measured' or spread_speedup=1.0")
        if self.peer_planner not in SPREAD_PLANNERS:
            raise ValueError(f"Execution.peer_planner={self.peer_planner!r} is unknown; choose one of "
                             f"{', '.join(SPREAD_PLANNERS)}")
        if self.spread_planner not in SPREAD_PLANNERS:
            raise ValueError(f"Execution.spread_planner={self.spread_planner!r} is unknown; choose one of "
                             f"{', '.join(SPREAD_PLANNERS)}")
        if self.fetch_overlap and not self.pipelined:
            raise ValueError(f"Execution.fetch_overlap=True overlaps the fetch with the chunk pipeline, but execution "
                             f"{self.name!r} is not pipelined: set pipelined=True or fetch_overlap=False")

    @property
    def exposed_replica_transfers(self) -> int:
        """Replica transfers the critical path waits for (the net-benefit guard's n)."""
        return 1 + (not self.reload_hidden) + (not self.grad_return_hidden)


# GPU planner latency (us, 640 experts, 2 slots) on one H200, from results/planner_latency.md: the
# planner replayed from a CUDA graph on a busy stream, as backend cuda's metadata graph runs it in a layer (the
# host, which runs ahead, adds nothing; the eager call's host time, 15-30 us more, varies from run to run).
# Interpolated in log2(EP); beyond EP 128 extrapolated linearly in EP with the last segment's slope
# (conservative: not measured).
GPU_PLANNER_US = ((8, 36.5), (16, 29.4), (32, 32.6), (64, 39.4), (128, 46.3))
# the same for topoep_plus (same run)
GPU_PLANNER_PLUS_US = ((8, 48.8), (16, 37.9), (32, 41.1), (64, 51.6), (128, 60.4))
# What larger NVLink domains add to those (us, by ranks per domain; the tables above are domains of 8). The paper's
# refinement (stage 3) runs per domain, a warp each, one move per iteration: its iterations grow with the domain's
# ranks (35, 100, 227 at 16, 32, 64 on the latency workload) and so does each iteration's scan, so a domain of 64
# (GB200 NVL72 at EP 64, and every domain of EP 128-256 there) refines for about 0.63 ms. Measured: one domain of
# that many ranks (EP = ranks per domain) on one H100, graph on a busy stream
# (results/gpu/decision_4b23704_h100/planner_latency_one_domain.md), less the tables' value at that EP (one H200):
# mixed devices (H100 against H200 for a few microseconds of the difference; the one-domain times are not measured
# on an H200). Interpolated in log2(ranks per domain), 0 at 8, linear beyond 64. Charged to the policies that run
# the refinement (topoep, topoep_plus and its local plan); the peers' planners and the spread planner keep theirs.
GPU_DOMAIN_EXTRA_US = ((8, 0.0), (16, 18.9), (32, 72.0), (64, 613.8))
GPU_DOMAIN_EXTRA_PLUS_US = ((8, 0.0), (16, 19.6), (32, 71.6), (64, 652.9))
# Several such domains (or planning groups, Execution.plan_domain) in a larger EP group refine at once, a warp each,
# and the slowest sets the time: on one H100 at EP 64 as 2 groups of 32 ranks topoep took 138.7 and topoep_plus 156.1
# us against 39.4 and 50.7 in groups of 8 (same device; results/gpu/plan_domain_h200/h100/), an extra of 99.3 and
# 105.4 where one domain of 32 at EP 32 adds 71.0 and 70.5 (same device). That ratio scales the extra wherever the EP
# group holds more than one domain or group larger than 8 (measured at 2 groups of 32 only).
GPU_GROUPS_EXTRA_SCALE = (99.3 / 71.0, 105.4 / 70.5)  # (topoep, topoep_plus)
# The net-benefit guard's CUDA kernel (us; topoep_plus's plan and its local candidate, 640 experts, 2 slots) on one
# H200, replayed from a CUDA graph on a busy stream, from bench/guard_latency.py
# (results/gpu/plan_domain_h200/guard_latency.md); with relay_fanout=2 (the relay choice and the executed plan's
# trees, written by the guard's own launches) the second table. A guarded layer runs it in every call that plans.
# Interpolated as the planner's. The whole graph's time is charged, though a graph of one tiny kernel takes about
# 3 us the same way and the metadata graph is replayed anyway. Every GPU_DECISION_* and GPU_STATIC_PLAN_US below
# comes from the same run.
GPU_GUARD_US = ((8, 13.1), (32, 12.6), (128, 20.0))
GPU_GUARD_RELAY_US = ((8, 17.9), (32, 22.5), (128, 49.8))
# A guarded topoep_plus layer's whole decision (us; results/guard_latency.md, same run conditions): the pre-plan bound
# (worth_planning's kernel), topoep_plus and topoep_plus_local at once on two streams, the guard's kernel (and with
# relays the trees). SKIP: on uniform routing, where the bound leaves planning out (the planners write the static
# plan, the guard prices nothing). PLUS: on the planner-latency workload, planned: what a guarded topoep_plus
# layer's planning and guard cost together. HINT: a call of backend cuda whose replica machinery the slot hint left
# out (`SlotSkipHint`): the bound and the static plan only. STATIC_PLAN: the static plan alone, which the static
# layer runs too (the simulator charges the static layer no plan time, so a hint's call is charged HINT less it).
GPU_DECISION_SKIP_US = ((8, 11.4), (32, 11.9), (128, 15.0))
GPU_DECISION_SKIP_RELAY_US = ((8, 11.3), (32, 12.2), (128, 14.7))
GPU_DECISION_PLUS_US = ((8, 67.3), (32, 61.5), (128, 83.8))
GPU_DECISION_PLUS_RELAY_US = ((8, 72.3), (32, 71.6), (128, 114.3))
GPU_DECISION_HINT_US = ((8, 8.0), (32, 8.1), (128, 10.3))
GPU_DECISION_HINT_RELAY_US = ((8, 10.8), (32, 10.7), (128, 12.8))
GPU_STATIC_PLAN_US = ((8, 3.6), (32, 3.6), (128, 3.9))
# What a layer with plus_spread and its spread gate adds to that decision (GPU_DECISION_PLUS_US) on a call the gate
# leaves the spread planner out of (the gate-off chain less the plain one): the gate's flag and update kernel, the
# spread planner writing the static plan beside the other two, the guard over three plans. Charged to every call of a
# gated layer (where the spread planner runs, its time instead of topoep_plus's as well). EP 32 and 128: the run of
# GPU_DECISION_*; EP 8 (where that run's layer is one domain) from an earlier H200 run whose layer planned the
# local candidate there too (results/gpu/gate/guard_latency_sim.md).
GPU_SPREAD_GATE_US = ((8, 6.2), (32, 6.1), (128, 6.0))
# The same where the planners see one domain (the whole EP group unplanned as groups; by EP): the layer plans no local
# candidate (two plans beside the spread planner's static one become one): the same H200 run, guard_latency.md (EP 8)
# and guard_latency_one_domain.md (EP 16-64, whole domains) beside it
GPU_SPREAD_GATE_ONE_DOMAIN_US = ((8, 2.5), (16, 2.6), (32, 3.2), (64, 2.8))
# The CUDA spread planner (csrc/spread.cu) on one H200: topoep_plus_spread alone (the candidate of a layer without
# relays: the pair beside it is faster), and the four plans of a relayed layer at once (topoep.planners.spread, from
# results/spread_latency.md).
GPU_SPREAD_US = spread_planner.LATENCY_US
GPU_SPREAD_SET_US = spread_planner.LATENCY_SET_US
RELAY_SCHEDULES = ("levels", "async")  # Execution.relay_schedule
SPREAD_PLANNERS = ("plus", "measured")  # Execution.spread_planner and Execution.peer_planner

# Expert GEMM throughput and effective NVLink bandwidth fitted by `calibrate` on results/moe_layer.json
# (2 x H200, EP 2, Qwen3 expert shape; the file names its commit), backend cuda (the fast path:
# torch._grouped_mm experts, symmetric-memory dispatch/combine): t_ffn = 45.3 ns per assignment, 287 GB/s
# per direction. (Backend torch on the same run: 70.9 ns, NCCL all-to-all 332 GB/s.) `python
# bench/simulate.py` refits both, picks the backend whose fit the presets follow and builds them with `presets`.
H200_GEMM_FLOPS = 6.24e14
H200_NVLINK_BYTES_PER_S = 2.87e11
H100_PEAK_BF16 = 989e12  # dense BF16 tensor-core peak of H100/H800/H200


def presets(h200_gemm_flops_per_s: float = H200_GEMM_FLOPS,
            h200_nvlink_bytes_per_s: float = H200_NVLINK_BYTES_PER_S) -> dict[str, Cluster]:
    """The cluster presets, built from the H200 fit (GEMM FLOP/s and effective NVLink of our GPU machine):
    h200 uses both; the other GPUs' GEMM throughput is their BF16 peak x the H200 fit's efficiency (fit /
    H100_PEAK_BF16); paper_h800's and gb200_nvl72's NVLink come from DeepEP's H800 numbers, not the fit."""
    eff = h200_gemm_flops_per_s / H100_PEAK_BF16
    return {
        "paper_h800": Cluster(
            name="paper_h800", gpus_per_domain=8, nvlink_bytes_per_s=155e9, rdma_bytes_per_s=45e9,
            gemm_flops_per_s=eff * H100_PEAK_BF16,
            note="paper 6.1: nodes of 8 H800 on NVSwitch (400 GB/s bidirectional), 2 x 200 Gb/s IB per GPU; effective "
                 "bandwidths from DeepEP's H800 + CX7 normal-kernel numbers (NVLink 153-158 GB/s, RDMA 43-58 GB/s); "
                 "GEMM: the H200 fit (same BF16 peak)"),
        "gb200_nvl72": Cluster(
            name="gb200_nvl72", gpus_per_domain=72, nvlink_bytes_per_s=0.775 * 900e9, rdma_bytes_per_s=0.9 * 100e9,
            gemm_flops_per_s=eff * 2.5e15,
            note="NVL72 racks: NVLink 5 (900 GB/s per direction) x the H800 NVLink efficiency 0.775, one 800 Gb/s NIC "
                 "per GPU x 0.9, 2.5 PFLOP/s dense BF16 x the H200 fit's efficiency; assumed, not measured"),
        "h200": Cluster(
            name="h200", gpus_per_domain=8, nvlink_bytes_per_s=h200_nvlink_bytes_per_s, rdma_bytes_per_s=45e9,
            gemm_flops_per_s=h200_gemm_flops_per_s,
            note="our GPU machine (H200, NVLink 4): GEMM and NVLink fitted on its 2-GPU bench (calibrate); nodes of 8; "
                 "RDMA assumed as the paper's 400 Gb/s per GPU (never measured)"),
    }


CLUSTERS = presets()
GEMM_EFFICIENCY = H200_GEMM_FLOPS / H100_PEAK_BF16  # ~0.63, applied to other GPUs' peaks

_QWEN3_DENSE = dense_flops_per_token(hidden=2048, attn_params=2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048,
                                     num_heads=32, qk_dim=128, v_dim=128, seq_len=4096, num_experts=128,
                                     vocab=151936, num_layers=5)
_GLM_DENSE = dense_flops_per_token(hidden=4096, attn_params=4096 * (96 + 2 * 8) * 128 + 96 * 128 * 4096,
                                   num_heads=96, qk_dim=128, v_dim=128, seq_len=4096, num_experts=128, shared_ffn=1408,
                                   vocab=151552, num_layers=5)
_DSV2_DENSE = dense_flops_per_token(hidden=5120, attn_params=5120 * 1536 + 1536 * 128 * 192 + 5120 * 576
                                    + 512 * 128 * 256 + 128 * 128 * 5120, num_heads=128, qk_dim=192, v_dim=128,
                                    seq_len=4096, num_experts=160, shared_ffn=2 * 1536, vocab=102400, num_layers=4)
# Table 1 of the paper (reduced depth: embedding and output layer amortised over its 5/5/4 MoE layers).
MODELS = {
    "qwen3": ModelShape(name="qwen3", hidden_size=2048, ffn_hidden_size=768, num_experts=128, top_k=8,
                        dense_flops_per_token=_QWEN3_DENSE),
    "glm45air": ModelShape(name="glm45air", hidden_size=4096, ffn_hidden_size=1408, num_experts=128, top_k=8,
                           dense_flops_per_token=_GLM_DENSE),
    "deepseek_v2": ModelShape(name="deepseek_v2", hidden_size=5120, ffn_hidden_size=1536, num_experts=160, top_k=6,
                              dense_flops_per_token=_DSV2_DENSE),
}

EXECUTIONS = {
    # paper 3.3 and 5: two chunks, GPU planner, forward fetch exposed, reload and gradient return hidden;
    # 0.2 ms per layer of launches and routing glue (assumed, the same as megatron's)
    "topoep": Execution(name="topoep", layer_overhead_s=2e-4),
    # megatron-core alltoall dispatcher: no planner, no replicas, dispatch -> experts -> combine in order
    "megatron": Execution(name="megatron", pipelined=False, layer_overhead_s=2e-4, dedup=False),
    # backend torch on the GPU machine: every phase blocking (NCCL, host syncs), two chunks without overlap;
    # constants from calibrate() on results/moe_layer.json (bench/simulate.py; the report names its commit)
    "torch": Execution(name="torch", pipelined=False, reload_hidden=False, grad_return_hidden=False, dedup=False,
                       layer_overhead_s=2.6e-6, row_overhead_s=6.96e-8, expert_overhead_s=3.06e-3,
                       comm_overhead_s=4.94e-3, replica_latency_s=4.3e-4, static_plan_s=2.26e-3, plan_s=3.19e-3),
    # backend cuda: one chunk, every phase in order on one stream, no host sync; fixed costs fitted on the
    # layer totals (calibrate(fixed="totals"), same json): 2.13 ms per call + 28.2 ns per assignment; a balancing
    # call adds 0.29 ms (planner, guard, slot-pool kernels); the phase intercepts are not used
    "cuda": Execution(name="cuda", pipelined=False, num_chunks=1, reload_hidden=False, grad_return_hidden=False,
                      dedup=False, layer_overhead_s=2.13e-3, row_overhead_s=2.82e-8, plan_s=2.94e-4),
}


# -- routing at scale --------------------------------------------------------------------------------
NATURAL_MAX_OVER_MEAN = 7.34  # paper 2.2 / Fig. 2c: mean per-layer max/mean expert load, Qwen3 on DAPO-Math
EXACT_LIMIT = 1 << 27  # R * T * E random draws above which sample_routing(method="auto") samples counts


def _zipf_log_weights(num_experts: int, num_ranks: int, alpha: float, seed: int, layout: str) -> torch.Tensor:
    pop = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-alpha)
    g = torch.Generator().manual_seed(seed)
    drawn = pop.log().float()[torch.argsort(torch.randperm(num_experts, generator=g))]
    return workloads.arrange(drawn, num_ranks, layout)


def _selection_prob(log_weights: torch.Tensor, top_k: int, noise: str, seed: int, probe_tokens: int) -> torch.Tensor:
    """float64[E]: probability that one token selects each expert (sums to top_k), from probe tokens."""
    idx = workloads.topk_from_logits_bias(1, probe_tokens, top_k, log_weights, noise, seed + 31337)
    return torch.bincount(idx.reshape(-1), minlength=log_weights.numel()).double() / probe_tokens


_ALPHA_CACHE: dict = {}


def natural_alpha(num_experts: int, top_k: int, target: float = NATURAL_MAX_OVER_MEAN, probe_tokens: int = 1 << 14) -> float:
    """Zipf exponent at which the hottest expert gets `target` times the mean load (bisection)."""
    key = (num_experts, top_k, target, probe_tokens)
    if key not in _ALPHA_CACHE:
        lo, hi = 0.0, 4.0
        for _ in range(14):
            mid = (lo + hi) / 2
            p = _selection_prob(_zipf_log_weights(num_experts, 1, mid, 0, "random"), top_k, "gumbel", 0, probe_tokens)
            lo, hi = (mid, hi) if (p.max() / p.mean()).item() < target else (lo, mid)
        _ALPHA_CACHE[key] = (lo + hi) / 2
    return _ALPHA_CACHE[key]


def sample_routing(num_ranks: int, num_experts: int, tokens_per_rank: int, top_k: int, *,
                   router_skew: float | None = None, natural: bool = False, seed: int = 0, layout: str = "random",
                   method: str = "auto", probe_tokens: int = 1 << 16) -> torch.Tensor:
    """omega int64[R, E] for a synthetic workload: megatron's biased router (`router_skew`, as
    `workloads.biased_routing`) or, with natural=True, a natural-like Zipf popularity whose hottest expert
    gets NATURAL_MAX_OVER_MEAN x the mean load (as measured on real routing in the paper, 2.2).

    method "exact": token-level top-k draws (R * T * E random numbers: slow at EP 1024); "sampled": the
    per-expert selection probabilities p_e from probe_tokens token-level draws, then every rank's counts
    ~ Multinomial(T * k, p / k) (same expectation and nearly the same variance; a token's k choices are
    not forced to be distinct); "auto": exact when R * T * E <= EXACT_LIMIT."""
    if natural == (router_skew is not None):
        raise ValueError("give exactly one of router_skew=<float> or natural=True")
    if method not in ("auto", "exact", "sampled"):
        raise ValueError(f"method must be 'auto', 'exact' or 'sampled', got {method!r}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
    if natural:
        logw, noise = _zipf_log_weights(num_experts, num_ranks, natural_alpha(num_experts, top_k), seed, layout), "gumbel"
    else:
        logw, noise = workloads.expert_bias(num_experts, router_skew, num_ranks=num_ranks, seed=seed, layout=layout), "normal"
    if method == "exact" or (method == "auto" and num_ranks * tokens_per_rank * num_experts <= EXACT_LIMIT):
        return workloads.routing_from_logits_bias(num_ranks, tokens_per_rank, top_k, logw.float(), noise, seed)
    p = _selection_prob(logw.float(), top_k, noise, seed, probe_tokens)
    g = torch.Generator().manual_seed(seed + 4242)
    draws = torch.multinomial((p / top_k).float().expand(num_ranks, -1), tokens_per_rank * top_k, replacement=True,
                              generator=g)
    return workloads.routing_counts(draws.view(num_ranks, tokens_per_rank, top_k), num_experts)


# -- traffic accounting ------------------------------------------------------------------------------
def link_loads(flows: torch.Tensor, domain_of: torch.Tensor) -> dict[str, torch.Tensor]:
    """`topoep.links.link_loads` as a dict of float64[R] (nvl_out, nvl_in, nic_out, nic_in)."""
    return links.link_loads(flows, domain_of).as_dict()


def token_link_loads(plan: Plan, token_bytes: float, top_k: int, dedup: bool) -> dict[str, torch.Tensor]:
    """Per-GPU bytes of one token transfer (a dispatch; the combine is its mirror image, same busiest link):
    `topoep.links.token_loads` at `token_bytes` per row, deduplicated (DeepEP) when `dedup`."""
    return links.token_loads(plan, top_k if dedup else None, token_bytes).as_dict()


def transfer_time(loads: dict[str, torch.Tensor], cluster: Cluster) -> tuple[float, dict]:
    """(seconds, busiest links) of one transfer: latency + the busiest GPU link's bytes / bandwidth.
    NVLink and NIC run concurrently; the latency is RDMA's if any byte crosses domains."""
    nvl = torch.maximum(loads["nvl_out"], loads["nvl_in"])
    nic = torch.maximum(loads["nic_out"], loads["nic_in"])
    nvl_max, nic_max = nvl.max().item(), nic.max().item()
    busy = {"nvlink_bytes": nvl_max, "nvlink_rank": int(nvl.argmax()), "nic_bytes": nic_max, "nic_rank": int(nic.argmax()),
            "intra_bytes": loads["nvl_out"].sum().item(), "inter_bytes": loads["nic_out"].sum().item()}
    if nvl_max == 0 and nic_max == 0:
        return 0.0, busy
    lat = cluster.rdma_latency_s if nic_max > 0 else cluster.nvlink_latency_s
    return lat + max(nvl_max / cluster.nvlink_bytes_per_s, nic_max / cluster.rdma_bytes_per_s), busy


# -- schedule ----------------------------------------------------------------------------------------
def overlapped_forward(plan: Plan, tok_loads: dict, rep_loads: dict, t_rep: float, t_chunk: float,
                       cluster: Cluster, n: int, t_ffn: float, expert_overhead_s: float) -> float:
    """The forward pipeline (dispatch, compute, combine of n chunks; `pipeline`) with the replica fetch running
    beside it (`Execution.fetch_overlap`), from the plan's start: seconds.

    Links: the fetch (its own time t_rep; link loads rep_loads, a relayed fetch's steps summed) goes first on every
    link it shares with the n dispatches (t_chunk each, loads tok_loads): the runtime issues it first, on a
    high-priority stream. So the fetch ends at t_rep, and the dispatches end no earlier than the busiest of their own
    links carrying both transfers' bytes (`transfer_time` of the summed loads on the links the dispatch uses); they
    are stretched evenly to that end: by the time the fetch's bytes add to the busiest link beyond the dispatches'
    own busiest link (n chunks pay n latencies either way).
    Compute, per rank: chunk i's main-expert rows (1/n of the rank's main load) start once dispatch i and the rank's
    previous chunk are done; its slot rows then wait for the fetch, which ends with a barrier of the group (every
    rank waits, slot rows or not: the host does not know). A combine waits for every rank's chunk (a collective)."""
    main, slot = region_loads(plan).double().unbind(1)  # each rank's rows on main experts and on slots
    # the fetch's bytes delay the dispatches by what the busiest shared link carries beyond the dispatches' own
    # busiest link (both `transfer_time`s pay one latency, so the difference is bandwidth only; each chunk keeps its own)
    shared, _ = transfer_time({k: (tok_loads[k] + rep_loads[k]) * (tok_loads[k] > 0) for k in tok_loads}, cluster)
    alone, _ = transfer_time(tok_loads, cluster)
    return float(links.overlapped_forward_s(main, slot, t_ffn, t_chunk, shared - alone, t_rep, n, expert_overhead_s))


# paper 3.3's two-stream chunk schedule: topoep.links.chunk_pipeline (the guard predicts with it too)
pipeline = chunk_pipeline


@dataclass
class SimResult:
    """One simulated layer call. Times in seconds, traffic in bytes (module docstring)."""

    policy: str
    num_ranks: int
    num_domains: int
    num_slots: int
    layer_s: float
    forward_s: float
    backward_s: float
    exposed: dict
    """plan, replica, compute, token, overhead: sums to layer_s."""
    terms: dict
    """Raw phase times: plan (gather, guard and solve included), gather, guard (the net-benefit guard's GPU time,
    `gpu_guard_s`, in guarded calls), fetch, reload, grad_return, dispatch/combine per pass, expert
    compute of the straggler and of the mean rank, forward and backward."""
    traffic: dict
    """Bytes: busiest NVLink / NIC of one token transfer and of one replica transfer, totals."""
    stats: dict
    """imbalance, internode_fraction, replica_fraction, num_replicas, static_imbalance."""
    tokens_per_s: float
    """Cluster-wide MoE-layer throughput: tokens of omega (all ranks) / layer_s."""
    dense_s: float = 0.0
    """Non-expert time of the layer (model.dense_flops_per_token at the GEMM throughput)."""
    memory: dict = field(default_factory=dict)
    """Per-rank bytes of the layer on backend cuda (topoep.memory.LayerMemory): buffers, slots, kept, peak, total."""

    def row(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}
        for group in ("exposed", "terms", "traffic", "stats", "memory"):
            out.update({f"{group}.{k}": v for k, v in getattr(self, group).items()})
        return out


def async_fetch_s(plan: Plan, source: torch.Tensor, level: torch.Tensor, loads: dict, cluster: Cluster,
                  copy_bytes: float) -> float:
    """Execution.relay_schedule "async": seconds of a relayed fetch whose copies each leave as soon as their source
    holds them: the longer of its busiest link over the whole fetch (`loads`: every level's bytes per link, summed)
    and its longest chain of hops (`topoep.relay.copy_arrival`, each hop one copy of `copy_bytes` at that link's
    bandwidth plus its latency: NVLink inside a domain, the NIC across), the model of `topoep.relay.async_fetch_fs` at
    the cluster's bandwidths and latencies. Optimistic: a real schedule also waits where a chain's hop finds its link
    busy."""
    busiest = transfer_time(loads, cluster)[0]
    dom = plan.topology.domain_of
    same = dom[:, None] == dom[None, :]
    hop = torch.where(same, copy_bytes / cluster.nvlink_bytes_per_s + cluster.nvlink_latency_s,
                      copy_bytes / cluster.rdma_bytes_per_s + cluster.rdma_latency_s).double()
    chain = copy_arrival(plan, source, level, hop).max().item() if source.numel() else 0.0
    return max(busiest, chain)


def gpu_planner_s(num_ranks: int, policy: str = "topoep", ranks_per_domain: int = 8) -> float:
    """GPU planner latency (GPU_PLANNER_US; GPU_PLANNER_PLUS_US for topoep_plus), with what domains of
    ranks_per_domain add to the refinement of a policy that runs it (GPU_DOMAIN_EXTRA_US, REFINED_POLICIES; more than
    one such domain: GPU_GROUPS_EXTRA_SCALE)."""
    plus = policy.startswith("topoep_plus")
    t = _interpolated_s(GPU_PLANNER_PLUS_US if plus else GPU_PLANNER_US, num_ranks)
    if policy in REFINED_POLICIES and ranks_per_domain > 8:
        extra = _interpolated_s(GPU_DOMAIN_EXTRA_PLUS_US if plus else GPU_DOMAIN_EXTRA_US, ranks_per_domain)
        t += extra * (GPU_GROUPS_EXTRA_SCALE[plus] if num_ranks > ranks_per_domain else 1.0)
    return t


def spread_move_cost_fs(execution: Execution) -> int:
    """The spread planners' stopping threshold (`solve`'s move_cost_fs) for the planner `execution` times them as
    (Execution.spread_planner): "measured", the runtime's default (the measured time per move,
    `spread.MOVE_COST_US`) divided by spread_speedup; "plus", 0: a planner as fast as topoep_plus's takes that time
    whatever its moves, so every move that gains anything is worth making."""
    if execution.spread_planner == "measured":
        return int(round(spread_planner.default_move_cost_fs() / execution.spread_speedup))
    return 0


def gpu_spread_s(num_ranks: int, tree: bool = False, moves: int | None = None) -> float:
    """The CUDA spread planner's latency (GPU_SPREAD_US), or with `tree` the four plans of a relayed topoep_plus layer
    with plus_spread at once (GPU_SPREAD_SET_US); with `moves`, for a call whose greedy made that many moves
    (`topoep.planners.spread.measured_latency_s`)."""
    if moves is not None:
        return spread_planner.measured_latency_s(num_ranks, tree, moves)
    return _interpolated_s(GPU_SPREAD_SET_US if tree else GPU_SPREAD_US, num_ranks)


def gated_planner_s(execution: Execution, num_ranks: int, num_slots: int, policies, moves: int | None = None) -> float:
    """The gated candidates' planning time (the spread gate's): the spread candidates' among `policies`
    (spread_planner_s; `moves`: the call's greedy moves, None: the measured workload's) and the peers' (flexmoe,
    deepseek: their four plans at once, `baselines.peer_set_s`, with Execution.peer_planner "measured", else
    topoep_plus's planner), the longer where both."""
    from topoep.planners.baselines import peer_set_s

    t = spread_planner_s(execution, num_ranks, policies, moves) if set(policies) & set(SPREAD_POLICIES) else 0.0
    if set(policies) & set(PEER_POLICIES):
        t = max(t, peer_set_s(num_ranks, num_slots) if execution.peer_planner == "measured"
                else gpu_planner_s(num_ranks, "topoep_plus"))
    return t


def spread_planner_s(execution: Execution, num_ranks: int, policies, moves: int | None = None) -> float:
    """The spread candidates' planning time as `execution` times them (Execution.spread_planner): the measured CUDA
    spread planner (with a tree candidate among `policies`, the relayed layer's set; with `moves`, for that many
    greedy moves), or topoep_plus's planner."""
    if execution.spread_planner == "measured":
        return gpu_spread_s(num_ranks, "topoep_plus_spread_tree" in policies, moves) / execution.spread_speedup
    return gpu_planner_s(num_ranks, "topoep_plus")


def gpu_guard_s(num_ranks: int, relay: bool = False) -> float:
    """The net-benefit guard's GPU time per layer call (GPU_GUARD_US; GPU_GUARD_RELAY_US with relay trees)."""
    return _interpolated_s(GPU_GUARD_RELAY_US if relay else GPU_GUARD_US, num_ranks)


def gpu_decision_s(num_ranks: int, relay: bool = False, skipped: bool = False) -> float:
    """A guarded topoep_plus layer's whole decision on the GPU per call (GPU_DECISION_*): skipped, where the pre-plan
    bound left planning out (any guarded layer), else planned with its candidates."""
    pts = ((GPU_DECISION_SKIP_RELAY_US if relay else GPU_DECISION_SKIP_US) if skipped else
           (GPU_DECISION_PLUS_RELAY_US if relay else GPU_DECISION_PLUS_US))
    return _interpolated_s(pts, num_ranks)


def gpu_hint_s(num_ranks: int, relay: bool = False) -> float:
    """What a call the slot hint left out adds to the static layer's metadata on the GPU: the bound and the static
    plan (GPU_DECISION_HINT_*) less the static plan alone (GPU_STATIC_PLAN_US), never below 0."""
    hint = _interpolated_s(GPU_DECISION_HINT_RELAY_US if relay else GPU_DECISION_HINT_US, num_ranks)
    return max(0.0, hint - _interpolated_s(GPU_STATIC_PLAN_US, num_ranks))


def gpu_bound_s(num_ranks: int, relay: bool = False) -> float:
    """What a planned guarded call's decision takes beyond its planner and the guard's kernel: the pre-plan bound's
    ops and the planners' stream fork and join. Not measured alone: a guarded topoep_plus layer's measured decision
    (GPU_DECISION_PLUS_US) less the guard (GPU_GUARD_US) and topoep_plus's planner (GPU_PLANNER_PLUS_US), which
    results/guard_latency.md and results/planner_latency.md measured in separate runs; charged to every guarded
    layer that plans."""
    return max(0.0, gpu_decision_s(num_ranks, relay) - gpu_guard_s(num_ranks, relay)
               - gpu_planner_s(num_ranks, "topoep_plus"))


_interpolated_s = spread_planner.interpolated_s


def gather_s(num_ranks: int, num_experts: int, cluster: Cluster) -> float:
    """All-gather of the int64 routing counts: every rank receives (R - 1) * E * 8 bytes, the remote
    domains' part over its NIC; latency * ceil(log2 R) steps."""
    if num_ranks == 1:
        return 0.0
    d = cluster.domain_size(num_ranks)
    intra, inter = (d - 1) * num_experts * 8, (num_ranks - d) * num_experts * 8
    lat = cluster.rdma_latency_s if inter else cluster.nvlink_latency_s
    return lat * math.ceil(math.log2(num_ranks)) + max(intra / cluster.nvlink_bytes_per_s, inter / cluster.rdma_bytes_per_s)


# -- plan cache ------------------------------------------------------------------------------------
PLAN_CACHE_FORMAT = 1


def planner_fingerprint() -> str:
    """sha256 of the planners' source (topoep/plan.py, topology.py, planners/*.py, and the joint policy's
    topoep_research/joint.py, joint_search.py): a cached plan is reused only by the planner code that made it."""
    lib, research = Path(topoep.__file__).resolve().parent, Path(__file__).resolve().parent
    planners = sorted(f"planners/{f.name}" for f in (lib / "planners").glob("*.py"))
    h = hashlib.sha256()
    for root, names in ((lib, ["plan.py", "topology.py", *planners]), (research, ["joint.py", "joint_search.py"])):
        for name in names:
            h.update(f"{root.name}/{name}".encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest()


class PlanCache:
    """Reference plans (`topoep.solve(..., backend="reference")`) on disk, so that reruns of a sweep do
    not replan: the pure-Python planners take seconds per plan at EP 1024 (topoep's token split).

    Content-addressed: the key is a sha256 of everything a reference plan is a function of (omega's
    values, the topology's domains and cost matrices, policy, num_slots, expert and token bytes, t_ffn;
    default main_rank) and of the planners' source (`planner_fingerprint`), so a changed input or planner
    is a miss, never a stale plan. An entry holds slot_expert, route, policy, info and the solve's wall
    time when it was made (returned on a hit: it is a measurement of that solve, not of the read). Only
    solves that took >= min_solve_s are written (compressing a large route costs about as much as a fast
    planner's solve); the last `memory` plans are also kept in memory (a plan asked for twice in a row is
    solved once). Files: root/<key[:2]>/<key>.plan (zlib: a JSON header and two .npy arrays), written
    atomically; an unreadable entry is solved again and overwritten. hits / misses / written count calls."""

    def __init__(self, root, *, min_solve_s: float = 0.5, memory: int = 2):
        self.root = Path(root)
        self.min_solve_s = float(min_solve_s)
        self.memory = int(memory)
        self.fingerprint = planner_fingerprint()
        self.hits = self.misses = self.written = 0
        self._recent: OrderedDict = OrderedDict()

    def key(self, omega: torch.Tensor, topology: Topology, *, num_slots: int, policy: str, expert_bytes: int,
            token_bytes: int, t_ffn: float | None = None, move_cost_fs: int | None = None,
            plan_domain: int | None = None) -> str:
        om = omega.detach().to("cpu", torch.int64).contiguous()
        if policy not in REFINED_POLICIES or topology.planning_groups(plan_domain) is topology:
            plan_domain = None  # changes nothing: the key of the plan on whole domains
        else:
            plan_domain = topology.planning_groups(plan_domain).ranks_per_domain
        head = {"format": PLAN_CACHE_FORMAT, "planner": self.fingerprint, "policy": policy, "num_slots": num_slots,
                "expert_bytes": expert_bytes, "token_bytes": token_bytes, "shape": list(om.shape),
                "t_ffn": float(DEFAULT_T_FFN if t_ffn is None else t_ffn).hex(),  # solve's default
                "move_cost_fs": move_cost_fs, **({"plan_domain": plan_domain} if plan_domain is not None else {}),
                "domains": [topology.num_domains, topology.ranks_per_domain]}
        h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
        for t in (om, topology.cost_fs, topology.cost):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.plan"

    def solve(self, omega: torch.Tensor, topology: Topology, *, num_slots: int, policy: str, expert_bytes: int,
              token_bytes: int, t_ffn: float | None = None, move_cost_fs: int | None = None,
              plan_domain: int | None = None) -> tuple[Plan, float]:
        """(plan, solve seconds): `topoep.solve(omega, topology, ..., backend="reference")`, from the cache
        when the same inputs were solved before. Raises what `topoep.solve` raises for bad input."""
        omega, main_rank = validate(omega, topology, num_slots, policy, expert_bytes, token_bytes, None)
        key = self.key(omega, topology, num_slots=num_slots, policy=policy, expert_bytes=expert_bytes,
                       token_bytes=token_bytes, t_ffn=t_ffn, move_cost_fs=move_cost_fs, plan_domain=plan_domain)
        if key in self._recent:
            self.hits += 1
            self._recent.move_to_end(key)
            plan, solve_s = self._recent[key]
            return self._rebuild(omega, topology, main_rank, plan.slot_expert, plan.route, plan.policy, plan.info,
                                 expert_bytes, token_bytes), solve_s
        got = self._read(key, omega, topology, main_rank, num_slots, expert_bytes, token_bytes)
        if got is not None:
            self.hits += 1
            self._remember(key, *got)
            return got
        t0 = time.perf_counter()
        plan = solve(omega, topology, num_slots=num_slots, policy=policy, expert_bytes=expert_bytes,
                     token_bytes=token_bytes, t_ffn=t_ffn, backend="reference", move_cost_fs=move_cost_fs,
                     plan_domain=plan_domain)
        solve_s = time.perf_counter() - t0
        self.misses += 1
        if solve_s >= self.min_solve_s and self._write(key, plan, solve_s):
            self.written += 1
        self._remember(key, plan, solve_s)
        return plan, solve_s

    def _remember(self, key, plan, solve_s):
        if self.memory > 0:
            self._recent[key] = (plan, solve_s)
            self._recent.move_to_end(key)
            while len(self._recent) > self.memory:
                self._recent.popitem(last=False)

    @staticmethod
    def _rebuild(omega, topology, main_rank, slot_expert, route, policy, info, expert_bytes, token_bytes) -> Plan:
        """A fresh Plan (its cached views are per object) sharing the stored tensors (plans are immutable)."""
        return Plan(omega=omega, topology=topology, num_slots=slot_expert.shape[1], main_rank=main_rank,
                    slot_expert=slot_expert, route=route, policy=policy, info=copy.deepcopy(info),
                    expert_bytes=expert_bytes, token_bytes=token_bytes)

    def _write(self, key: str, plan: Plan, solve_s: float) -> bool:
        try:
            info = json.loads(json.dumps(plan.info))
        except (TypeError, ValueError):
            return False
        if info != plan.info:  # tuples, non-string keys: would not come back identical
            return False
        route = plan.route.detach().cpu()
        lo, hi = (int(route.min()), int(route.max())) if route.numel() else (0, 0)
        dtype = np.uint16 if lo >= 0 and hi < 1 << 16 else np.int32 if lo >= -(1 << 31) and hi < 1 << 31 else np.int64
        head = json.dumps({"format": PLAN_CACHE_FORMAT, "key": key, "policy": plan.policy, "info": plan.info,
                           "solve_s": solve_s}).encode()
        buf = io.BytesIO()
        buf.write(len(head).to_bytes(8, "little") + head)
        np.lib.format.write_array(buf, plan.slot_expert.detach().cpu().numpy(), allow_pickle=False)
        np.lib.format.write_array(buf, route.numpy().astype(dtype), allow_pickle=False)
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(zlib.compress(buf.getvalue(), 1))
            os.replace(tmp, path)
        except OSError:
            return False
        return True

    def _read(self, key, omega, topology, main_rank, num_slots, expert_bytes, token_bytes):
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            raw = zlib.decompress(path.read_bytes())
            n = int.from_bytes(raw[:8], "little")
            head = json.loads(raw[8:8 + n])
            f = io.BytesIO(raw[8 + n:])
            slot_expert = torch.from_numpy(np.lib.format.read_array(f, allow_pickle=False).astype(np.int64))
            route = torch.from_numpy(np.lib.format.read_array(f, allow_pickle=False).astype(np.int64))
        except (OSError, ValueError, zlib.error, EOFError):
            return None
        R, E = omega.shape
        if (head.get("format") != PLAN_CACHE_FORMAT or head.get("key") != key
                or tuple(slot_expert.shape) != (R, num_slots) or tuple(route.shape) != (R, E + R * num_slots)):
            return None
        dev = omega.device
        plan = self._rebuild(omega, topology, main_rank, slot_expert.to(dev), route.to(dev), head["policy"],
                             head["info"], expert_bytes, token_bytes)
        return plan, float(head["solve_s"])


def simulate(plan_or_omega, cluster: Cluster, *, model: ModelShape, execution: Execution | None = None,
             policy: str = "topoep", num_slots: int = 2, plan_s: float | None = None, guard=None,
             plan_cache: PlanCache | None = None,
             plus_candidates: tuple[str, ...] = ("topoep_plus_local",), force_choice: int | None = None,
             _solved: dict | None = None) -> SimResult:
    """Predicted time of one MoE layer call (forward + backward) on `cluster`.

    plan_or_omega: a `Plan` (its topology must match cluster.topology(R)'s domains) or omega int64[R, E],
        which is planned here with `policy` and `num_slots` (the solve is timed: host planners' plan time).
    execution: default EXECUTIONS["topoep"]. plan_s: planner seconds to use instead of the model.
    guard: a `topoep.runtime.NetBenefitGuard` to apply to the plan (as the runtime does; its GPU time, `gpu_guard_s`,
        is part of the plan time of every guarded call), or None. With a
        deduplicating execution (`Execution.dedup`) a guard that prices a row per assignment prices the tokens
        as the execution sends them instead (token_top_k = the model's top-k), and with relayed fetches
        (`Execution.relay_fanout`) it prices them level by level (the guard's relay_fanout).
    plan_cache: a `PlanCache` to plan omega through (the same plan; its solve time is the one measured
        when the plan was made), or None: solve here.
    plus_candidates: the other policies a guarded topoep_plus layer plans at the same time, of which the guard keeps
        the fastest by its prediction (the runtime's: topoep_plus_local; add "topoep_plus_spread" for the layer
        with the link-aware spread candidate, `topoep.planners.spread`). The candidates run at once on the GPU: one
        planner latency, topoep_plus's, or with `execution.spread_planner="measured"` the measured CUDA spread
        planner's where a spread plan is among them.
    force_choice: research (an oracle of the guard's pick): a guarded topoep_plus layer runs plan `force_choice` of
        the plans it planned in this call (0 its own, i >= 1 the i-th candidate planned, -1 the static plan) instead
        of the guard's pick, with the guard's fetch choice (relayed or direct) for that plan and every cost of the
        call as planned; stats["plans_planned"] says how many plans there were (after the spread gate). None: the
        guard picks.
    """
    execution = execution or EXECUTIONS["topoep"]
    guard_in, solved = guard, {}  # (the spread gate's second call: the arguments as given, the plans made)
    _solved = _solved or {}
    measured = None
    if isinstance(plan_or_omega, Plan):
        plan = plan_or_omega
        topo = cluster.topology(plan.num_ranks)
        if plan.topology.ranks_per_domain != topo.ranks_per_domain:
            raise ValueError(f"the plan was made for domains of {plan.topology.ranks_per_domain} ranks but cluster "
                             f"{cluster.name!r} has domains of {topo.ranks_per_domain} at EP {plan.num_ranks}: plan "
                             "with cluster.topology(R)")
        if (plan.expert_bytes, plan.token_bytes) != (model.expert_bytes, model.token_bytes):
            raise ValueError(f"the plan was made for expert_bytes={plan.expert_bytes}, token_bytes={plan.token_bytes} "
                             f"but model {model.name!r} has {model.expert_bytes}, {model.token_bytes}")
    else:
        omega = plan_or_omega
        if not isinstance(omega, torch.Tensor) or omega.dim() != 2:
            raise ValueError("plan_or_omega must be a topoep.Plan or an int64[R, E] routing matrix")
    t_ffn = cluster.t_ffn(model)
    n_rep = execution.exposed_replica_transfers
    if guard is not None and execution.dedup and guard.token_top_k is None:
        guard = replace(guard, token_top_k=model.top_k)
    if guard is not None and execution.relay_fanout is not None:  # the guard prices the relayed fetch that runs
        guard = guard.pricing_relays(execution.relay_fanout, execution.relay_chunks, execution.relay_share,
                                      execution.relay_schedule)
    if guard is not None and execution.fetch_overlap and not guard.fetch_overlap:  # and the fetch beside the dispatch
        guard = replace(guard, fetch_overlap=True)
    given = isinstance(plan_or_omega, Plan)
    if given:
        omega, topo, main_rank, name, N = plan.omega, plan.topology, plan.main_rank, plan.policy, plan.num_slots
    else:
        topo, name, N = cluster.topology(omega.shape[0]), policy, num_slots
        main_rank = default_main_rank(omega.shape[1], omega.shape[0])
    guarded = guard is not None and name != "static" and N > 0
    # the guard's pre-plan bound: where no plan can pay, the static plan runs and no planner does
    skipped = guarded and not bool(guard.worth_planning(omega, topo, main_rank, t_ffn, model.expert_bytes, n_rep))
    candidates, local_plan, choice = (), 0.0, 0.0
    gate, R_omega = None, omega.shape[0]  # the spread gate's verdict (None: no gate ran)
    if skipped:
        plan = solve(omega, topo, num_slots=N, policy="static", expert_bytes=model.expert_bytes,
                     token_bytes=model.token_bytes)
        plan.policy = name  # the policy's call, which ran the static plan
        measured = 0.0  # nothing was solved
    elif not given:
        # guarded topoep_plus plans its local candidate too (at the same time on the GPU: one planner latency)
        plans = []
        for each in (name, *plus_candidates) if guarded and name == "topoep_plus" else (name,):
            kw = dict(num_slots=N, policy=each, expert_bytes=model.expert_bytes, token_bytes=model.token_bytes,
                      t_ffn=t_ffn, move_cost_fs=spread_move_cost_fs(execution) if each in SPREAD_POLICIES else None,
                      plan_domain=execution.plan_domain if each in REFINED_POLICIES else None)
            if each in _solved:  # the spread gate's call for the other candidates' layer: the plans made already
                p, m = _solved[each]
            elif plan_cache is not None:
                p, m = plan_cache.solve(omega, topo, **kw)
            else:
                t0 = time.perf_counter()
                p = solve(omega, topo, backend="reference", **kw)
                m = time.perf_counter() - t0
            plans.append(p)
            solved[each] = (p, m)
            measured = m if measured is None else max(measured, m)
        plan, candidates = plans[0], tuple(plans[1:])
    gate_cheap = None  # the spread gate on: the other candidates' layer, which its probes run
    if guarded and not skipped and execution.spread_gate and name == "topoep_plus":
        cheap = tuple(p for p in candidates if p.policy not in SPREAD_POLICIES + PEER_POLICIES)
        if len(cheap) < len(candidates):  # the spread gate in steady state (one routing stands for every call)
            net = []
            for cands in (cheap, candidates):
                executed, fired, saved, cost = guard.select(plan, t_ffn, n_rep, candidates=cands)
                net.append(0.0 if bool(fired) else float(saved - cost))
            choice_all = int(executed.info["guard_choice"])
            gate = (choice_all > len(cheap) and not bool(fired)
                    and net[1] - net[0] > gated_planner_s(execution, R_omega, N, plus_candidates))
            if gate:
                gate_cheap = simulate(omega, cluster, model=model, policy=name, num_slots=N,
                                      execution=replace(execution, spread_gate=False), guard=guard_in,
                                      plus_candidates=tuple(p.policy for p in cheap), plan_cache=plan_cache,
                                      _solved=solved)
            else:  # the spread planner runs on probe calls only: the other candidates' plan on every call
                candidates = cheap
    planned = 1 + len(candidates) if guarded and not skipped else 0
    if force_choice is not None:
        if not guarded or skipped or name != "topoep_plus" or not -1 <= force_choice < planned:
            raise ValueError(f"force_choice={force_choice} picks one of the {planned} plans a guarded topoep_plus layer "
                             f"planned in this call, or -1 (static); this call (policy {name!r}, guarded {guarded}, "
                             f"planning skipped {skipped}) has none to pick")
        if force_choice < 0:
            plan = guard.select(plan, t_ffn, n_rep, allow=torch.zeros((), dtype=torch.bool))[0]
        else:
            kept = (plan, *candidates)[force_choice]
            relay = guard.fetch_choice(kept, n_rep)[1]
            plan = guard._executed(kept, kept.slot_expert, kept.route, torch.tensor(force_choice), relay)
        choice = float(max(force_choice, 0))
        local_plan = float(choice >= 1 and candidates[int(choice) - 1].policy == "topoep_plus_local")
    elif guarded and not skipped:
        plan, fired = guard.select(plan, t_ffn, n_rep, candidates=candidates)[:2]
        choice = float(int(plan.info["guard_choice"])) if candidates and not bool(fired) else 0.0
        local_plan = float(choice == 1 and plus_candidates[:1] == ("topoep_plus_local",))
    R, E, n = plan.num_ranks, plan.num_experts, execution.num_chunks
    dom, rpd = plan.topology.domain_of, plan.topology.ranks_per_domain
    plan_rpd = plan.topology.planning_groups(execution.plan_domain).ranks_per_domain  # what the refinement runs on
    S, W = float(model.token_bytes), float(model.expert_bytes)

    # plan (and the guard's selection on the device, which a guarded layer runs in every call). Where its pre-plan
    # bound left planning out (the host never reads that decision), the whole measured decision: the bound, the
    # planners writing the static plan and the guard pricing nothing
    relayed = execution.relay_fanout is not None
    t_guard = 0.0
    if guarded and execution.plan_s is None:
        t_guard = ((gpu_hint_s(R, relayed) if execution.slot_hint else gpu_decision_s(R, relayed, skipped=True))
                   if skipped else gpu_guard_s(R, relayed))
    if execution.plan_s is not None:  # a calibrated execution: its fitted constants, all included
        t_plan, t_gather = (execution.static_plan_s if plan.policy == "static" or skipped else execution.plan_s), 0.0
    elif plan.policy == "static" or skipped:
        t_gather = gather_s(R, E, cluster)
        t_plan = t_gather + execution.static_plan_s + t_guard
    else:
        t_gather = gather_s(R, E, cluster)
        spread = {p.policy for p in (plan, *candidates)} & set(SPREAD_POLICIES)
        # the greedy moves of this call's spread plans (the planners run at once: the longer chain sets the time)
        spread_moves = max((int(p.info["greedy_moves"]) for p, _ in solved.values()
                            if p.policy in SPREAD_POLICIES and "greedy_moves" in p.info), default=None)
        peers = {p.policy for p in candidates} & set(PEER_POLICIES)
        if plan_s is not None:
            solve_s = plan_s
        elif gate is not None:  # on: the spread planner beside the others (its probes: gate_cheap); off: on probes
            spread_s = gated_planner_s(execution, R, N, plus_candidates, spread_moves)
            plus_s = gpu_planner_s(R, "topoep_plus", plan_rpd)
            solve_s = _interpolated_s(GPU_SPREAD_GATE_ONE_DOMAIN_US if plan_rpd == R else GPU_SPREAD_GATE_US, R) + (
                max(plus_s, spread_s) if gate else plus_s + max(0.0, spread_s - plus_s) / execution.spread_probe)
        elif ((spread and execution.spread_planner == "measured")
              or (peers and execution.peer_planner == "measured")):  # csrc/spread.cu, csrc/peers.cu beside the pair
            solve_s = gated_planner_s(execution, R, N, spread | peers, spread_moves)
            if candidates:  # beside topoep_plus's own plans: the longer chain sets the time (a large domain's
                # refinement, or a spread greedy that stopped after a few moves, can make topoep_plus's the longer)
                solve_s = max(solve_s, gpu_planner_s(R, "topoep_plus", plan_rpd))
        elif execution.peers_on_gpu and plan.policy in PEER_POLICIES and not candidates:
            solve_s = peer_solo_s(plan.policy, R, N)  # csrc/peers.cu, as this runtime runs a peer's layer
        elif candidates or (plan.policy in CUDA_POLICIES and plan.policy not in SPREAD_POLICIES + PEER_POLICIES):
            # candidates: planned beside topoep_plus on the GPU
            solve_s = gpu_planner_s(R, name if candidates else plan.policy, plan_rpd)
        else:  # a host planner; the peers' policies too, as their own systems plan them (csrc/peers.cu's GPU time,
            # baselines.peer_set_s, is a topoep_plus layer's with plus_peers: Execution.peer_planner)
            host = measured if execution.measured_host_plan and measured is not None else gpu_planner_s(R)
            solve_s = execution.host_round_trip_s + R * E * 8 / cluster.host_bytes_per_s + host
        if guarded and plan_s is None:  # the pre-plan bound and the planners' streams, as every guarded layer runs
            solve_s += gpu_bound_s(R, relayed)
        t_plan = t_gather + solve_s + t_guard

    # tokens: one transfer of each chunk carries 1/n of every flow
    tok_loads = token_link_loads(plan, S, model.top_k, execution.dedup)
    t_tok_full, tok_busy = transfer_time(tok_loads, cluster)
    t_chunk, _ = transfer_time({k: v / n for k, v in tok_loads.items()}, cluster)
    t_chunk += execution.comm_overhead_s / (4 * n)

    # replicas; relayed: (source, level) of every slot's fetch as it runs
    B = replica_matrix(plan)
    has_rep = bool(B.any())
    fetch = executed_sources(plan, execution.relay_fanout) if execution.relay_fanout is not None else None
    rep_loads = link_loads(B.double() * W, dom)
    t_rep, rep_busy = transfer_time(rep_loads, cluster)
    if has_rep and fetch is not None:  # the relay trees' steps (levels overlapping in chunks), one after the other
        C = execution.relay_chunks
        step_loads = [link_loads(step.double() * (W / C), dom) for step in relay_steps(relay_levels(plan, *fetch), C)]
        t_rep = sum(transfer_time(loads, cluster)[0] for loads in step_loads)
        rep_loads = {k: sum(loads[k] for loads in step_loads) for k in rep_loads}
        if execution.relay_schedule == "async":
            t_rep = async_fetch_s(plan, *fetch, rep_loads, cluster, W)
    t_rep = t_rep + execution.replica_latency_s if has_rep else 0.0

    # compute: the straggler's chunks (collectives wait for it)
    L = plan.rank_load.double()
    x_max = execution.expert_overhead_s + t_ffn * L.max().item()
    x_mean = execution.expert_overhead_s + t_ffn * L.mean().item()
    xf = [x_max / 3 / n] * n
    d, c = [t_chunk] * n, [t_chunk] * n
    rows_max = float(plan.omega.sum(1).max())  # the busiest source's assignments (T * k; omega decides, not model)
    overhead = execution.layer_overhead_s + execution.row_overhead_s * rows_max

    if execution.pipelined:
        fwd_pipe = max(pipeline(d, xf, c))
        # the forward's replica time: the fetch before the pipeline, or what the pipeline waits for it beside it
        fwd_rep = t_rep
        if execution.fetch_overlap and has_rep:
            fwd_rep = overlapped_forward(plan, tok_loads, rep_loads, t_rep, t_chunk, cluster, n, t_ffn,
                                         execution.expert_overhead_s) - fwd_pipe

        def bwd(reload: float, ret: float) -> float:
            comm, comp = pipeline(d, xf, c, compute_ready=reload, tail_compute=x_max / 3)
            return max(comm, comp + ret)

        reload = 0.0 if execution.reload_hidden else t_rep
        ret = 0.0 if execution.grad_return_hidden else t_rep
        bwd_pipe = bwd(reload, ret)
        bwd_bare = bwd(0.0, 0.0)
        rep_bwd_exposed = bwd_pipe - bwd_bare
    else:
        fwd_pipe = 2 * n * t_chunk + x_max / 3
        fwd_rep = t_rep
        bwd_bare = 2 * n * t_chunk + 2 * x_max / 3
        rep_bwd_exposed = t_rep * ((not execution.reload_hidden) + (not execution.grad_return_hidden))
        bwd_pipe = bwd_bare + rep_bwd_exposed
    forward = t_plan + fwd_rep + fwd_pipe
    layer = forward + bwd_pipe + overhead
    token_exposed = fwd_pipe + bwd_bare - x_max
    exposed = {"plan": t_plan, "replica": fwd_rep + rep_bwd_exposed, "compute": x_max, "token": token_exposed,
               "overhead": overhead}
    terms = {"plan": t_plan, "gather": t_gather, "guard": t_guard, "reference_solve_measured": measured, "fetch": t_rep,
             "reload": t_rep, "grad_return": t_rep,
             "dispatch_combine_fwd": 2 * n * t_chunk, "dispatch_combine_bwd": 2 * n * t_chunk,
             "token_transfer_unchunked": t_tok_full, "expert_fwd_straggler": x_max / 3,
             "expert_bwd_straggler": 2 * x_max / 3, "expert_fwd_mean": x_mean / 3, "expert_bwd_mean": 2 * x_mean / 3}
    traffic = {f"token_{k}": v for k, v in tok_busy.items()} | {f"replica_{k}": v for k, v in rep_busy.items()}
    traffic["token_total_per_layer"] = 4 * (traffic["token_intra_bytes"] + traffic["token_inter_bytes"])
    traffic["replica_total_per_layer"] = 3 * (traffic["replica_intra_bytes"] + traffic["replica_inter_bytes"])
    m = metrics(plan)
    stats = {k: m[k] for k in ("imbalance", "static_imbalance", "internode_fraction", "replica_fraction", "num_replicas")}
    stats["local_plan"] = local_plan  # 1: guarded topoep_plus ran its local candidate (topoep_plus_local)
    stats["guard_choice"] = choice  # guarded topoep_plus: i >= 1 when it ran plus_candidates[i - 1], else 0
    stats["plan_skipped"] = float(skipped)  # 1: the guard's pre-plan bound left planning out
    stats["plans_planned"] = float(planned)  # a guarded layer's plans in this call (force_choice picks among them)
    # the busiest senders of the fetch as it runs (relayed or direct): copies per rank, and of one expert
    sends = sender_copies(plan, fetch[0] if fetch is not None else None)
    stats.update({f"sends_{k}": float(v) for k, v in sends.items()})
    dense = rows_max / model.top_k * model.dense_flops_per_token / cluster.gemm_flops_per_s
    mem = model_memory(model, R, plan.num_slots, execution.capacity_factor, slots_used=has_rep)
    if gate_cheap is not None:  # one planned call in spread_probe (the gate's probe) runs the other candidates' plan
        p = execution.spread_probe
        layer = ((p - 1) * layer + gate_cheap.layer_s) / p
        forward = ((p - 1) * forward + gate_cheap.forward_s) / p
        bwd_pipe = ((p - 1) * bwd_pipe + gate_cheap.backward_s) / p
        exposed = {k: ((p - 1) * v + gate_cheap.exposed[k]) / p for k, v in exposed.items()}  # still sums to layer
    stats["spread_gate"] = float(gate) if gate is not None else -1.0  # 1 on, 0 off, -1 no gate
    return SimResult(policy=plan.policy, num_ranks=R, num_domains=plan.topology.num_domains, num_slots=plan.num_slots,
                     layer_s=layer, forward_s=forward, backward_s=bwd_pipe,
                     exposed=exposed, terms=terms, traffic=traffic, stats=stats,
                     tokens_per_s=float(plan.omega.sum()) / model.top_k / layer, dense_s=dense,
                     memory=dict(buffers=mem.buffers, slots=mem.slots, kept=mem.kept, peak=mem.peak, total=mem.total))


def model_memory(model: ModelShape, num_ranks: int, num_slots: int, capacity_factor: float | None,
                 slots_used: bool = True):
    """topoep.memory.layer_memory of one layer of `model` at EP num_ranks (the model's tokens per rank)."""
    from topoep.memory import layer_memory

    return layer_memory(num_ranks=num_ranks, num_experts=model.num_experts, hidden=model.hidden_size,
                        ffn_hidden=model.ffn_hidden_size, top_k=model.top_k, tokens=model.tokens_per_rank,
                        num_slots=num_slots, slots_used=slots_used, capacity_factor=capacity_factor,
                        dtype_bytes=model.dtype_bytes)


# -- calibration on the GPU machine ------------------------------------------------------------------
@dataclass
class MeasuredCase:
    """One measured layer of bench/moe_layer.py with the plan it executed (reconstructed on the CPU)."""

    tokens: int
    workload: str
    policy: str
    plan: Plan
    measured_ms: float
    phases_ms: dict
    """plan, fetch, dispatch_combine, experts (straggler), grad_return (serialised phase times)."""
    experts_ms_per_rank: list
    guard_fired: bool | None = None
    backend: str = "torch"
    """The runtime backend that ran it (the row's `<backend>/<policy>`): picks the execution `calibrate` fits."""


def measured_cases(path, backend: str = "torch") -> list[MeasuredCase]:
    """The `<backend>/static` and `<backend>/topoep` rows of a bench/moe_layer.py JSON, each with the plan
    it executed: the routing is regenerated exactly as the bench does, planned by the reference
    planner, and where the net-benefit guard fired (the row's `guard` share is 1) replaced by the static
    plan. Megatron's rows are not cases (its per-expert loop is another program). backend: "torch" or
    "cuda" (bench/moe_layer.py's layer backends)."""
    data = json.loads(Path(path).read_text())
    cfg = data["config"]
    R, E, H, F, k = cfg["world"], cfg["experts"], cfg["hidden"], cfg["ffn"], cfg["topk"]
    rpd = cfg.get("ranks_per_domain") or R
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    W, S = 3 * H * F * 2, H * 2  # bf16
    cases = []
    for r in data["rows"]:
        be, _, pol = r["layer"].partition("/")
        if be != backend or pol not in POLICIES or "guard" in pol:
            continue
        T = r["tokens"]
        if r["layout"] == "balanced":
            idx = workloads.balanced_topk(R, E, T, k)
        else:
            layout = "random" if r["layout"] == "uniform" else r["layout"]
            idx = workloads.biased_topk(R, E, T, k, r["router_skew"], seed=cfg["seed"], layout=layout)
        omega = workloads.routing_counts(idx, E)
        plan = solve(omega, topo, num_slots=cfg["slots"], policy=pol, expert_bytes=W, token_bytes=S, backend="reference")
        fired = None
        if pol != "static" and cfg["slots"] > 0 and r.get("guard_fired") is not None:
            fired = r["guard_fired"] >= 0.5  # what ran (the guard of those runs priced compute and replicas only)
            if fired:
                plan = solve(omega, topo, num_slots=cfg["slots"], policy="static", expert_bytes=W, token_bytes=S)
        phases = {p: r[f"{p}_ms"] for p in ("plan", "fetch", "dispatch_combine", "experts", "grad_return")}
        cases.append(MeasuredCase(tokens=T, workload=r["workload"], policy=pol, plan=plan, measured_ms=r["ms"],
                                  phases_ms=phases, experts_ms_per_rank=list(r["experts_ms_per_rank"]),
                                  guard_fired=fired, backend=backend))
    if not cases:
        raise ValueError(f"{path} has no '{backend}/static' or '{backend}/topoep' rows to calibrate on")
    return cases


@dataclass
class Calibration:
    """What `calibrate` fitted: the cluster (GEMM throughput, NVLink), the execution's overheads."""

    cluster: Cluster
    execution: Execution
    model: ModelShape
    fitted: dict = field(default_factory=dict)
    """Every fitted constant by name (seconds, bytes/s, FLOP/s) and the number of cases used."""


def _lstsq(X: list[list[float]], y: list[float]) -> list[float]:
    sol = torch.linalg.lstsq(torch.tensor(X, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)[:, None])
    return sol.solution.flatten().tolist()


# How `calibrate` fits each backend's fixed costs by default (see calibrate).
CALIBRATION_FIXED = {"torch": "phases", "cuda": "totals"}


def calibrate(cases: list[MeasuredCase], *, base: Cluster | None = None, pipelined: bool = False,
              fixed: str | None = None) -> Calibration:
    """Fit the model's constants on measured cases of one backend, each from the measurement it explains
    (never per case). The slopes always come from the serialised phases:

      experts phase per rank   = x0 + t_ffn * L_r                          -> t_ffn (GEMM FLOP/s)
      dispatch_combine phase   = c0 + 4 chunks' transfers                  -> NVLink bandwidth

    The fixed costs, by `fixed` (default CALIBRATION_FIXED[backend]):
      "phases"  each phase's own fixed part: x0 -> expert_overhead, c0 -> comm_overhead; fetch + grad_return
                = 3 * (replica_latency + bytes / NVLink) over the cases with replicas; plan phase means ->
                static_plan_s / plan_s; then total - modelled layer = layer_overhead + row_overhead * T * k.
                Right when the phases' fixed parts are paid in the layer as timed (backend torch: every
                phase is blocking and host-synchronised anyway).
      "totals"  the phases' intercepts are not used (they include host launch time that a stream without
                host syncs overlaps with earlier GPU work): total - (t_ffn * L_max + token and replica bytes
                / NVLink + latencies) = layer_overhead + row_overhead * T * k + plan_s * [balancing policy]
                (plan_s: what a balancing call adds to a static one: planner, guard, slot-pool kernels).
                Backend cuda.
    The execution is EXECUTIONS[backend] (its chunks, overlap and hidden transfers) with the fitted constants;
    `pipelined` swaps in the two-chunk schedule of paper 3.3 (for comparison). The T * k term is fitted only
    when the cases have more than one token count, the balancing term only when both kinds of policy are
    there. Negative fits of fixed costs are clamped to 0 in the execution (`fitted` keeps the raw values)."""
    base = base or CLUSTERS["h200"]
    backends = {c.backend for c in cases}
    if len(backends) != 1:
        raise ValueError(f"calibrate: the cases must come from one backend, got {sorted(backends)}")
    backend = backends.pop()
    if backend not in CALIBRATION_FIXED:
        raise ValueError(f"calibrate: no execution for backend {backend!r}; known: {', '.join(CALIBRATION_FIXED)}")
    fixed = fixed or CALIBRATION_FIXED[backend]
    if fixed not in ("phases", "totals"):
        raise ValueError(f"fixed must be 'phases' or 'totals', got {fixed!r}")
    template = EXECUTIONS[backend]
    n = 2 if pipelined else template.num_chunks
    p0 = cases[0].plan
    H = int(p0.token_bytes // 2)
    F = int(p0.expert_bytes // (3 * 2 * H))
    k = int(p0.omega.sum().item() // (p0.num_ranks * cases[0].tokens))
    model = ModelShape(name="bench", hidden_size=H, ffn_hidden_size=F, num_experts=p0.num_experts, top_k=k,
                       tokens_per_rank=cases[0].tokens)
    X, y = [], []
    for c in cases:
        for L, t in zip(c.plan.rank_load.tolist(), c.experts_ms_per_rank):
            X.append([1.0, float(L)])
            y.append(t * 1e-3)
    x0, t_ffn = _lstsq(X, y)
    if t_ffn <= 0:
        raise ValueError("calibrate: the experts phase does not grow with the rank load in these cases")
    gemm = FLOPS_PER_ASSIGNMENT_FACTOR * H * F / t_ffn
    X, y = [], []
    for c in cases:
        if c.plan.topology.num_domains > 1:
            raise ValueError("calibrate: cases must run in one NVLink domain (no RDMA term is fitted)")
        loads = link_loads(token_matrix(c.plan).double() * c.plan.token_bytes, c.plan.topology.domain_of)
        X.append([1.0, 4.0 * torch.maximum(loads["nvl_out"], loads["nvl_in"]).max().item()])
        y.append(c.phases_ms["dispatch_combine"] * 1e-3 - 4 * n * base.nvlink_latency_s)
    comm0, inv_bw = _lstsq(X, y)
    if inv_bw <= 0:
        raise ValueError("calibrate: the dispatch/combine phase does not grow with the busiest link's bytes")
    cluster = replace(base, gemm_flops_per_s=gemm, nvlink_bytes_per_s=1.0 / inv_bw)
    rep = []
    for c in cases:
        B = replica_matrix(c.plan)
        if B.any():
            t, _ = transfer_time(link_loads(B.double() * c.plan.expert_bytes, c.plan.topology.domain_of), cluster)
            rep.append(((c.phases_ms["fetch"] + c.phases_ms["grad_return"]) * 1e-3 - 3 * t) / 3)
    rep_lat = max(0.0, sum(rep) / len(rep)) if rep else 0.0
    mean = lambda v: sum(v) / len(v) if v else 0.0  # noqa: E731
    static_plan = mean([c.phases_ms["plan"] * 1e-3 for c in cases if c.policy == "static"])
    plan_phase = mean([c.phases_ms["plan"] * 1e-3 for c in cases if c.policy != "static"])
    ex = replace(template, pipelined=pipelined, num_chunks=n, layer_overhead_s=0.0, row_overhead_s=0.0,
                 expert_overhead_s=0.0, comm_overhead_s=0.0, replica_latency_s=0.0, static_plan_s=0.0, plan_s=0.0)
    if fixed == "phases":
        ex = replace(ex, expert_overhead_s=max(0.0, x0), comm_overhead_s=max(0.0, comm0), replica_latency_s=rep_lat,
                     static_plan_s=static_plan, plan_s=plan_phase)
    columns = {"layer": lambda c: 1.0}  # regressors of the totals' residual
    if len({c.tokens for c in cases}) > 1:
        columns["row"] = lambda c: float(c.tokens * k)
    if fixed == "totals" and len({c.policy == "static" for c in cases}) > 1:
        columns["balancing"] = lambda c: float(c.policy != "static")
    X, y = [], []
    for c in cases:
        m = replace(model, tokens_per_rank=c.tokens)
        X.append([f(c) for f in columns.values()])
        y.append(c.measured_ms * 1e-3 - simulate(c.plan, cluster, model=m, execution=_as_policy(ex, c)).layer_s)
    coef = dict(zip(columns, _lstsq(X, y)))
    c0, c_row, c_bal = coef["layer"], coef.get("row", 0.0), coef.get("balancing", 0.0)
    ex = replace(ex, layer_overhead_s=max(0.0, c0), row_overhead_s=max(0.0, c_row))
    if fixed == "totals":
        ex = replace(ex, plan_s=max(0.0, c_bal))
    fitted = {"backend": backend, "fixed": fixed, "num_chunks": n, "pipelined": pipelined,
              "t_ffn_s": t_ffn, "gemm_flops_per_s": gemm, "nvlink_bytes_per_s": 1.0 / inv_bw,
              "expert_overhead_s": ex.expert_overhead_s, "comm_overhead_s": ex.comm_overhead_s,
              "replica_latency_s": ex.replica_latency_s, "static_plan_s": ex.static_plan_s, "plan_s": ex.plan_s,
              "layer_overhead_s": c0, "row_overhead_s": c_row, "balancing_overhead_s": c_bal,
              "phase_expert_intercept_s": x0, "phase_comm_intercept_s": comm0, "phase_replica_fixed_s": rep_lat,
              "phase_static_plan_s": static_plan, "phase_plan_s": plan_phase, "num_cases": len(cases)}
    return Calibration(cluster=cluster, execution=ex, model=model, fitted=fitted)


def _as_policy(execution: Execution, case: MeasuredCase) -> Execution:
    """A topoep case whose guard fired executed the static plan but paid the planner (backend cuda: and ran
    its slot-pool kernels, part of the totals fit's plan_s): keep plan_s."""
    if case.policy != "static" and case.plan.policy == "static":
        return replace(execution, static_plan_s=execution.plan_s)
    return execution


def predict(case: MeasuredCase, cal: Calibration) -> SimResult:
    """The calibrated model's prediction of one measured case."""
    model = replace(cal.model, tokens_per_rank=case.tokens)
    return simulate(case.plan, cal.cluster, model=model, execution=_as_policy(cal.execution, case))
