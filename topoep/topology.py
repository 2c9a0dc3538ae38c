"""Expert-parallel ranks grouped into NVLink domains, and the per-byte cost matrix C of paper 4.1.

Ranks of one domain are contiguous (rank r lives in domain r // ranks_per_domain), as torchrun and
Slurm number them node by node. A *virtual* topology (e.g. 4 ranks on one host treated as 2 domains)
is just a config: nothing here looks at the hardware.

Costs are seconds per byte (`cost`, float64) for models and metrics, and an integer copy in
femtoseconds per byte (`cost_fs`, int64) for planner decisions, which must use integer arithmetic
only so that the CUDA planner reproduces the reference bit for bit.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

# Defaults from the paper's fabric (6.1): NVLink/NVSwitch inside a node, "up to 400 GB/s of aggregate
# bidirectional bandwidth" -> 200 GB/s per direction; between nodes, two 200 Gb/s InfiniBand links
# per GPU -> 400 Gb/s = 50 GB/s per direction.
NVLINK_BYTES_PER_S = 200e9
RDMA_BYTES_PER_S = 50e9
DEFAULT_INTRA_COST = 1.0 / NVLINK_BYTES_PER_S  # s/byte
DEFAULT_INTER_COST = 1.0 / RDMA_BYTES_PER_S  # s/byte
FEMTO = 1e15  # integer cost scale: femtoseconds per byte
MAX_COST_FS = 2**53  # the slowest link's femtoseconds per byte (about 9 s per byte), exact in float64; products
# with bytes and assignments are bounded where they are made (topoep.planners.max_assignments)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """EP ranks -> NVLink domains, with a symmetric per-byte cost matrix.

    Attributes:
        num_domains: M, the number of NVLink domains (nodes).
        ranks_per_domain: ranks in each domain; num_ranks = num_domains * ranks_per_domain.
        intra_cost: seconds per byte between two different ranks of one domain.
        inter_cost: seconds per byte between ranks of different domains.
        cost: optional explicit float64[R, R] matrix (zero diagonal, symmetric); overrides the two
            scalars. Use `Topology.from_cost_matrix` to build one.
    """

    num_domains: int = 1
    ranks_per_domain: int = 8
    intra_cost: float = DEFAULT_INTRA_COST
    inter_cost: float = DEFAULT_INTER_COST
    cost: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("num_domains", "ranks_per_domain"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Topology.{name} must be an integer >= 1, got {v!r}")
        for name in ("intra_cost", "inter_cost"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and v == v and v != float("inf")):
                raise ValueError(f"Topology.{name} must be a finite number >= 0 (seconds per byte), got {v!r}")
        R = self.num_ranks
        if self.cost is None:
            dom = torch.arange(R) // self.ranks_per_domain
            same = dom[:, None] == dom[None, :]
            c = torch.full((R, R), float(self.inter_cost), dtype=torch.float64)
            c[same] = float(self.intra_cost)
            c.fill_diagonal_(0.0)
        else:
            c = torch.as_tensor(self.cost, dtype=torch.float64).cpu()
            if c.shape != (R, R):
                raise ValueError(f"Topology.cost must have shape [{R}, {R}] for {R} ranks, got {list(c.shape)}")
            if not torch.isfinite(c).all() or (c < 0).any():
                raise ValueError("Topology.cost must be finite and >= 0 (seconds per byte)")
            if not torch.equal(c, c.T):
                raise ValueError("Topology.cost must be symmetric (paper 4.1): cost[s, r] == cost[r, s]")
            if (c.diagonal() != 0).any():
                raise ValueError("Topology.cost must have a zero diagonal (cost[r, r] == 0)")
            c = c.clone()
        if float(c.max()) * FEMTO >= MAX_COST_FS:
            raise ValueError(f"Topology costs are seconds per byte (e.g. 1 / 200e9 for 200 GB/s), got {float(c.max())!r}: "
                             f"a link this slow does not fit the planners' integer femtoseconds; pass 1 / bandwidth")
        object.__setattr__(self, "cost", c)
        object.__setattr__(self, "cost_fs", torch.round(c * FEMTO).to(torch.int64))
        object.__setattr__(self, "domain_of", torch.arange(R, dtype=torch.int64) // self.ranks_per_domain)
        object.__setattr__(self, "_on_device", {})

    # -- derived -------------------------------------------------------------------------------
    cost_fs: torch.Tensor = field(init=False, compare=False, repr=False)
    """int64[R, R]: cost rounded to femtoseconds per byte (used by planner decisions)."""
    domain_of: torch.Tensor = field(init=False, compare=False, repr=False)
    """int64[R]: domain of each rank."""

    @property
    def num_ranks(self) -> int:
        return self.num_domains * self.ranks_per_domain

    def on(self, device) -> "Topology":
        """This topology with cost, cost_fs and domain_of on `device`, copied once per device (the
        planners and statistics run every layer and microbatch: no host-to-device copy each time)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:<current>" share one copy
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.cost.device:
            return self
        if device not in self._on_device:
            t = object.__new__(Topology)
            for name in ("num_domains", "ranks_per_domain", "intra_cost", "inter_cost"):
                object.__setattr__(t, name, getattr(self, name))
            for name in ("cost", "cost_fs", "domain_of"):
                object.__setattr__(t, name, getattr(self, name).to(device))
            object.__setattr__(t, "_on_device", {})
            self._on_device[device] = t
        return self._on_device[device]

    def domain_ranks(self, d: int) -> range:
        """The (contiguous) ranks of domain d."""
        return range(d * self.ranks_per_domain, (d + 1) * self.ranks_per_domain)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Topology)
            and self.num_domains == other.num_domains
            and self.ranks_per_domain == other.ranks_per_domain
            and torch.equal(self.cost, other.cost)
        )

    def __hash__(self) -> int:
        return hash((self.num_domains, self.ranks_per_domain))

    def __repr__(self) -> str:
        c = self.cost
        intra = c[0, 1].item() if self.ranks_per_domain > 1 else self.intra_cost
        inter = c[0, self.ranks_per_domain].item() if self.num_domains > 1 else self.inter_cost
        return (
            f"Topology(num_domains={self.num_domains}, ranks_per_domain={self.ranks_per_domain}, "
            f"intra={1 / intra / 1e9 if intra else float('inf'):.0f} GB/s, "
            f"inter={1 / inter / 1e9 if inter else float('inf'):.0f} GB/s)"
        )

    # -- constructors --------------------------------------------------------------------------
    def planning_groups(self, max_ranks: int | None) -> "Topology":
        """The topology the refining planners (`topoep`, `topoep_plus`, `topoep_plus_local`) see when they balance
        inside groups of at most `max_ranks` ranks of each NVLink domain instead of whole domains: domains of g
        ranks, g the largest divisor of ranks_per_domain not above max_ranks (a group never spans two domains).
        The paper's refinement makes one move at a time inside a domain, and the moves grow with the domain's
        ranks (on an H100 a domain of 64 takes 0.65 ms, domains of 8 about 40 us at the same EP:
        bench/planner_latency.py --rpd), so a large NVLink domain (GB200 NVL72) is planned as groups;
        stage 1 still places replicas across groups where its criterion asks (eq. 9), and `topoep.solve`
        returns the plan on the real topology, so guard, metrics and transfers see the real links. Costs: the
        domain's own inside a group; between groups the inter-domain cost where there are several domains (the
        CUDA planner's model has one price for every link across groups: between two groups of one domain it
        overprices, so load moves between them only where it is free) and the domain's own where there is one
        (every link is NVLink: exact). None, or max_ranks >= ranks_per_domain: this topology itself. Cached (the
        runtime asks for it in every call)."""
        if max_ranks is not None and (isinstance(max_ranks, bool) or not isinstance(max_ranks, int) or max_ranks < 1):
            raise ValueError(f"max_ranks (ranks per planning group) must be an integer >= 1 or None, got {max_ranks!r}")
        if max_ranks is None or max_ranks >= self.ranks_per_domain:
            return self
        return _planning_groups(self, max(g for g in range(1, max_ranks + 1) if self.ranks_per_domain % g == 0))

    @classmethod
    def from_cost_matrix(cls, cost, ranks_per_domain: int | None = None) -> "Topology":
        """Build from an explicit symmetric float[R, R] per-byte cost matrix (seconds per byte).

        Domains must be contiguous and of equal size. When `ranks_per_domain` is not given it is
        inferred: rank 0's domain is rank 0 plus the ranks whose cost from rank 0 is the smallest
        off-diagonal cost of row 0 (so a matrix with a single cost level is a single domain).
        """
        c = torch.as_tensor(cost, dtype=torch.float64)
        if c.dim() != 2 or c.shape[0] != c.shape[1] or c.shape[0] < 1:
            raise ValueError(f"cost must be a square [R, R] matrix, got shape {list(c.shape)}")
        R = c.shape[0]
        if ranks_per_domain is None:
            if R == 1:
                ranks_per_domain = 1
            else:
                row = c[0, 1:]
                near = (row == row.min()).tolist()
                ranks_per_domain = 1 + (near.index(False) if False in near else len(near))
                if sum(near) != ranks_per_domain - 1:
                    raise ValueError(f"cannot infer the domains: rank 0's cheapest links go to ranks "
                                     f"{[j + 1 for j, n in enumerate(near) if n]}, not to the ranks right after it; "
                                     f"order the ranks so each domain is contiguous, or pass ranks_per_domain")
        if isinstance(ranks_per_domain, bool) or not isinstance(ranks_per_domain, int):
            raise ValueError(f"ranks_per_domain must be an integer (ranks per NVLink domain) or None, got "
                             f"{ranks_per_domain!r}")
        if ranks_per_domain < 1 or R % ranks_per_domain != 0:
            raise ValueError(
                f"ranks_per_domain={ranks_per_domain} does not divide the {R} ranks of the cost matrix; "
                "domains must be contiguous and of equal size"
            )
        dom = torch.arange(R) // ranks_per_domain
        same = dom[:, None] == dom[None, :]
        off = ~torch.eye(R, dtype=torch.bool)
        if (same & off).any() and (~same).any() and float(c[same & off].max()) > float(c[~same].min()):
            raise ValueError(f"the cost matrix does not have domains of {ranks_per_domain} contiguous ranks: a link "
                             f"inside one costs {float(c[same & off].max()):.3g} s/byte, more than a link between two "
                             f"({float(c[~same].min()):.3g}); order the ranks so each domain is contiguous, or pass "
                             f"ranks_per_domain")
        return cls(num_domains=R // ranks_per_domain, ranks_per_domain=ranks_per_domain, cost=c)

    @classmethod
    def from_env(cls, ep_size: int | None = None, ranks_per_domain: int | None = None, **costs) -> "Topology":
        """Topology of the job from the launcher's environment: a node is a domain.

        Reads WORLD_SIZE and LOCAL_WORLD_SIZE (torchrun), or SLURM_NTASKS and SLURM_NTASKS_PER_NODE
        (srun). `ep_size` restricts to an expert-parallel group of that many consecutive ranks.
        `ranks_per_domain` overrides the node size, e.g. to treat one 4-GPU host as 2 virtual domains of 2
        (in training: topology.ranks_per_domain).
        """
        env = os.environ
        world = env.get("WORLD_SIZE") or env.get("SLURM_NTASKS")
        local = env.get("LOCAL_WORLD_SIZE") or slurm_tasks_per_node(env.get("SLURM_NTASKS_PER_NODE"))
        for name, v in (("WORLD_SIZE / SLURM_NTASKS", world), ("LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE", local)):
            if v and not str(v).isdigit():
                raise ValueError(f"{name} must be a positive integer (set by the launcher), got {v!r}")
        world = int(world) if world else 1
        local = int(local) if local else world
        for name, v in (("ep_size", ep_size), ("ranks_per_domain", ranks_per_domain)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")

        R = ep_size if ep_size is not None else world
        rpd = ranks_per_domain or min(local, R)
        if R < 1 or rpd < 1 or R % rpd != 0:
            raise ValueError(
                f"expert-parallel size {R} is not a multiple of the domain size {rpd} "
                "(LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE, or ranks_per_domain): "
                "set ranks_per_domain to a divisor of the EP size"
            )
        return cls(num_domains=R // rpd, ranks_per_domain=rpd, **costs)


def slurm_tasks_per_node(value: str | None) -> str | None:
    # SLURM_NTASKS_PER_NODE can look like "8" or "8(x4)".
    if not value:
        return None
    return value.split("(")[0]


@functools.lru_cache(maxsize=64)
def _planning_groups(topology: Topology, group: int) -> Topology:
    c, dom = topology.cost, topology.domain_of
    same = dom[:, None] == dom[None, :]
    off = ~torch.eye(topology.num_ranks, dtype=torch.bool)

    def price(links: torch.Tensor) -> float:  # a two-level matrix's own value; else the links' mean
        return float(links[0]) if bool((links == links[0]).all()) else float(links.mean())

    intra = price(c[same & off]) if topology.ranks_per_domain > 1 else topology.intra_cost
    inter = price(c[~same]) if topology.num_domains > 1 else intra
    return Topology(num_domains=topology.num_ranks // group, ranks_per_domain=group, intra_cost=intra,
                    inter_cost=inter)
