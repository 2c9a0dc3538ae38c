"""The GPU planner (csrc/planner_kernel.cu and the phases it includes): `static`, `topoep` and `topoep_plus`; the
spread planner (csrc/spread.cu): `topoep_plus_spread` and `topoep_plus_spread_tree`; the peers' planners
(csrc/peers.cu): `deepseek` and `flexmoe`; and the capacity step (csrc/capacity.cu), bit-equal to the reference
planners.

The extension is built automatically on first use and cached (torch.utils.cpp_extension, nvcc); a
build made on one machine runs on another with the same torch (the cache folder can be carried). It
registers `torch.ops.topoep.plan_topoep` / `plan_topoep_plus` / `plan_static` / `plan_spread` / `plan_peer` / `fit_capacity` (and the guard's
`guard_select` / `relay_trees`, topoep/runtime/guard_cuda.py) (mutating ops with fake
implementations, so torch.compile and CUDA-graph capture can trace them). `CudaPlanner` allocates the
workspace once per (device, R, E, domains, slots) and never synchronises the host.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

from topoep.plan import Plan

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
# the translation units; planner_kernel.cu includes the planner's phases (csrc/planner_*.cuh)
SOURCES = ("bindings.cpp", "planner_kernel.cu", "capacity.cu", "guard.cu", "spread.cu", "peers.cu")
SOURCE_SUFFIXES = (".cpp", ".cu", ".cuh", ".h")  # every file of csrc/ with one of these keys the build folder
CUDA_POLICIES = ("static", "topoep", "topoep_plus", "topoep_plus_local", "topoep_plus_spread", "topoep_plus_spread_tree",
                 "deepseek", "flexmoe")
SPREAD_POLICIES = ("topoep_plus_spread", "topoep_plus_spread_tree")  # csrc/spread.cu (solve_spread_cuda)
PEER_POLICIES = ("deepseek", "flexmoe")  # csrc/peers.cu (solve_peer_cuda); flexmoe on at most FLEXMOE_MAX_RANKS ranks
FLEXMOE_MAX_RANKS = 256
_loaded = False


def cuda_home() -> str | None:
    """The CUDA toolkit root: $CUDA_HOME, else the folder above the real nvcc (PATH's nvcc may be a wrapper
    script, which makes torch guess a wrong root and fail to link)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    for root in ("/usr/local/cuda",):
        if Path(root, "bin", "nvcc").exists():
            return str(Path(root).resolve())
    nvcc = shutil.which("nvcc")
    if nvcc:
        text = Path(nvcc).read_bytes()[:4096]
        if text.startswith(b"#!"):  # a wrapper script: find the real binary it execs
            for token in text.decode(errors="ignore").split():
                if token.endswith("/bin/nvcc") and Path(token).exists():
                    return str(Path(token).parent.parent)
        return str(Path(nvcc).resolve().parent.parent)
    return None


def build_dir() -> Path:
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")
    h = hashlib.sha256(f"{torch.__version__}|{arch}".encode())
    for path in sorted(p for p in CSRC.iterdir() if p.suffix in SOURCE_SUFFIXES):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    root = Path(os.environ.get("TOPOEP_EXT_DIR", CSRC.parent / "build" / "ext"))
    return root / f"topoep_planner_{h.hexdigest()[:16]}"


def load_extension(verbose: bool = False) -> Path:
    """Build (first use) or load the planner extension; returns the shared library's path."""
    global _loaded
    out = build_dir()
    lib = out / "topoep_planner.so"
    if not _loaded:
        if not lib.exists():
            from torch.utils import cpp_extension

            home = cuda_home()
            if home is None:
                raise RuntimeError("building the CUDA planner needs nvcc (the CUDA toolkit); set CUDA_HOME")
            os.environ["CUDA_HOME"] = home
            cpp_extension.CUDA_HOME = home
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
            out.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name="topoep_planner", sources=[str(CSRC / s) for s in SOURCES], build_directory=str(out),
                               extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "-lineinfo"], with_cuda=True,
                               is_python_module=False, verbose=verbose)
        else:
            torch.ops.load_library(str(lib))
        _register_fakes()
        _loaded = True
    return lib


def _register_fakes() -> None:
    @torch.library.register_fake("topoep::plan_topoep")
    def _(omega, cost_fs, num_domains, num_slots, expert_bytes, token_bytes, slot_expert, route, workspace,
          num_blocks=0, skip_stages=0, enable=None):
        return None

    @torch.library.register_fake("topoep::plan_topoep_plus")
    def _(omega, cost_fs, num_domains, num_slots, expert_bytes, token_bytes, a2, bb, max_moves, slot_expert, route,
          workspace, num_blocks=0, skip_stages=0, enable=None, inter_domain=True):
        return None

    @torch.library.register_fake("topoep::plan_static")
    def _(omega, num_slots, slot_expert, route):
        return None

    @torch.library.register_fake("topoep::fit_capacity")
    def _(omega, ranks_per_domain, capacity, allow_new, slot_expert, route, workspace, info):
        return None

    @torch.library.register_fake("topoep::guard_select")
    def _(omega, main_rank, cost_fs, routes, slots, ranks_per_domain, token_bytes, expert_bytes, t_ffn, token_transfers,
          token_overlap, token_chunks, plan_s, latency, exposed, fanout, levels, chunks, share, async_fetch, fetch_overlap,
          allow, planned, route_out, slot_out, choice, use, fired, relay, saved, cost, workspace, trees=None):
        return None

    @torch.library.register_fake("topoep::plan_spread")
    def _(omega, num_domains, num_slots, expert_bytes, token_bytes, t_fs, a, b, max_moves, move_cost_fs, trees, enable,
          slot_expert, route, info, workspace):
        return None

    @torch.library.register_fake("topoep::plan_peer")
    def _(omega, policy, num_domains, num_slots, enable, slot_expert, route, info, workspace, smem_limit):
        return None

    @torch.library.register_fake("topoep::relay_trees")
    def _(slot_expert, main_rank, ranks_per_domain, fanout, relay, source, level):
        return None


PHASES = ("demand", "placement", "instances", "split", "refine", "route")
SKIP_LIMIT = 256  # skip_stages < SKIP_LIMIT: every kSkip* bit of csrc/planner.h
PROFILE = 8  # skip_stages bit: count the refinement's cycles (csrc/planner.h kProfile)
PLUS_PHASES = ("guard", "busiest", "best move", "more moves", "route A", "route B")
REFINE_COUNTERS = ("iterations", "busiest_cycles", "existing_cycles", "rounds_cycles", "rounds", "reduce_cycles",
                   "move_cycles", "loop_cycles")
# the names of the values the workspace_layout op returns (csrc/bindings.cpp; the layout is csrc/planner.h's): the
# workspace's size in int64 elements, then offset and count of each measurement array in its head, and the offset
# of topoep_plus's number of moves
WORKSPACE_FIELDS = ("elems", "stamps", "num_stamps", "refine_counters", "num_refine_counters", "plus_stamps",
                    "num_plus_stamps", "moves")


def stamp_gaps(names, stamps: list[int]) -> dict[str, int]:
    """Phase times from consecutive %globaltimer stamps: names[i] lasts from stamps[i] to stamps[i + 1]."""
    if len(stamps) != len(names) + 1:
        raise ValueError(f"{len(names)} phases need {len(names) + 1} stamps, got {len(stamps)}")
    return {name: stamps[i + 1] - stamps[i] for i, name in enumerate(names)}


def check_grid_blocks(num_blocks, name: str = "num_blocks") -> None:
    """Raises ValueError, naming `name` and the value, unless num_blocks is an integer >= 0: the grid of a CUDA
    plan (`CudaPlanner.plan`'s and `topoep.solve`'s grid_blocks, which ExpertParallelMoE takes from
    LayerConfig.planner_blocks)."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: half the SMs), got {num_blocks!r}")


class CudaPlanner:
    """Plans on the GPU with buffers allocated once for a shape. `plan()` is capturable in a CUDA graph."""

    def __init__(self, num_ranks: int, num_experts: int, num_domains: int, num_slots: int, device):
        load_extension()
        self.R, self.E, self.M, self.N = num_ranks, num_experts, num_domains, num_slots
        self.device = torch.device(device)
        self.layout = dict(zip(WORKSPACE_FIELDS, torch.ops.topoep.workspace_layout(self.R, self.E, self.M, self.N),
                               strict=True))
        self.workspace = torch.zeros(self.layout["elems"], dtype=torch.int64, device=self.device)

    def plan(self, omega: torch.Tensor, topology, policy: str, expert_bytes: int, token_bytes: int,
             slot_expert: torch.Tensor, route: torch.Tensor, *, grid_blocks: int = 0, skip_stages: int = 0,
             enable: torch.Tensor | None = None) -> None:
        """Write the plan into slot_expert int64[R, N] and route int64[R, E + R*N] (no host sync).

        grid_blocks: the cooperative grid of a multi-block plan (topoep, topoep_plus): that many blocks (at most one
        per SM; more are capped), 0 for the default, half the SMs; one-block plans keep their block. A block takes a
        whole SM (its registers) and the grid starts only when every block has one, so a smaller grid waits less
        for kernels that run beside it (a collective on another stream). The plans do not depend on it; a CUDA
        graph replays the grid it captured.
        skip_stages: csrc/planner.h's kSkip* bits, for latency measurements and tests only: stages left out
        (1 the refinement, 2 the route, 4 everything: the plan is then not the policy's), PROFILE (the
        refinement's cycle counters), and tuning bits that force one path (16, 32, 64, 128: the policy's plan).
        enable: None, or a 0-d bool tensor on the planner's device, read there: False writes the static plan and
        plans nothing (`topoep.solve`'s enable). The static policy takes none of these."""
        check_grid_blocks(grid_blocks, "grid_blocks")
        if isinstance(skip_stages, bool) or not isinstance(skip_stages, int) or not 0 <= skip_stages < SKIP_LIMIT:
            raise ValueError(f"skip_stages must be a combination of csrc/planner.h's kSkip* bits (an integer in "
                             f"[0, {SKIP_LIMIT})), got {skip_stages!r}")
        own = tuple(p for p in CUDA_POLICIES if p not in SPREAD_POLICIES + PEER_POLICIES)
        if policy not in own:  # (the spread planner: solve_spread_cuda; the peers': solve_peer_cuda)
            raise ValueError(f"CudaPlanner plans {', '.join(own)}, not {policy!r}")
        if policy == "static":
            torch.ops.topoep.plan_static(omega, self.N, slot_expert, route)
        elif policy in ("topoep_plus", "topoep_plus_local"):
            a2, bb = self.plus_costs(topology, token_bytes)
            torch.ops.topoep.plan_topoep_plus(omega, topology.on(self.device).cost_fs, self.M, self.N, expert_bytes,
                                              token_bytes, a2, bb, 4 * self.R * (self.E // self.R + self.N),
                                              slot_expert, route, self.workspace, grid_blocks, skip_stages, enable,
                                              policy == "topoep_plus")
        else:
            torch.ops.topoep.plan_topoep(omega, topology.on(self.device).cost_fs, self.M, self.N, expert_bytes,
                                         token_bytes, slot_expert, route, self.workspace, grid_blocks, skip_stages,
                                         enable)

    def plus_costs(self, topology, token_bytes: int) -> tuple[int, int]:
        """(a2, bb) of topoep_plus for this topology (host only: its cost matrix lives on the CPU); raises
        ValueError unless the costs are exactly two-level (the kernel's route is optimal only there)."""
        from topoep.planners import cached_two_level_costs

        a, b, exact = cached_two_level_costs(topology)
        if not exact:
            raise ValueError("the CUDA planner runs topoep_plus on an exactly two-level cost matrix only (one "
                             "intra-domain and one inter-domain cost); use backend='reference' for this topology")
        return 2 * token_bytes * a, 2 * token_bytes * (b - a)

    def _head(self, name: str) -> list[int]:
        """The measurement array `name` of the workspace's head: stamps, refine_counters or plus_stamps
        (synchronises the host)."""
        at = self.layout[name]
        return self.workspace[at:at + self.layout["num_" + name]].tolist()

    def moves(self) -> int:
        """The free moves of the last topoep_plus plan (synchronises the host: for tests and benchmarks)."""
        return int(self.workspace[self.layout["moves"]])

    def plus_phase_ns(self) -> dict[str, int]:
        """GPU time (ns, %globaltimer of block 0) of topoep_plus's phases after the refinement in the last
        topoep_plus plan (csrc/planner.h kPlusStamps; synchronises the host): the staging of the loads and the
        guard, the first move iteration's busiest rank and best move (pair scan and block reduction), the moves
        after it, the route's pass A (per (expert, domain) group, with the grid barrier after it) and pass B (per
        (source, instance); its end is the latest block's). Empty when the plan has no such phases (the guard fired:
        the plan is static's, and its stamps stay 0)."""
        t = self._head("plus_stamps")
        if 0 in t:
            return {}
        return stamp_gaps(PLUS_PHASES, [self._head("stamps")[PHASES.index("refine") + 1]] + t)

    def phase_ns(self) -> dict[str, int]:
        """GPU time (ns, %globaltimer of block 0) of each phase of the last `topoep` plan (synchronises the
        host: for benchmarks, never on the training path)."""
        return stamp_gaps(PHASES, self._head("stamps"))

    def refine_profile(self, omega: torch.Tensor, topology, expert_bytes: int, token_bytes: int) -> dict[str, int]:
        """Plans omega once more with the refinement's cycle counters on (they slow it down, so plans
        count them only on request) and returns domain 0's: iterations, and SM cycles spent finding the
        busiest rank, the existing-instance candidates, the new-replica rounds (and their number), the
        candidate reduction, the move, and the whole loop (synchronises the host; for benchmarks)."""
        se = torch.empty(self.R, self.N, dtype=torch.int64, device=self.device)
        rt = torch.empty(self.R, self.E + self.R * self.N, dtype=torch.int64, device=self.device)
        self.plan(omega, topology, "topoep", expert_bytes, token_bytes, se, rt, skip_stages=PROFILE)
        return dict(zip(REFINE_COUNTERS, self._head("refine_counters"), strict=True))


_planners: dict = {}


def solve_cuda(omega: torch.Tensor, topology, *, num_slots: int, policy: str, main_rank: torch.Tensor,
               expert_bytes: int, token_bytes: int, grid_blocks: int = 0, enable: torch.Tensor | None = None) -> Plan:
    """`topoep.solve` on the GPU (see module docstring); outputs are fresh tensors, the workspace is cached.
    grid_blocks: the grid of multi-block plans, enable: plan or write the static plan (CudaPlanner.plan)."""
    R, E = omega.shape
    key = (omega.device, R, E, topology.num_domains, num_slots, policy)  # a workspace per policy: plans may run at once
    planner = _planners.get(key)
    if planner is None:
        planner = _planners[key] = CudaPlanner(R, E, topology.num_domains, num_slots, omega.device)
    slot_expert = torch.empty(R, num_slots, dtype=torch.int64, device=omega.device)
    route = torch.empty(R, E + R * num_slots, dtype=torch.int64, device=omega.device)
    planner.plan(omega.contiguous(), topology, policy, expert_bytes, token_bytes, slot_expert, route,
                 grid_blocks=grid_blocks, enable=enable)
    return Plan(omega=omega, topology=topology, num_slots=num_slots, main_rank=main_rank, slot_expert=slot_expert,
                route=route, policy=policy, expert_bytes=expert_bytes, token_bytes=token_bytes,
                info={"backend": "cuda"})


_spread_workspaces: dict = {}
SPREAD_INFO = ("moves", "greedy_moves", "objective_fs", "static_objective_fs", "dropped")  # info["device"], in order


def solve_spread_cuda(omega: torch.Tensor, topology, *, num_slots: int, policy: str, main_rank: torch.Tensor,
                      expert_bytes: int, token_bytes: int, t_ffn: float | None = None,
                      enable: torch.Tensor | None = None, max_moves: int | None = None,
                      move_cost_fs: int | None = None) -> Plan:
    """`topoep_plus_spread` / `topoep_plus_spread_tree` on the GPU (csrc/spread.cu), the reference's plan bit for bit
    (default placement). No host synchronisation: one kernel writes the slot table and the route (that of
    `common.hierarchical_route`), and info["device"] holds int64[5] in the order of SPREAD_INFO (`spread_info` reads
    it). enable: None, or a 0-d bool tensor on the GPU (False: the static plan at once, no greedy state built, and
    info["device"] all zeros). max_moves, move_cost_fs: the reference's (None: its defaults,
    `spread.default_max_moves` and `spread.default_move_cost_fs`; a bad move cost raises ValueError)."""
    from topoep.planners.spread import default_max_moves, move_cost_or_default, spread_constants

    if policy not in SPREAD_POLICIES:
        raise ValueError(f"solve_spread_cuda plans {', '.join(SPREAD_POLICIES)}, not {policy!r}")
    load_extension()
    R, E = omega.shape
    N, M, dev = num_slots, topology.num_domains, omega.device
    key = (dev, R, E, M, N, policy)  # a workspace per policy: the two may plan at once
    ws = _spread_workspaces.get(key)
    if ws is None:
        ws = _spread_workspaces[key] = torch.empty(torch.ops.topoep.spread_workspace_elems(R, E, M, N),
                                                   dtype=torch.int64, device=dev)
    t, a, b = spread_constants(topology, t_ffn)
    slot_expert = torch.empty(R, N, dtype=torch.int64, device=dev)
    route = torch.empty(R, E + R * N, dtype=torch.int64, device=dev)
    info = torch.empty(len(SPREAD_INFO), dtype=torch.int64, device=dev)
    torch.ops.topoep.plan_spread(omega.contiguous(), M, N, int(expert_bytes), int(token_bytes), t, a, b,
                                 default_max_moves(R, E, N) if max_moves is None else int(max_moves),
                                 move_cost_or_default(move_cost_fs),
                                 policy == "topoep_plus_spread_tree", enable, slot_expert, route, info, ws)
    return Plan(omega=omega, topology=topology, num_slots=N, main_rank=main_rank, slot_expert=slot_expert, route=route,
                policy=policy, expert_bytes=int(expert_bytes), token_bytes=int(token_bytes),
                info={"backend": "cuda", "device": info})


_peer_workspaces: dict = {}


def solve_peer_cuda(omega: torch.Tensor, topology, *, num_slots: int, policy: str, main_rank: torch.Tensor,
                    expert_bytes: int, token_bytes: int, enable: torch.Tensor | None = None) -> Plan:
    """`deepseek` / `flexmoe` (topoep.planners.baselines) on the GPU (csrc/peers.cu), the reference's plan bit for
    bit (default placement; flexmoe on at most FLEXMOE_MAX_RANKS ranks). No host synchronisation: the placement
    kernel writes the slot table, the route kernel the even split over every instance; info["device"] holds int64[1],
    flexmoe's steps (0 for deepseek). enable: None, or a 0-d bool tensor on the GPU (False: the static plan)."""
    if policy not in PEER_POLICIES:
        raise ValueError(f"solve_peer_cuda plans {', '.join(PEER_POLICIES)}, not {policy!r}")
    load_extension()
    R, E = omega.shape
    N, M, dev = num_slots, topology.num_domains, omega.device
    # (checked here, not only by the op: the op's own checks name the same limits)
    if policy == "flexmoe" and (R > FLEXMOE_MAX_RANKS or E // R + N > 1024):
        raise ValueError(f"the CUDA flexmoe planner takes at most {FLEXMOE_MAX_RANKS} ranks and 1024 experts per rank "
                         f"plus slots; got R={R}, E={E}, num_slots={N}: use backend='reference'")
    smem = torch.ops.topoep.peer_smem_bytes(PEER_POLICIES.index(policy), R, E, M, N)
    if smem > _smem_optin(dev):
        raise ValueError(f"the CUDA {policy} planner needs {smem} bytes of shared memory for R={R}, E={E}, "
                         f"num_slots={N}; the device has {_smem_optin(dev)}: use backend='reference'")
    key = (dev, R, E, N, policy)  # a workspace per policy: the two may plan at once
    ws = _peer_workspaces.get(key)
    if ws is None:
        ws = _peer_workspaces[key] = torch.empty(torch.ops.topoep.peer_workspace_elems(R, E, N), dtype=torch.int64,
                                                 device=dev)
    slot_expert = torch.empty(R, N, dtype=torch.int64, device=dev)
    route = torch.empty(R, E + R * N, dtype=torch.int64, device=dev)
    info = torch.empty(1, dtype=torch.int64, device=dev)
    torch.ops.topoep.plan_peer(omega.contiguous(), PEER_POLICIES.index(policy), M, N, enable, slot_expert, route, info,
                               ws, _smem_optin(dev))
    return Plan(omega=omega, topology=topology, num_slots=N, main_rank=main_rank, slot_expert=slot_expert, route=route,
                policy=policy, expert_bytes=int(expert_bytes), token_bytes=int(token_bytes),
                info={"backend": "cuda", "device": info})


_SMEM_OPTIN: dict = {}


def _smem_optin(device) -> int:
    """The most dynamic shared memory one block may opt in to on `device` (queried once per device)."""
    device = torch.device(device)
    if device not in _SMEM_OPTIN:
        _SMEM_OPTIN[device] = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return _SMEM_OPTIN[device]


def spread_info(plan: Plan) -> dict:
    """info of a spread plan in the reference's form (moves, greedy_moves, objective_fs, static_objective_fs,
    dropped); synchronises the host for a plan of the CUDA planner."""
    if "device" not in plan.info:
        return {k: plan.info[k] for k in SPREAD_INFO}
    return dict(zip(SPREAD_INFO, plan.info["device"].tolist(), strict=True))


_fit_workspaces: dict = {}
_flags: dict = {}


def device_flag(value: bool, device) -> torch.Tensor:
    """A 0-d bool tensor on `device` holding `value`: one cached tensor per (device, value), never written (inputs
    that a CUDA graph reads on the device, such as the capacity step's allow_new)."""
    device = torch.device(device)
    flags = _flags.get(device)
    if flags is None:
        flags = _flags[device] = (torch.tensor(False, device=device), torch.tensor(True, device=device))
    return flags[bool(value)]


def fit_capacity_cuda(plan: Plan, capacity: int, allow_new: bool | torch.Tensor = True) -> Plan:
    """The capacity step (topoep.planners.capacity) on the GPU: a new Plan whose slot_expert and route are the
    reference's bit for bit. No host synchronisation: the plan's info["capacity"] holds the device tensor
    `info` (int64[4 + R*N]: moves, rows beyond the capacity, 1 if the refit from the static plan was kept, replicas
    placed, then a flag per slot the step placed a replica in); `capacity_info` reads it. allow_new: a bool, or a
    0-d bool tensor on the GPU (read there: a CUDA graph replays either value)."""
    from topoep.planners.capacity import check_capacity

    capacity = check_capacity(capacity)
    load_extension()
    R, E, N = plan.num_ranks, plan.num_experts, plan.num_slots
    dev = plan.omega.device
    key = (dev, R, E, N)
    ws = _fit_workspaces.get(key)
    if ws is None:
        ws = _fit_workspaces[key] = torch.empty(torch.ops.topoep.fit_workspace_elems(R, E, N), dtype=torch.int64,
                                                device=dev)
    if not isinstance(allow_new, torch.Tensor):
        allow_new = device_flag(allow_new, dev)
    slot_expert, route = plan.slot_expert.clone(), plan.route.clone()
    info = torch.empty(4 + R * N, dtype=torch.int64, device=dev)
    torch.ops.topoep.fit_capacity(plan.omega.contiguous(), plan.topology.ranks_per_domain, capacity, allow_new,
                                  slot_expert, route, ws, info)
    return Plan(omega=plan.omega, topology=plan.topology, num_slots=N, main_rank=plan.main_rank,
                slot_expert=slot_expert, route=route, policy=plan.policy, expert_bytes=plan.expert_bytes,
                token_bytes=plan.token_bytes, info={**plan.info, "capacity": {"capacity": capacity, "device": info}})


def capacity_info(plan: Plan) -> dict:
    """info["capacity"] of a plan from `fit_capacity_cuda` in the reference's form (synchronises the host)."""
    c = plan.info["capacity"]
    if "device" not in c:
        return c
    v = c["device"].tolist()
    R, N = plan.num_ranks, plan.num_slots
    return {"capacity": c["capacity"], "moves": v[0], "overflow": v[1], "refit": "static" if v[2] else None,
            "new_replicas": [(q // N, q % N) for q in range(R * N) if v[4 + q]]}
