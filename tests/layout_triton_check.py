"""Run by tests/test_cuda_layout.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the
kernels on CPU tensors; it must be set before triton is imported): `layout_triton.fused_layout` against
the torch reference (`layout.send_layout` + `layout.receive_positions`, the offsets of `layout.received_sizes`)
on random plans, bit for bit, and the tables its kernels make against `layout_triton.tables_reference`; then
`layout_triton.checked_counts` against `layout.count_keys`. Prints one line per case and exits 1 on the first
difference; last, on the CPU only, out-of-range expert ids, a plan that routes one assignment to the wrong expert,
and one that routes one more to an empty slot must be rejected. tests/test_cuda_backend_gpu.py calls main("cuda")
for the same comparisons on the GPU (compiled kernels)."""

import random
import sys

import torch

from topoep import Plan, Topology, solve
from topoep.plan import default_main_rank
from topoep.runtime.layout import count_keys, group_counts, own_rows, receive_positions, received_sizes, send_layout
from topoep.runtime.layout_triton import BLOCK, checked_counts, fused_layout, tables_reference, tables_triton
from topoep.workloads import biased_topk


def cases():
    # (ranks, ranks per domain, experts, slots, tokens, top-k, skew, policy)
    yield 1, 1, 8, 0, 40, 2, 0.0, "static"
    yield 2, 2, 16, 2, 96, 4, -3.0, "topoep"
    yield 2, 1, 16, 2, 3 * BLOCK // 4 + 5, 4, -2.0, "topoep"  # blocks of several experts, one partial
    yield 4, 2, 32, 3, 70, 8, -4.0, "topoep"
    yield 4, 4, 24, 1, 33, 3, -1.0, "topoep"
    yield 8, 4, 64, 2, 64, 6, -3.0, "topoep"
    yield 8, 8, 40, 4, 50, 5, -2.5, "static"
    yield 4, 2, 16, 2, 0, 2, 0.0, "topoep"  # no assignments
    yield 1, 1, 24, 2, 4200, 8, -2.0, "topoep"  # more blocks than _tables_kernel scans in one step


def hand_plan(R: int, E: int, N: int, T: int, k: int, seed: int, zero_main: bool):
    """(routing per rank, a valid plan no planner makes): expert 0 is in most tokens and fills most slots,
    some ranks hold it twice; every (source, expert) count is split at random over the expert's instances,
    with the main instance's share 0 when `zero_main`."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    idx = []
    for _ in range(R):
        rows = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        hot = (rows == 0).any(1)
        rows[~hot, 0] = 0  # expert 0 in every token
        idx.append(rows)
    omega = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in idx])
    slot_expert = torch.tensor([[0 if rnd.random() < 0.6 else rnd.randrange(E) if rnd.random() < 0.8 else -1
                                 for _ in range(N)] for _ in range(R)], dtype=torch.int64)
    inst_expert = torch.cat([torch.arange(E), slot_expert.reshape(-1)])
    route = torch.zeros(R, E + R * N, dtype=torch.int64)
    for s in range(R):
        for x in range(E):
            insts = [x] + [p for p in range(E, E + R * N) if int(inst_expert[p]) == x]
            n = int(omega[s, x])
            cuts = sorted(rnd.randint(0, n) for _ in range(len(insts) - 1))
            parts = [b - a for a, b in zip([0] + cuts, cuts + [n])]
            if zero_main and len(insts) > 1:
                parts[1] += parts[0]
                parts[0] = 0
            route[s, insts] = torch.tensor(parts)
    plan = Plan(omega=omega, topology=Topology(num_domains=1, ranks_per_domain=R), num_slots=N,
                main_rank=default_main_rank(E, R), slot_expert=slot_expert, route=route, policy="hand",
                expert_bytes=1, token_bytes=1)
    return idx, plan


def compare(n: int, label: str, idx, plan, device: str) -> bool:
    """fused_layout against the torch layout on every rank of one plan; prints one line."""
    idx = [i.to(device) for i in idx]
    C = group_counts(plan)
    for rank in range(plan.num_ranks):
        _, key_ref, order_ref = send_layout(idx[rank], plan, rank)
        dest_ref, pos_ref, slot_ref = receive_positions(C, key_ref, rank, plan.num_experts // plan.num_ranks)
        # the region ends inside this rank's received rows (some of its own rows stay, some lie beyond it)
        region = max(1, int(C[:, rank].sum()) // 2)
        inv_ref = own_rows(order_ref, dest_ref, pos_ref, slot_ref, rank, region)
        got = fused_layout(idx[rank], plan, rank, C, region)
        if not torch.equal(fused_layout(idx[rank], plan, rank, C)[1], got[1]):
            print(f"case {n} ({label}) rank {rank}: the layout with inv differs from the one without")
            return False
        # the grouped GEMMs' offsets and row counts, clamped to the region
        sizes = received_sizes(C, rank, plan.num_experts // plan.num_ranks)
        offs_ref = [torch.cumsum(z, 0).clamp(max=region).to(torch.int32) for z in sizes]
        offs_ref += [z.sum().clamp(max=region).view(1) for z in sizes]
        got_offs = fused_layout(idx[rank], plan, rank, C, offsets_rows=region)[5:]
        # the tables the layout kernel reads, and the plan's check
        tables = tables_triton(idx[rank], plan, rank, C)
        tables_ref = tables_reference(idx[rank], plan, rank, C)
        if tables[-1] != tables_ref[-1] or not tables[-1]:
            print(f"case {n} ({label}) rank {rank}: the route check says {tables[-1]}, its reference {tables_ref[-1]}")
            return False
        for name, g, r in zip(("key", "order", "dest", "pos", "is_slot", "inv", "offs_main", "offs_slot", "n_main",
                               "n_slot", "key_start", "recv_start", "inst_start", "rep_first", "rep_count",
                               "rep_list", "first"),
                              (*got, *got_offs, *tables[:-1]),
                              (key_ref, order_ref, dest_ref, pos_ref, slot_ref, inv_ref, *offs_ref, *tables_ref[:-1])):
            if not (g.dtype == r.dtype and torch.equal(g, r)):
                print(f"case {n} ({label}) rank {rank}: {name} differs ({g.dtype} vs {r.dtype})\n"
                      f"  got {g.tolist()[:40]}\n  ref {r.tolist()[:40]}")
                return False
    print(f"case {n}: {label}: equal on every rank ({int(plan.slot_expert.ge(0).sum())} replicas)")
    return True


def main(device: str = "cpu") -> int:
    for n, (R, rpd, E, N, T, k, skew, policy) in enumerate(cases()):
        topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
        layout = "concentrated" if n % 2 else "random"
        idx = list(biased_topk(R, E, T, k, skew, seed=n, layout=layout).unbind(0)) if T else \
            [torch.zeros(0, k, dtype=torch.int64) for _ in range(R)]
        omega = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in idx])
        idx = [i.to(device) for i in idx]
        plan = solve(omega.to(device), topo, num_slots=N, policy=policy, expert_bytes=1000, token_bytes=10)
        if not compare(n, f"R={R} E={E} N={N} T={T} k={k} {policy}", idx, plan, device):
            return 1
    # hand-made plans: one expert in many slots (twice on some ranks), main instances that serve nothing
    for n, (R, E, N, T, k, zero_main) in enumerate([(8, 16, 4, 100, 2, False), (8, 16, 4, 101, 3, True),
                                                    (32, 64, 2, 33, 3, False), (4, 8, 2, 257, 1, True),
                                                    (16, 48, 5, 40, 2, False)], n + 1):
        idx, plan = hand_plan(R, E, N, T, k, seed=n, zero_main=zero_main)
        plan = Plan(omega=plan.omega.to(device), topology=plan.topology, num_slots=N,
                    main_rank=plan.main_rank.to(device), slot_expert=plan.slot_expert.to(device),
                    route=plan.route.to(device), policy="hand", expert_bytes=1, token_bytes=1)
        if not compare(n, f"hand-made R={R} E={E} N={N} T={T} k={k} zero_main={zero_main}", idx, plan, device):
            return 1
    n += 1
    for Ec, Tc, kc in ((8, 40, 2), (128, 4096, 8), (24, 3 * BLOCK // 8, 3)):
        ci = torch.randint(0, Ec, (Tc, kc), generator=torch.Generator().manual_seed(Ec)).to(device)
        if not torch.equal(checked_counts(ci, Ec), count_keys(ci, Ec)):
            print(f"case {n}: checked_counts differs from count_keys (E={Ec} T={Tc} k={kc})")
            return 1
    if device != "cpu":  # a failed device-side assert would leave the process's CUDA context unusable
        print(f"case {n}: checked_counts equal count_keys")
        return 0
    for v in (-1, 8):
        ci = torch.zeros(50, 2, dtype=torch.int64)
        ci[37, 1] = v
        try:
            checked_counts(ci, 8)
        except RuntimeError:
            continue
        print(f"case {n}: checked_counts did NOT reject the value {v} of 8 experts")
        return 1
    print(f"case {n}: checked_counts equal count_keys, and values outside [0, E) are rejected")
    # a plan that routes the right total but moves one assignment from expert 1 to expert 2: rejected
    route = plan.route.clone()
    route[0, 1] -= 1
    route[0, 2] += 1
    bad = Plan(omega=plan.omega, topology=plan.topology, num_slots=plan.num_slots, main_rank=plan.main_rank,
               slot_expert=plan.slot_expert, route=route, policy="hand", expert_bytes=1, token_bytes=1)
    if not rejected(n + 1, "a route that moves one assignment between experts", idx[0], bad):
        return 1
    # a route that routes every expert's assignments right and one more to an empty slot: rejected (the per-expert
    # sums match; the total does not)
    R, N, E = plan.num_ranks, plan.num_slots, plan.num_experts
    se, route = plan.slot_expert.clone(), plan.route.clone()
    p = E + (R - 1) * N + (N - 1)  # the last slot of the last rank, emptied
    e_old = int(se[R - 1, N - 1])
    if e_old >= 0:
        route[0, e_old] += route[0, p]  # rank 0's assignments it served go to the main instance
    route[:, p] = 0
    se[R - 1, N - 1] = -1
    route[0, p] += 1
    bad = Plan(omega=plan.omega, topology=plan.topology, num_slots=N, main_rank=plan.main_rank, slot_expert=se,
               route=route, policy="hand", expert_bytes=1, token_bytes=1)
    return 0 if rejected(n + 2, "a route with one more assignment on an empty slot", idx[0], bad) else 1


def rejected(n: int, what: str, idx: torch.Tensor, bad: Plan) -> bool:
    try:
        fused_layout(idx, bad, 0, group_counts(bad))
    except RuntimeError as err:
        print(f"case {n}: {what}: rejected ({str(err)[:60]})")
        return True
    print(f"case {n}: {what} was NOT rejected")
    return False


if __name__ == "__main__":
    sys.exit(main())
