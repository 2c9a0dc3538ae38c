"""What a slow-timescale re-placement of expert homes would add on top of per-microbatch replicas, in the simulator.

DeepSeek EPLB and FlexMoE re-place experts every N steps: each expert gets a new home rank from the routing seen so
far, and its weights and optimizer state move there. TopoEP keeps megatron's homes and balances each microbatch with
replicas. On a warm domain (many popular experts whose homes share one NVLink domain) no plan within the slot budget
relieves the domain: its ranks still run their own experts' load. This script estimates, per workload, the simulated
layer of guarded `topoep_plus` (with its local candidate, as a layer runs it)

  - on megatron's homes (`e // (E / R)`), as today;
  - on re-placed homes: experts dealt to ranks by their load of this routing, heaviest first, each to the least
    loaded rank that still has room (E / R experts per rank), then planned per microbatch as above: the routing is
    assumed to keep its hot set until the next re-placement, so this is the most re-placement can give;
  - the move's cost: the experts whose home changes send W bytes of weights and `state_factor` x W of optimizer
    state (default 6: fp32 master weights and two Adam moments against bf16 weights) to their new home, timed at the
    busiest link (`topoep.links`), amortised over N steps x the microbatches of a step (one layer's share).

    python bench/replacement.py            # writes results/replacement.{md,json}

Nothing here ran on a GPU; the numbers are the simulator's (`topoep_research.sim`), on its presets.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, markdown_table, parse_options, run_info, write_report  # noqa: E402
from topoep import links, solve, workloads  # noqa: E402
from topoep.plan import default_main_rank  # noqa: E402
from topoep.runtime import NetBenefitGuard  # noqa: E402
from topoep_research import sim  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["paper_h800", "h200"], choices=list(sim.CLUSTERS))
    ap.add_argument("--eps", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--slots", type=int, nargs="+", default=[2])
    ap.add_argument("--scenarios", nargs="+", default=["warm_domain", "hot_domain", "natural", "random_bias"],
                    choices=list(workloads.SCENARIOS))
    ap.add_argument("--every", type=int, nargs="+", default=[10, 100, 1000], help="steps between re-placements (N)")
    ap.add_argument("--microbatches", type=int, default=1, help="microbatches per step (the move is shared by them)")
    ap.add_argument("--state-factor", type=float, default=6.0, help="optimizer state bytes per weight byte")
    ap.add_argument("--model", default="qwen3", choices=list(sim.MODELS))
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="replacement")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    args = parse_options(ap, argv)
    if min(args.eps) < 2 or min(args.every) < 1 or args.microbatches < 1 or args.state_factor < 0:
        raise SystemExit("--eps must be >= 2, --every and --microbatches >= 1, --state-factor >= 0")
    return args


def replaced_homes(omega: torch.Tensor) -> torch.Tensor:
    """int64[E]: each expert's new home, heaviest first to the least loaded rank with room (E / R per rank; ties:
    lower expert id, then lower rank)."""
    R, E = omega.shape
    load = omega.sum(0).tolist()
    cap = E // R
    rank_load, count = [0] * R, [0] * R
    home = [0] * E
    for e in sorted(range(E), key=lambda e: (-load[e], e)):
        r = min((r for r in range(R) if count[r] < cap), key=lambda r: (rank_load[r], r))
        home[e] = r
        rank_load[r] += load[e]
        count[r] += 1
    return torch.tensor(home, dtype=torch.int64)


def guarded_plus(omega, topo, cl, model, slots: int, main_rank: torch.Tensor, guard,
                 candidates: tuple[str, ...] = ("topoep_plus_local",)) -> sim.SimResult:
    """The simulated layer of guarded topoep_plus with its candidates (as `sim.simulate` runs it for megatron's
    homes: topoep_plus_local, and topoep_plus_spread where asked), on the given homes."""
    kw = dict(num_slots=slots, expert_bytes=model.expert_bytes, token_bytes=model.token_bytes, main_rank=main_rank)
    t_ffn = cl.t_ffn(model)
    n = sim.EXECUTIONS["topoep"].exposed_replica_transfers
    g = dataclasses.replace(guard, token_top_k=model.top_k)  # the execution's deduplicated tokens, as simulate does
    if not bool(g.worth_planning(omega, topo, main_rank, t_ffn, model.expert_bytes, n)):
        plan = solve(omega, topo, policy="static", **kw)
    else:
        plus = solve(omega, topo, policy="topoep_plus", **kw)
        others = tuple(solve(omega, topo, policy=c, t_ffn=t_ffn, **kw) for c in candidates)
        plan = g.select(plus, t_ffn, n, candidates=others)[0]
        plan.policy = "topoep_plus"
    return sim.simulate(plan, cl, model=model)


def move_seconds(old: torch.Tensor, new: torch.Tensor, topo, bytes_per_expert: float) -> float:
    """Seconds to send every moved expert's bytes from its old home to its new one, at the busiest link."""
    R = topo.num_ranks
    moved = old != new
    flows = torch.zeros(R * R, dtype=torch.float64).index_add_(0, (old * R + new)[moved],
                                                                torch.full((int(moved.sum()),), bytes_per_expert,
                                                                           dtype=torch.float64)).view(R, R)
    return float(links.transfer_seconds(flows, topo))


def run(args) -> list[dict]:
    from tqdm import tqdm

    guard = NetBenefitGuard()
    rows = []
    todo = [(p, ep, s, sc) for p in args.presets for ep in args.eps for s in args.slots for sc in args.scenarios]
    for preset, ep, slots, scen in tqdm(todo, desc="cells", unit="cell"):
        cl = sim.CLUSTERS[preset]
        model = sim.MODELS[args.model].with_experts(ep * args.experts_per_rank)
        topo = cl.topology(ep)
        omega = workloads.scenario(scen, ep, model.num_experts, args.tokens, model.top_k,
                                   ranks_per_domain=topo.ranks_per_domain, seed=args.seed)
        static = sim.simulate(omega, cl, model=model, policy="static", num_slots=slots).layer_s
        old = default_main_rank(model.num_experts, ep)
        new = replaced_homes(omega)
        today = guarded_plus(omega, topo, cl, model, slots, old, guard).layer_s
        replaced = guarded_plus(omega, topo, cl, model, slots, new, guard).layer_s
        spread = ("topoep_plus_local", "topoep_plus_spread")
        today_spread = guarded_plus(omega, topo, cl, model, slots, old, guard, spread).layer_s
        replaced_spread = guarded_plus(omega, topo, cl, model, slots, new, guard, spread).layer_s
        peers = {p: sim.simulate(omega, cl, model=model, policy=p, num_slots=slots, guard=guard).layer_s
                 for p in ("deepseek", "flexmoe")}
        t_move = move_seconds(old, new, topo, model.expert_bytes * (1 + args.state_factor))
        row = {"preset": preset, "ep": ep, "slots": slots, "scenario": scen, "static_ms": 1e3 * static,
               "today_ms": 1e3 * today, "replaced_ms": 1e3 * replaced, "moved_experts": int((old != new).sum()),
               "move_ms": 1e3 * t_move, **{f"{p}_ms": 1e3 * t for p, t in peers.items()},
               "today_spread_ms": 1e3 * today_spread, "replaced_spread_ms": 1e3 * replaced_spread}
        for n in args.every:
            row[f"replaced_every_{n}_ms"] = 1e3 * (replaced + t_move / (n * args.microbatches))
            row[f"replaced_spread_every_{n}_ms"] = 1e3 * (replaced_spread + t_move / (n * args.microbatches))
        rows.append(row)
    return rows


def report(args, rows: list[dict]) -> str:
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    every = [f"every {n} / static" for n in args.every]
    header = ["preset", "EP", "slots", "scenario", "static ms", "plus / static", "re-placed / static"] + every + [
        "moved experts", "move ms", "best peer / static", "plus+spread / static",
        f"re-placed plus+spread every {args.every[-1]} / static"]
    body = []
    for r in rows:
        s = r["static_ms"]
        body.append([r["preset"], r["ep"], r["slots"], r["scenario"], f"{s:.2f}", f"{r['today_ms'] / s:.2f}",
                     f"{r['replaced_ms'] / s:.2f}"] + [f"{r[f'replaced_every_{n}_ms'] / s:.2f}" for n in args.every]
                    + [r["moved_experts"], f"{r['move_ms']:.1f}",
                       f"{min(r['deepseek_ms'], r['flexmoe_ms']) / s:.2f}", f"{r['today_spread_ms'] / s:.2f}",
                       f"{r[f'replaced_spread_every_{args.every[-1]}_ms'] / s:.2f}"])
    gains = [1 - r[f"replaced_every_{args.every[-1]}_ms"] / r["today_ms"] for r in rows]
    gains_spread = [1 - r[f"replaced_spread_every_{args.every[-1]}_ms"] / r["today_spread_ms"] for r in rows]
    return "\n".join([
        "# Re-placing expert homes every N steps, on top of per-microbatch replicas (simulated)",
        "",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']} (a prediction: nothing "
        "here ran on a GPU)",
        f"- model {args.model} expert shape, {args.experts_per_rank} experts per rank, {args.tokens} tokens per rank, "
        f"seed {args.seed}; optimizer state {args.state_factor:g} x the weights' bytes; {args.microbatches} "
        "microbatch(es) per step",
        "- plus: guarded topoep_plus with its local candidate on megatron's homes; re-placed: the same on homes dealt "
        "by this routing's expert loads (heaviest first, least loaded rank with room), the routing assumed to keep "
        "its hot set until the next re-placement (the most re-placement can give); every N: re-placed plus the move "
        "of weights and optimizer state amortised over N steps; best peer: guarded deepseek or flexmoe on megatron's "
        "homes (both re-place nothing here); plus+spread: guarded topoep_plus with topoep_plus_spread as a third "
        "candidate (`topoep.planners.spread`), on megatron's homes and re-placed",
        f"- reproduce: `{command('replacement.py', args.argv)}`",
        "",
        markdown_table(header, body),
        "",
        f"Re-placing every {args.every[-1]} steps cuts guarded topoep_plus's layer by "
        f"{100 * min(gains):.0f} % to {100 * max(gains):.0f} % across these cells (negative: slower); the layer with "
        f"the spread candidate by {100 * min(gains_spread):.0f} % to {100 * max(gains_spread):.0f} %.",
        "",
    ])


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = run(args)
    text = report(args, rows)
    write_report(args, text, rows)
    print(text.splitlines()[-1])
    print(f"wrote {args.out / args.name}.md")


if __name__ == "__main__":
    main()
