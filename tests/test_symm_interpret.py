"""Backend cuda's peer transport for replica weights (topoep/runtime/symm.py, `SymmReplicaPool`: the fetch and the
gradient return, level by level and copy by copy, LayerConfig.relay_schedule) run on the CPU in Triton's interpreter:
one process per rank of 8 (2 domains of 4, and 4 domains of 2 where the remote domains' first copies relay to each
other across the NIC; hot experts: relay trees of fanout 1 and 2 with chains of 3 and more hops), the pool's
symmetric buffers replaced by tensors in shared memory whose addresses every process maps, its barriers by a barrier
of the processes. The pool's own code runs (its buffers, tables and launches): three rounds,
level by level then twice copy by copy (the flags keep the earlier round's epoch; the later must wait for its own).
Every slot receives its expert's weights of that round bit for bit, and the copy-by-copy return leaves the same
homes' gradients and relays' sums, bit for bit, as the level-by-level one, also where home ranks hold copies of their
own experts (a copy-by-copy return that lists such a slot among its own children hangs here, as on the GPU). The processes run at once, so a relay
really waits for its parent's flag (without either wait the test fails). On the GPU: tools/gpu_session.sh
relay_async."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the torch CUDA wheel's) for its interpreter")

from topoep import Topology, solve  # noqa: E402
from topoep.relay import RelayTrees, max_level, relay_sources  # noqa: E402

R, RPD, N, E_LOC, H, F = 8, 4, 3, 2, 64, 96  # fc1: 12288 elements (one chunk and a part), fc2: 6144 (a part)
ROUNDS = (("levels", 0), ("async", 0), ("async", 1))  # (schedule, which weights and gradients)


def _patch_interpreter():
    """Triton 3.6's interpreter turns a loaded scalar into a one-element array, which numpy 2 will not make an int
    (range(tl.load(count))): take its element."""
    import numpy as np
    import triton.runtime.interpreter as ti

    original = ti._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = patched


def _rank(me, fanout, rpd, trees, inputs, buffers, barrier, out):
    _patch_interpreter()
    from topoep.runtime.symm import SymmReplicaPool

    class Buffer:  # a symmetric buffer: this rank's tensor, every rank's address, the processes' barrier
        def __init__(self, tensors):
            self.tensor, self.peers = tensors[me], tensors  # (the peers' mappings must outlive their addresses)
            self.ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)

        def barrier(self, channel: int = 0) -> None:
            barrier.wait()

    class Pool(SymmReplicaPool):
        def _world(self):
            return R, me

        def _buffer(self, shape, dtype, device):
            tensors = buffers.pop(0)
            assert tensors[me].shape == shape and tensors[me].dtype == dtype
            return Buffer(tensors)

        @staticmethod
        def _num_programs(device):
            return 2

    pool = Pool(None, N, H, F, torch.bfloat16, "cpu")
    se, source, level = trees
    for k, (schedule, which) in enumerate(ROUNDS):
        relay = RelayTrees(source, level, max_level(Topology(num_domains=R // rpd, ranks_per_domain=rpd), fanout),
                           1, schedule, fanout)
        W1, W2, g1, g2 = (t[me].clone() for t in inputs[which])
        pool.fetch(se, W1, W2, E_LOC, 0, relay)
        barrier.wait()  # every rank's pushes are done (the runtime's barrier after a fetch)
        out["fc1"][k, me], out["fc2"][k, me] = pool.fc1, pool.fc2
        main1 = torch.zeros(E_LOC, 2 * F, H, dtype=torch.bfloat16)
        main2 = torch.zeros(E_LOC, H, F, dtype=torch.bfloat16)
        pool.return_grads(se, main1, main2, E_LOC, src=(g1, g2), relay=relay)
        out["main1"][k, me], out["main2"][k, me], out["g1"][k, me], out["g2"][k, me] = main1, main2, g1, g2
        barrier.wait()  # every rank summed its regions before the next round writes them


def _plan(self_copies: bool = False, rpd: int = RPD):
    """Two hot experts (0 and 4) and one warm (9) on most ranks of both domains: deep trees, one empty slot; with
    self_copies also on their home ranks (the capacity step's copy there is fetched within the rank and is no node
    of a tree: its gradient goes to the home's own regions)."""
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    base = solve(torch.ones(R, R * E_LOC, dtype=torch.int64), topo, num_slots=N, policy="static",
                 backend="reference")
    se = torch.full((R, N), -1, dtype=torch.int64)
    for r in range(R):
        hot = [e for e in (0, 4, 9) if self_copies or e // E_LOC != r][:N]
        se[r, :len(hot)] = torch.tensor(hot)
    se[3, 2] = -1
    return dataclasses.replace(base, slot_expert=se)


@pytest.mark.parametrize("fanout,self_copies,rpd", [(1, False, 4), (2, False, 4), (2, True, 4), (1, False, 2),
                                                    (2, True, 2)])
def test_peer_transport_in_the_interpreter(fanout, self_copies, rpd, monkeypatch):
    import torch.multiprocessing as mp

    from test_relay import copies_at_home, nic_relays
    from topoep.runtime.symm import SymmReplicaPool

    plan = _plan(self_copies, rpd)
    source, level = relay_sources(plan, fanout)
    assert int(level.max()) >= 3  # chains of relays
    assert (nic_relays(plan, source) > 0) == (R // rpd > 2)  # 4 domains: remote roots fetch from other domains' roots
    assert bool(copies_at_home(plan).any()) == self_copies
    gen = torch.Generator().manual_seed(fanout)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16).share_memory_()  # noqa: E731
    inputs = [(rnd(R, E_LOC, 2 * F, H), rnd(R, E_LOC, H, F), rnd(R, N, 2 * F, H), rnd(R, N, H, F)) for _ in range(2)]
    buffers = [[torch.zeros(shape, dtype=dt).share_memory_() for _ in range(R)]
               for _, shape, dt in SymmReplicaPool.buffer_shapes(R, N, H, F, torch.bfloat16, 1)]
    K = len(ROUNDS)
    out = {"fc1": (N, 2 * F, H), "fc2": (N, H, F), "main1": (E_LOC, 2 * F, H), "main2": (E_LOC, H, F),
           "g1": (N, 2 * F, H), "g2": (N, H, F)}
    out = {k: torch.zeros(K, R, *shape, dtype=torch.bfloat16).share_memory_() for k, shape in out.items()}
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the processes build their kernels for the interpreter
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(R, timeout=300)  # a rank that fails breaks it for the others
    trees = tuple(t.reshape(-1).contiguous() for t in (plan.slot_expert, source, level))
    procs = [ctx.Process(target=_rank, args=(me, fanout, rpd, trees, inputs, buffers, barrier, out)) for me in range(R)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    hung = [me for me, p in enumerate(procs) if p.is_alive()]
    for me in hung:  # (a rank spinning on a flag nobody sets: stop it)
        procs[me].terminate()
    assert not hung and [p.exitcode for p in procs] == [0] * R, f"a rank failed or hung (hung: {hung})"
    for k, (_, which) in enumerate(ROUNDS):
        for r in range(R):
            for j in range(N):
                e = int(plan.slot_expert[r, j])
                if e >= 0:  # the slot holds its expert's weights of this round
                    assert torch.equal(out["fc1"][k, r, j], inputs[which][0][e // E_LOC, e % E_LOC]), (k, r, j)
                    assert torch.equal(out["fc2"][k, r, j], inputs[which][1][e // E_LOC, e % E_LOC]), (k, r, j)
    # copy by copy the homes' gradients and the relays' sums equal level by level's, bit for bit
    for name in ("main1", "main2", "g1", "g2"):
        assert torch.equal(out[name][1], out[name][0]), name
    assert out["main1"][0].abs().sum() > 0 and not torch.equal(out["main1"][2], out["main1"][0])
    # the second copy-by-copy round (other gradients): the homes got every copy's gradient once
    for r in range(R):
        for e_loc in range(E_LOC):
            e = r * E_LOC + e_loc
            copies = (plan.slot_expert == e).nonzero().tolist()
            want = sum(inputs[1][2][c, j].float() for c, j in copies) if copies else torch.zeros(2 * F, H)
            torch.testing.assert_close(out["main1"][2, r, e_loc].float(), want, rtol=0, atol=0.05 * len(copies) + 0.0)
