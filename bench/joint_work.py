"""How much work the `joint` policy's reference does per plan, and what that implies for a GPU form of it
(issue 4's "CUDA joint <= 50 us at EP 128"): the move search's dependent steps and the batched tensor elements
it processes (`joint_search.Data.plan_size` per plan in a step; the work budget's fixed cost per step left
out), the destroy-and-repair rounds, and the time a GPU needs just to read those elements once as int64 at
the given memory bandwidth (H200: 4.8 TB/s). The reference is run unchanged; the counters wrap its functions.

    python bench/joint_work.py [--eps 8 32 128] [--experts 640] [--bandwidth 4.8e12]

Workload: bench/planner_latency.py's (biased router, router_skew -2.5, top-8, 1024 tokens per rank, 8 ranks per
domain, 2 slots). Writes results/joint_work.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import topoep_research.joint as joint_mod  # noqa: E402
import topoep_research.joint_search as search_mod  # noqa: E402
from bench.common import REPO, command, markdown_table, parse_options, run_info, write_json  # noqa: E402
from bench.planner_latency import workload  # noqa: E402
from topoep import solve  # noqa: E402


def count_work(ep: int, experts: int, slots: int = 2, rpd: int = 8) -> dict:
    """Plans one `joint` instance with counters around the move search, its steps and the LNS; returns them."""
    c = dict(search_calls=0, steps=0, elements=0, lns_rounds=0)
    search, step, evict = search_mod.search, search_mod._step, search_mod._evict

    def counted_search(d, st, max_steps):
        n = search(d, st, max_steps)
        c["search_calls"] += 1
        c["steps"] += n
        return n

    def counted_step(d, st, stuck, done):
        c["elements"] += st.K * d.plan_size()
        return step(d, st, stuck, done)

    def counted_evict(d, st, mask):  # one call per LNS round (and per forced opening of a full rank)
        c["lns_rounds"] += 1
        return evict(d, st, mask)

    search_mod.search, search_mod._step, search_mod._evict = counted_search, counted_step, counted_evict
    joint_mod.search = counted_search
    try:
        topo, omega = workload(ep, experts, rpd=rpd)
        t0 = time.perf_counter()
        plan = solve(omega, topo, num_slots=slots, policy="joint")
        seconds = time.perf_counter() - t0
    finally:
        search_mod.search, search_mod._step, search_mod._evict = search, step, evict
        joint_mod.search = search
    return dict(ep=ep, experts=experts, slots=slots, seconds=seconds, work_left=plan.info.get("work_left"),
                fallback=plan.info.get("fallback", ""), **c)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--experts", type=int, default=640)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="GPU memory bandwidth, bytes/s (H200: 4.8e12)")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    args = parse_options(ap, argv)
    torch.set_num_threads(1)
    rows = []
    for ep in args.eps:
        r = count_work(ep, args.experts)
        r["read_once_us"] = r["elements"] * 8 / args.bandwidth * 1e6
        rows.append(r)
        print(f"EP {ep}: {r['steps']} search steps, {r['elements']:.3g} elements, {r['seconds']:.1f} s", flush=True)
    info = run_info(vars(args))
    table = markdown_table(
        ["EP", "experts", "search calls", "dependent search steps", "tensor elements", "evict calls (LNS rounds, forced openings)",
         "work budget left", "int64 read once at the bandwidth, us", "CPU reference s", "winner"],
        [[r["ep"], r["experts"], r["search_calls"], r["steps"], f"{r['elements']:.3g}", r["lns_rounds"],
          r["work_left"], f"{r['read_once_us']:.0f}", f"{r['seconds']:.1f}", r["fallback"] or "search"] for r in rows])
    md = (f"# Work of the `joint` reference per plan\n\n- date: {info['date']}; commit: `{info['commit']}`; hardware: "
          f"{info['hardware']}\n- workload: biased router, router_skew -2.5, top-8, 1024 tokens per rank, "
          f"8 ranks per domain, 2 slots; bandwidth {args.bandwidth:.3g} B/s\n- reproduce: `{command('joint_work.py', args.argv)}`\n\n"
          + table + "\n\nEach search step depends on the previous one (its moves change the plans the next step "
          "scores); the elements are the batched tensors of every step (plans x (R^2 (Q + R) + 4 E R)). "
          "\"winner\": the candidate `joint` returned (the search's plan, or a fallback).\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "joint_work.md").write_text(md)
    write_json(args.out / "joint_work.json", info, rows)
    print(md)


if __name__ == "__main__":
    main()
