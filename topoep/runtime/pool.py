"""The replica-slot pool: N expert-weight buffers per rank, allocated once and shared by every MoE layer
of a model (paper 3.2). Applying a plan copies the replicated experts' weights into the slots; in the
backward pass the same storage holds the replica weight gradients before they go back to their main
ranks. Only compute-dtype weights live here (BF16 on GPU): optimizer state never moves.
"""

from __future__ import annotations

import weakref

import torch


def _device_key(device) -> torch.device | None:
    """One key per device: "cuda" and "cuda:0" on a process whose current device is 0 are the same pool."""
    if device is None:
        return None
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class ReplicaPool:
    """fc1: [N, 2F, H] and fc2: [N, H, F] slot buffers. `ReplicaPool.shared(...)` returns the one pool of
    a given shape, dtype and device, so that all layers of a model reuse the same memory; it lives as long as a layer
    holds it (a model cast to another dtype after construction leaves the old pool to be freed)."""

    allocations = 0  # number of pools ever allocated in this process (tests check it stays 1)
    _shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self, num_slots: int, hidden_size: int, ffn_hidden_size: int, dtype=torch.float32, device=None):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.fc1 = torch.zeros(num_slots, 2 * ffn_hidden_size, hidden_size, dtype=dtype, device=device)
        self.fc2 = torch.zeros(num_slots, hidden_size, ffn_hidden_size, dtype=dtype, device=device)
        ReplicaPool.allocations += 1

    @classmethod
    def shared(cls, num_slots: int, hidden_size: int, ffn_hidden_size: int, dtype=torch.float32, device=None):
        key = (num_slots, hidden_size, ffn_hidden_size, dtype, _device_key(device))
        pool = cls._shared.get(key)
        if pool is None:
            pool = cls(num_slots, hidden_size, ffn_hidden_size, dtype, device)
            cls._shared[key] = pool
        return pool

    def slot_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.fc1.unbind(0)), list(self.fc2.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.fc1.numel() * self.fc1.element_size() + self.fc2.numel() * self.fc2.element_size()


class SlotBanks:
    """Host bookkeeping of backend cuda's replica pools (symm.SymmReplicaPool, a2a.A2AReplicaPool): which fill
    each bank of slots holds, and the forward calls whose backward is still to come.

    With one bank (the default) every fetch overwrites the slots. With two (LayerConfig.prefetch;
    cuda_function.start_fetch, prefetch_after_backward), forward fills alternate between the banks, so the
    last two MoE layers of a model find their replicas still in place when their backward comes, and at the
    end of a layer's backward the bank it releases is refilled, beside the next layer's backward, with the
    replicas of the layer whose backward comes after that one (autograd runs the layers in reverse).

    Everything here is a host int, changed only by calls that every rank makes in the same order, so every
    rank takes the same decisions (and makes the same collectives) without reading the device."""

    # True: every backward reloads its replicas, even when the bank still holds them (what every MoE layer but the
    # last does in a model with several of them); benchmarks of a single layer set it to show what such a layer costs
    reload_always = False

    # set by the pools: _banked = (fc1 [banks, N, 2F, H], fc2 [banks, N, H, F]); fc1, fc2 = bank_weights(0)

    def bank_weights(self, bank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fc1 [N, 2F, H], fc2 [N, H, F]) of one bank of slots."""
        return self._banked[0][bank], self._banked[1][bank]

    def slot_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.fc1.unbind(0)), list(self.fc2.unbind(0))

    def init_banks(self, banks: int) -> None:
        if banks not in (1, 2):
            raise ValueError(f"a replica pool has 1 or 2 banks of slots, got {banks}")
        self.banks = banks
        self.holds: list = [None] * banks  # the fill (a number from `fills`) each bank holds
        self.fills = 0  # fetches issued, forward, reload and prefetch
        self.reloads_skipped = 0  # backward reloads left out: the bank still held the call's replicas
        self.prefetches = 0  # fills issued at the end of a backward for a later one
        self.graphed = False  # a fetch was captured in a CUDA graph: never leave a reload out again
        self.last = banks - 1  # bank of the latest forward fill (the next one goes to the other)
        self.pending: list = []  # forward calls whose backward has not run, oldest first (cuda_function.PENDING_MAX)
        self.unpublished: list = [None] * banks  # per bank: event of a prefetch no barrier has published yet
