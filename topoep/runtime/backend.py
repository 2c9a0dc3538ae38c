"""Execution backends: the four operations a balanced MoE layer needs besides expert compute.

    all_gather_counts  omega_local[E] -> omega[R, E] (every rank gets the same matrix)
    exchange_counts    rows per (destination, local group) -> rows per (source, local group)
    dispatch/combine   variable-size all-to-all of token rows; each is the other's backward
    fetch_replicas     copy each replicated expert's weights from its main rank into the slots
    return_grads       send the slots' weight gradients back to the main ranks, summed there in a
                       fixed order (source rank, then slot), so results do not depend on timing

`TorchBackend` implements them with torch.distributed collectives (gloo on CPU, NCCL on GPU). It is
the portable reference and may synchronise the host (split sizes are host lists).
"""

from __future__ import annotations

import math
import os
import socket

import torch
import torch.distributed as dist

from topoep.config import BACKENDS, TRANSPORTS
from topoep.plan import Plan
from topoep.runtime.pool import ReplicaPool


def local_gpu(local_rank: int, launch_hint: str) -> torch.device:
    """This process's GPU under a launcher that starts one process per GPU (torchrun, srun): cuda:local_rank, after
    checking that the node has it. A local rank past the node's GPUs means more processes than GPUs were started,
    which NCCL refuses (and which would make every measured time meaningless): the error says so and how to launch."""
    n = torch.cuda.device_count()
    if not 0 <= local_rank < n:
        raise ValueError(f"local rank {local_rank} has no GPU of its own: this node shows {n} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Start one process per "
                         f"GPU: {launch_hint}")
    return torch.device("cuda", local_rank)


class _Done:
    """A finished 'asynchronous' operation (single process, or a zero-size exchange)."""

    def __init__(self, out):
        self.out = out

    def wait(self):
        return self.out


class _Pending:
    def __init__(self, work, out):
        self.work, self.out = work, out

    def wait(self):
        self.work.wait()
        return self.out


class TorchBackend:
    """torch.distributed collectives over `group` (None: the default group; no process group: 1 rank)."""

    name = "torch"
    # replica transfers per layer call that the critical path waits for (the net-benefit guard's n):
    # the forward fetch, the backward reload and the gradient return are all blocking collectives here
    exposed_replica_transfers = 3
    # all_to_all_single takes split sizes on the host: the layer copies them there once per call
    host_splits = True

    def __init__(self, group=None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1

    # -- small metadata ------------------------------------------------------------------------
    def all_gather_counts(self, local: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return local[None].clone()
        out = local.new_empty(self.world_size * local.numel())
        dist.all_gather_into_tensor(out, local.contiguous().view(-1), group=self.group)
        return out.view(self.world_size, *local.shape)

    def exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        """send: int64[R, G] rows for each destination -> int64[R, G] rows from each source."""
        if self.world_size == 1:
            return send.clone()
        out = torch.empty(send.numel(), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(out, send.contiguous().view(-1), group=self.group)
        return out.view_as(send)

    # -- token rows ----------------------------------------------------------------------------
    def _all_to_all(self, rows: torch.Tensor, send_counts, recv_counts):
        """send_counts / recv_counts: int64[R] tensors or host lists (then no device-to-host copy here)."""
        if self.world_size == 1:
            return _Done(rows)
        in_splits = send_counts if isinstance(send_counts, list) else send_counts.tolist()
        out_splits = recv_counts if isinstance(recv_counts, list) else recv_counts.tolist()
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        work = dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=self.group, async_op=True)
        return _Pending(work, out)

    def dispatch(self, rows, send_counts, recv_counts):
        """Start sending rows (grouped by destination rank) to their ranks; .wait() -> received rows."""
        return self._all_to_all(rows, send_counts, recv_counts)

    def combine(self, rows, recv_counts, send_counts):
        """The reverse of dispatch: return rows to the ranks they came from."""
        return self._all_to_all(rows, recv_counts, send_counts)

    # -- replica weights -----------------------------------------------------------------------
    def _slot_routes(self, plan: Plan):
        """For this rank: [(dest r, slot j, expert e)] it must send (as main), and
        [(src m, slot j, expert e)] it receives, both in (peer, slot) order; None when no rank holds a
        replica (every rank has the same plan, so all of them skip the exchange: the static plan, or
        the net-benefit guard's fallback to it, costs no replica collective)."""
        R, N = plan.num_ranks, plan.num_slots
        E_loc = plan.num_experts // R
        se = plan.slot_expert.tolist()
        if all(e < 0 for row in se for e in row):
            return None
        send = [(r, j, se[r][j]) for r in range(R) for j in range(N)
                if se[r][j] >= 0 and e_main(se[r][j], E_loc) == self.rank]
        recv = sorted(((e_main(e, E_loc), j, e) for j, e in enumerate(se[self.rank]) if e >= 0))
        return send, recv, E_loc

    def _exchange(self, rows: list, to_peer: list[int], from_peer: list[int], pool: ReplicaPool) -> list:
        """All-to-all of expert-sized rows (fc1 then fc2, flattened): rows[i] goes to rank to_peer[i]
        (to_peer ascending); returns the received rows, one per entry of from_peer (ascending)."""
        R = self.world_size
        n = pool.fc1[0].numel() + pool.fc2[0].numel()
        dtype, dev = pool.fc1.dtype, pool.fc1.device
        buf = torch.cat(rows) if rows else torch.empty(0, dtype=dtype, device=dev)
        in_splits = [n * to_peer.count(d) for d in range(R)]
        out_splits = [n * from_peer.count(s) for s in range(R)]
        out = torch.empty(sum(out_splits), dtype=dtype, device=dev)
        dist.all_to_all_single(out, buf, out_splits, in_splits, group=self.group)
        return list(out.split(n)) if from_peer else []

    def _relay_routes(self, plan: Plan, fanout: int):
        """Per level of the relay trees (topoep.relay), for this rank: [(dest r, slot j, expert e)] it sends and
        [(src s, slot j, expert e)] it receives, both in (peer, slot) order; None when no rank holds a replica."""
        from topoep.relay import executed_sources

        R, N = plan.num_ranks, plan.num_slots
        se = plan.slot_expert.tolist()
        if all(e < 0 for row in se for e in row):
            return None
        source, level = (t.tolist() for t in executed_sources(plan, fanout))
        levels = max(max(row) for row in level)
        out = []
        for lv in range(1, levels + 1):
            send = [(r, j, se[r][j]) for r in range(R) for j in range(N)
                    if level[r][j] == lv and source[r][j] == self.rank]
            recv = sorted((source[self.rank][j], j, se[self.rank][j]) for j in range(N) if level[self.rank][j] == lv)
            out.append((send, recv))
        return out

    def _relay_steps(self, routes: list, chunks: int, n: int, reverse: bool = False):
        """The steps of a chunked relayed transfer (topoep.relay.relay_steps): per step, [(peer, slot j, expert e,
        lo, hi)] this rank sends and receives, each moving elements [lo, hi) of a flattened copy of n elements, both
        in (peer, slot) order. reverse: the gradient return, the deepest level first (a level's send list becomes
        what it receives)."""
        from topoep.relay import chunk_range, step_chunk

        L = len(routes)
        out = []
        for step in range(L + chunks - 1):
            send, recv = [], []
            for lv, (snd, rcv) in enumerate(routes, start=1):
                c = step_chunk(step, L + 1 - lv if reverse else lv, chunks)
                if c is None:
                    continue
                lo, hi = chunk_range(n, chunks, c)
                if reverse:
                    snd, rcv = rcv, snd
                send += [(peer, j, e, lo, hi) for peer, j, e in snd]
                recv += [(peer, j, e, lo, hi) for peer, j, e in rcv]
            out.append((sorted(send), sorted(recv)))
        return out

    def _exchange_chunks(self, rows: list, send: list, recv: list, like: torch.Tensor) -> list:
        """All-to-all of chunk rows: rows[i] (elements hi - lo of send[i]) to rank send[i][0]; returns the received
        rows, one per entry of recv (their lengths from its lo, hi)."""
        R = self.world_size
        in_splits, out_splits = [0] * R, [0] * R
        for peer, _, _, lo, hi in send:
            in_splits[peer] += hi - lo
        for peer, _, _, lo, hi in recv:
            out_splits[peer] += hi - lo
        buf = torch.cat(rows) if rows else like.new_empty(0)
        out = like.new_empty(sum(out_splits))
        dist.all_to_all_single(out, buf, out_splits, in_splits, group=self.group)
        return list(out.split([hi - lo for *_, lo, hi in recv])) if recv else []

    def _held(self, e: int, plan_row: list, main: list, pool_tensor, E_loc: int):
        """This rank's copy of expert e: its main weights when e is its own (a self-replica included), else the slot
        that holds it (one per rank)."""
        if e_main(e, E_loc) == self.rank:
            return main[e - self.rank * E_loc]
        return pool_tensor[plan_row.index(e)]

    def _tree_nodes(self, plan: Plan, fanout: int):
        """`_relay_routes` flattened: [(level, dest r, slot j, expert e)] of the copies this rank sends, a level's
        before the next level's, and {slot j: (source s, level, expert e)} of the copies it receives; None when no
        rank holds a replica."""
        routes = self._relay_routes(plan, fanout)
        if routes is None:
            return None
        sends = [(lv, r, j, e) for lv, (send, _) in enumerate(routes, start=1) for r, j, e in send]
        recvs = {j: (s, lv, e) for lv, (_, recv) in enumerate(routes, start=1) for s, j, e in recv}
        return sends, recvs

    def _fetch_async(self, plan: Plan, main_fc1: list, main_fc2: list, pool: ReplicaPool, fanout: int) -> None:
        """Down the relay trees copy by copy (LayerConfig.relay_schedule "async"): point-to-point sends and receives
        (tagged by the receiving slot), issued by every rank in one global order of the transfers, (level, source
        rank, destination rank, slot); a relay waits for its own copy only before it sends that copy on. A transfer
        waits only for transfers of a lower level, and every rank issues its own in the same order, so no cycle of
        waits forms, whether the process group runs point-to-point operations concurrently (gloo) or in issue order
        on one stream (NCCL). The slots end as level by level."""
        nodes = self._tree_nodes(plan, fanout)
        if nodes is None:
            return
        sends, recvs = nodes
        E_loc, n1, dtype = plan.num_experts // plan.num_ranks, pool.fc1[0].numel(), pool.fc1.dtype
        n = n1 + pool.fc2[0].numel()
        row = plan.slot_expert[self.rank].tolist()
        me = self.rank
        # the transfers this rank takes part in, in the global order: ("send", r, j, e) / ("recv", s, j, e)
        ops = sorted([((lvl, me, r, j), "send", r, j, e) for lvl, r, j, e in sends if r != me]
                     + [((lvl, s, me, j), "recv", s, j, e) for j, (s, lvl, e) in recvs.items() if s != me])
        got, pending, works = {}, {}, []

        def held(e: int) -> torch.Tensor:  # my copy of e, flat: my main weights, or my slot's once it arrived
            if e_main(e, E_loc) == me:
                return _flat_range(main_fc1[e - me * E_loc].detach(), main_fc2[e - me * E_loc].detach(), 0,
                                   n).to(dtype).contiguous()
            j = row.index(e)
            if j in pending:
                pending.pop(j).wait()
            return got[j]

        for lvl, r, j, e in sends:  # copies of my own experts into my own slots (a self-replica) need no transfer
            if r == me:
                _flat_range_update(pool.fc1[j], pool.fc2[j], 0, n, held(e), add=False)
        for _, kind, peer, j, e in ops:
            if kind == "recv":
                got[j] = pool.fc1.new_empty(n)
                pending[j] = dist.irecv(got[j], group=self.group, group_src=peer, tag=j)
            else:
                data = held(e)
                works.append((dist.isend(data, group=self.group, group_dst=peer, tag=j), data))
        for j in sorted(pending):
            pending[j].wait()
        for j in sorted(got):
            _flat_range_update(pool.fc1[j], pool.fc2[j], 0, n, got[j], add=False)
        for w, _ in works:
            w.wait()

    def _return_async(self, plan: Plan, pool: ReplicaPool, grad_fc1: list, grad_fc2: list, fanout: int) -> None:
        """Up the relay trees copy by copy (LayerConfig.relay_schedule "async"): the fetch's transfers reversed, issued
        by every rank in one global order, deepest level first, then (source rank, destination rank, slot) of the
        fetch's transfer; a copy adds its children's gradients in (child rank, slot) order onto its own (as
        `_return_relayed` adds them: the same sums bit for bit) before it sends the result to the rank it fetched
        from, and a home adds its children's onto its main gradient. A transfer waits only for transfers of a deeper
        level, and every rank issues its own in the same order: no cycle of waits (`_fetch_async`)."""
        nodes = self._tree_nodes(plan, fanout)
        if nodes is None:
            return
        sends, recvs = nodes
        E_loc, n1 = plan.num_experts // plan.num_ranks, pool.fc1[0].numel()
        n = n1 + pool.fc2[0].numel()
        row = plan.slot_expert[self.rank].tolist()
        me = self.rank
        # the children of my copy of e (my main expert or my slot holding it): the copies fetched from me, deepest
        # level first, then in (rank, slot) order (as `_return_relayed` adds them)
        children: dict[int, list] = {}
        for lvl, r, j, e in sorted(sends, key=lambda t: (-t[0], t[1], t[2])):
            children.setdefault(e, []).append((r, j))
        ops = sorted([((-lvl, me, r, j), "recv", r, j, e) for lvl, r, j, e in sends if r != me]
                     + [((-lvl, s, me, j), "send", s, j, e) for j, (s, lvl, e) in recvs.items()
                        if s != me and e_main(e, E_loc) != me])
        incoming, works = {}, []

        def add_children(e: int, g1: torch.Tensor, g2: torch.Tensor) -> None:
            for r, j in children.get(e, ()):  # a fixed summation order
                if r == me:
                    data = _flat_range(pool.fc1[j], pool.fc2[j], 0, n)
                else:
                    work, data = incoming.pop((r, j))
                    work.wait()
                _flat_range_update(g1, g2, 0, n, data, add=True)

        for _, kind, peer, j, e in ops:
            if kind == "recv":
                buf = pool.fc1.new_empty(n)
                incoming[(peer, j)] = (dist.irecv(buf, group=self.group, group_src=peer, tag=j), buf)
            else:  # my slot j: its subtree's sum, to the rank it fetched from
                add_children(e, pool.fc1[j], pool.fc2[j])
                data = _flat_range(pool.fc1[j], pool.fc2[j], 0, n).contiguous()
                works.append((dist.isend(data, group=self.group, group_dst=peer, tag=j), data))
        for e in sorted(children):
            if e_main(e, E_loc) == me:
                add_children(e, grad_fc1[e - me * E_loc], grad_fc2[e - me * E_loc])
        for w, _ in works:
            w.wait()

    def fetch_replicas(self, plan: Plan, main_fc1: list, main_fc2: list, pool: ReplicaPool,
                       relay_fanout: int | None = None, relay_chunks: int = 1, relay_schedule: str = "levels") -> None:
        """Copy every replicated expert's weights into the slot the plan gives it: from its main rank, or with
        relay_fanout down the relay trees of topoep.relay, level by level (a copy is sent on once its level has
        arrived), each copy in relay_chunks chunks whose levels overlap (`topoep.relay.relay_steps`), or with
        relay_schedule "async" copy by copy (`_fetch_async`)."""
        if relay_fanout is not None and self.world_size > 1 and pool.num_slots:
            if relay_schedule == "async":
                return self._fetch_async(plan, main_fc1, main_fc2, pool, relay_fanout)
            return self._fetch_relayed(plan, main_fc1, main_fc2, pool, relay_fanout, relay_chunks)
        routes = None if self.world_size == 1 or pool.num_slots == 0 else self._slot_routes(plan)
        if routes is None:  # no replica anywhere (the same on every rank)
            return
        send, recv, E_loc = routes
        dtype = pool.fc1.dtype
        rows = [torch.cat([main_fc1[e - self.rank * E_loc].detach().reshape(-1).to(dtype),
                           main_fc2[e - self.rank * E_loc].detach().reshape(-1).to(dtype)]) for _, _, e in send]
        n1 = pool.fc1[0].numel()
        for row, (_, j, _) in zip(self._exchange(rows, [r for r, _, _ in send], [m for m, _, _ in recv], pool), recv):
            pool.fc1[j].copy_(row[:n1].view_as(pool.fc1[j]))
            pool.fc2[j].copy_(row[n1:].view_as(pool.fc2[j]))

    def _fetch_relayed(self, plan: Plan, main_fc1: list, main_fc2: list, pool: ReplicaPool, fanout: int,
                       chunks: int) -> None:
        """Down the relay trees in the steps of topoep.relay.relay_steps: step s moves chunk s - (l - 1) of every
        copy of level l (a relay forwards a chunk once it has it)."""
        routes = self._relay_routes(plan, fanout)
        if routes is None:
            return
        E_loc, n1, dtype = plan.num_experts // plan.num_ranks, pool.fc1[0].numel(), pool.fc1.dtype
        n = n1 + pool.fc2[0].numel()
        row = plan.slot_expert[self.rank].tolist()
        for send, recv in self._relay_steps(routes, chunks, n):
            rows = [_flat_range(self._held(e, row, main_fc1, pool.fc1, E_loc).detach(),
                                self._held(e, row, main_fc2, pool.fc2, E_loc).detach(), lo, hi).to(dtype)
                    for _, _, e, lo, hi in send]
            for data, (_, j, _, lo, hi) in zip(self._exchange_chunks(rows, send, recv, pool.fc1), recv):
                _flat_range_update(pool.fc1[j], pool.fc2[j], lo, hi, data, add=False)

    def _return_relayed(self, plan: Plan, pool: ReplicaPool, grad_fc1: list, grad_fc2: list, fanout: int,
                        chunks: int) -> None:
        """The relay trees in reverse, deepest level first, in the chunked steps of the fetch: every copy sends its
        gradient (its own plus what its children sent, added in (child rank, slot) order) to the rank it fetched
        from. Element by element the sums are the same whatever the chunks."""
        routes = self._relay_routes(plan, fanout)
        if routes is None:
            return
        E_loc, n1 = plan.num_experts // plan.num_ranks, pool.fc1[0].numel()
        n = n1 + pool.fc2[0].numel()
        row = plan.slot_expert[self.rank].tolist()
        for send, recv in self._relay_steps(routes, chunks, n, reverse=True):
            rows = [_flat_range(pool.fc1[j], pool.fc2[j], lo, hi) for _, j, _, lo, hi in send]
            got = self._exchange_chunks(rows, send, recv, pool.fc1)
            for data, (_, j, e, lo, hi) in zip(got, recv):  # (child rank, slot) order: a fixed summation order
                # the parent's copy of e: its main gradient, or (a relay) the slot it holds e in
                g1 = self._held(e, row, grad_fc1, pool.fc1, E_loc)
                g2 = self._held(e, row, grad_fc2, pool.fc2, E_loc)
                _flat_range_update(g1, g2, lo, hi, data, add=True)

    def return_grads(self, plan: Plan, pool: ReplicaPool, grad_fc1: list, grad_fc2: list,
                     relay_fanout: int | None = None, relay_chunks: int = 1, relay_schedule: str = "levels") -> None:
        """Send the slots' weight gradients (held in pool.fc1/fc2) to the main ranks and add them to
        grad_fc1/grad_fc2 (this rank's main experts), in source-rank then slot order; with relay_fanout up the
        relay trees (`_return_relayed`, or with relay_schedule "async" `_return_async`)."""
        if relay_fanout is not None and self.world_size > 1 and pool.num_slots:
            if relay_schedule == "async":
                return self._return_async(plan, pool, grad_fc1, grad_fc2, relay_fanout)
            return self._return_relayed(plan, pool, grad_fc1, grad_fc2, relay_fanout, relay_chunks)
        routes = None if self.world_size == 1 or pool.num_slots == 0 else self._slot_routes(plan)
        if routes is None:
            return
        send, recv, E_loc = routes
        # what this rank holds (the fetch's recv list) goes back to its main rank, in (main, slot) order
        rows = [torch.cat([pool.fc1[j].reshape(-1), pool.fc2[j].reshape(-1)]) for _, j, _ in recv]
        n1 = pool.fc1[0].numel()
        received = self._exchange(rows, [m for m, _, _ in recv], [r for r, _, _ in send], pool)
        for row, (_, _, e) in zip(received, send):  # sorted by (source rank, slot): a fixed summation order
            li = e - self.rank * E_loc
            grad_fc1[li].add_(row[:n1].view_as(grad_fc1[li]))
            grad_fc2[li].add_(row[n1:].view_as(grad_fc2[li]))


def _flat_parts(a: torch.Tensor, b: torch.Tensor, lo: int, hi: int) -> list:
    """Elements [lo, hi) of a and b flattened one after the other (a, then b), as 1-d pieces: (tensor, its flat
    range) pairs."""
    n1 = a.numel()
    parts = []
    if lo < n1:
        parts.append((a, lo, min(hi, n1)))
    if hi > n1:
        parts.append((b, max(lo, n1) - n1, hi - n1))
    return parts


def _flat_range(a: torch.Tensor, b: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of a and b flattened one after the other, as one 1-d tensor."""
    parts = [t.reshape(-1)[i:j] for t, i, j in _flat_parts(a, b, lo, hi)]
    return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else a.new_empty(0)


def _flat_range_update(a: torch.Tensor, b: torch.Tensor, lo: int, hi: int, data: torch.Tensor, add: bool) -> None:
    """Elements [lo, hi) of a and b flattened one after the other: <- data, or += data with `add` (in place, also in
    a tensor that is not contiguous)."""
    at = 0
    for t, i, j in _flat_parts(a, b, lo, hi):
        d = data[at:at + j - i]
        at += j - i
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)  # a copy when t is not contiguous
        flat[i:j].add_(d) if add else flat[i:j].copy_(d)
        if not t.is_contiguous():
            t.copy_(flat.view_as(t))


def e_main(e: int, experts_per_rank: int) -> int:
    return e // experts_per_rank


def capacity_rows(max_rows: int, capacity_factor: float, num_ranks: int) -> int:
    """Rows of one receive region under a capacity: ceil(capacity_factor x max_rows), max_rows = T x top_k of the
    largest call (the same on every rank), never above num_ranks x max_rows, which no region can receive (so a huge
    capacity_factor stays in the planners' integer range)."""
    return min(math.ceil(capacity_factor * max_rows), num_ranks * max_rows)


def receive_regions(num_ranks: int, max_rows: int, top_k: int, chunks: int,
                    capacity_factor: float | None) -> tuple[list[int], bool]:
    """(rows of each chunk's receive region, whether a row can spill) for backend cuda. A chunk's worst case is R
    times its rows per rank (chunk 0 takes the first ceil(T / 2) tokens); a region holds that, or with a capacity
    the smaller of it and the capacity (a chunk never receives more than its call). Rows spill only from a region
    smaller than its worst case."""
    T = max_rows // top_k
    per_rank = [(T + 1) // 2 * top_k, T // 2 * top_k] if chunks == 2 and T >= 2 else [max_rows]
    worst = [num_ranks * r for r in per_rank]
    if capacity_factor is None:
        return worst, False
    cap = capacity_rows(max_rows, capacity_factor, num_ranks)
    return [min(cap, w) for w in worst], cap < max(worst)


# The transports make_backend takes: LayerConfig's, and the CPU tests' harnesses, reached through
# ExpertParallelMoE(_cpu_harness=True), not config values: "gloo", backend cuda's logic on CPU processes over gloo
# (a2a.py's workspace and pool on GlooExchange, torch references in place of the Triton kernels), and "deepep_gloo",
# transport deepep's layer over deepep.ReferenceElasticBuffer (a torch stand-in for DeepEP) with the same pool
HARNESS_TRANSPORTS = TRANSPORTS + ("gloo", "deepep_gloo")
GLOO_HARNESS = ("gloo", "deepep_gloo")


def harness_transport(transport: str) -> str:
    """The CPU harness of a configured transport (HARNESS_TRANSPORTS)."""
    return "deepep_gloo" if transport == "deepep" else "gloo"


def make_backend(name: str, group=None, max_tokens: int | None = None, transport: str = "peer"):
    if transport not in HARNESS_TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if name == "torch":
        if transport != "peer":
            raise ValueError(f"transport {transport!r} is backend 'cuda''s; backend 'torch' moves data with "
                             "torch.distributed collectives (leave transport='peer')")
        return TorchBackend(group)
    if name == "cuda":
        return CudaBackend(group, max_tokens, transport)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


class CudaBackend:
    """GPU-native backend (symm.py, cuda_function.py): CUDA symmetric memory and Triton kernels inside one
    NVLink domain, no host synchronisation. Needs torch.distributed initialised (NCCL) with one GPU per
    rank, every rank of the group on one NVLink domain (one host), and bf16 expert weights.

    max_tokens: the most tokens any rank passes to one layer call; the worst-case buffers hold
    EP size x max_tokens x top_k rows. Default: the first call's T (megatron's micro-batch shape is fixed).

    transport: "peer" (symm.py: peer pointers, every rank of the group on one host) or "a2a" (a2a.py:
    NVSHMEM all-to-alls with split sizes on the device, across hosts too; on one host it runs 2 GPUs as
    virtual domains through the same path as real RDMA) or "deepep" (deepep.py: DeepEP's dispatch and combine, the
    replicas by the peer pool on one host and the NVSHMEM pool across hosts); "gloo" runs the same logic on CPU
    processes (a2a.py over gloo, torch references for the kernels): the CPU tests' harness, and "deepep_gloo"
    transport deepep's layer there (deepep.ReferenceElasticBuffer)."""

    name = "cuda"
    # the forward fetch, the backward reload and the gradient return wait on the stream
    exposed_replica_transfers = 3
    host_splits = False

    def __init__(self, group=None, max_tokens: int | None = None, transport: str = "peer"):
        if transport not in GLOO_HARNESS and not torch.cuda.is_available():
            raise ValueError("backend 'cuda' needs a CUDA GPU; use backend='torch' on the CPU")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("backend 'cuda' needs torch.distributed initialised (init_process_group('nccl') with "
                             "one GPU per rank, e.g. under torchrun)")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer (tokens per rank per call), got {max_tokens!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.transport = transport
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        self.hosts = len(set(hosts))
        if transport == "deepep":  # before any collective allocation: a clear error where DeepEP is missing
            from topoep.runtime.deepep import import_deep_ep

            import_deep_ep()
        if transport == "peer" and len(set(hosts)) > 1:
            raise ValueError(f"backend 'cuda' with transport 'peer' moves data through peer pointers inside one host, "
                             f"but this EP group spans {len(set(hosts))} hosts: use transport='a2a' "
                             "(eplb.transport=a2a, NVSHMEM) or backend='torch'")
        self.max_tokens = max_tokens
        self._max_rows = None
        self._exchange = None
        if transport == "a2a" or (transport == "deepep" and self.hosts > 1):
            # NVSHMEM initialises collectively: here, where every rank builds its layers (deepep across hosts: the
            # replica pool's transport)
            self.exchange(torch.device("cuda", torch.cuda.current_device()))
        if transport in GLOO_HARNESS:
            from topoep.runtime.a2a import GlooExchange

            if dist.get_backend(group) != "gloo":
                raise ValueError("transport 'gloo' (backend cuda's CPU test harness) needs a gloo process group, got "
                                 f"{dist.get_backend(group)!r}")
            self._exchange = GlooExchange.shared(group)

    def max_rows(self, num_tokens: int, top_k: int, device) -> int:
        """The most rows (tokens x top_k) any rank of the group passes to one call: max_tokens x top_k, or the first
        call's, agreed over the group once (a host collective) so that every rank sizes its buffers and plans its
        capacity alike."""
        if self._max_rows is None:
            rows = torch.tensor([(self.max_tokens or num_tokens) * top_k], dtype=torch.int64, device=device)
            dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=self.group)
            self._max_rows = int(rows)
        if num_tokens * top_k > self._max_rows:
            raise ValueError(f"this call routes T={num_tokens} tokens x top_k={top_k}, but backend 'cuda' sized its "
                             f"buffers for {self._max_rows // top_k} tokens per rank (max_tokens, default the largest "
                             "first call's T): pass max_tokens=<the largest T> to ExpertParallelMoE")
        return self._max_rows

    def workspace(self, num_tokens: int, top_k: int, num_experts: int, num_slots: int, hidden: int, dtype, device,
                  chunks: int = 1, capacity_factor: float | None = None, deepep_deterministic: bool = False):
        """The process-wide symmetric buffers for calls of this shape (created on first use: collective): a receive
        region per chunk (`receive_regions`)."""
        from topoep.runtime.symm import SymmWorkspace

        rows = self.max_rows(num_tokens, top_k, device)
        if self.transport in ("deepep", "deepep_gloo"):
            from topoep.runtime.deepep import DeepEPWorkspace

            return DeepEPWorkspace.shared(self.group, rows // top_k, hidden, top_k, self.transport == "deepep_gloo",
                                          deepep_deterministic)
        regions, spills = receive_regions(self.world_size, rows, top_k, chunks, capacity_factor)
        E_loc = num_experts // self.world_size
        G = E_loc + num_slots
        if self.transport in ("a2a", "gloo"):
            from topoep.runtime.a2a import A2AWorkspace

            return A2AWorkspace.shared(self.exchange(device), G, E_loc, rows, hidden, dtype, regions, spills)
        return SymmWorkspace.shared(self.group, G, E_loc, max(num_experts, self.world_size * G), rows, hidden, dtype,
                                    device, regions, spills)

    def replica_pool(self, num_slots: int, hidden: int, ffn_hidden: int, dtype, device, banks: int = 1):
        """The process's replica pool for this group, shape and number of banks of slots (2: LayerConfig.prefetch)."""
        from topoep.runtime.symm import SymmReplicaPool

        if not num_slots:
            return None
        if self.transport in ("a2a", "gloo", "deepep_gloo") or (self.transport == "deepep" and self.hosts > 1):
            from topoep.runtime.a2a import A2AReplicaPool

            return A2AReplicaPool.shared(self.exchange(device), num_slots, hidden, ffn_hidden, dtype, banks)
        return SymmReplicaPool.shared(self.group, num_slots, hidden, ffn_hidden, dtype, device, banks)

    def exchange(self, device):
        """transport 'a2a': the process's NVSHMEM exchange of this group (created by the constructor, where
        every rank builds its layers: collective)."""
        if self._exchange is None:
            from topoep.runtime.a2a import NvshmemExchange

            self._exchange = NvshmemExchange.shared(self.group, device)
        return self._exchange
