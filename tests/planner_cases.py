"""The random planner cases of tests/test_planner_cuda.py, and stored digests of their reference plans.

The CUDA planner's GPU test compares 2400 random plans (and all three policies) with the CPU reference, which
is the slow side: about 6 CPU-minutes, and with the serial dense-view checks most of the 151 s that the test took
on the GPU machine before. `python
tools/planner_ref_digests.py` computes the reference once, on any CPU machine, and stores a 128-bit BLAKE2b
digest of every reference output in `tests/data/planner_ref_digests.json`:
- slot_expert and route of each case and policy;
- the dense view (`Plan.to_dense`) of every tenth case.

The file is keyed by a digest of the sources that define the cases and the reference plans, and by the torch
version (the cases' omega comes from torch's generator). The GPU test uses a stored digest only when the key
is current and the case's omega has the digest stored beside it. Otherwise it computes that reference on the
spot, as before. Equal digests of (dtype, shape, bytes) mean equal tensors, so the comparison stays bit for
bit.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from topoep import Topology, solve
from topoep.workloads import biased_routing

ROOT = Path(__file__).resolve().parents[1]
DIGESTS = ROOT / "tests" / "data" / "planner_ref_digests.json"
# what the cases and the reference plans depend on
SOURCES = ("topoep/workloads.py", "topoep/topology.py", "topoep/plan.py",
           "topoep/planners/__init__.py", "topoep/planners/common.py", "topoep/planners/reference.py",
           "topoep/planners/plus.py")
W_CHOICES = (200_000, 9_437_184, 4096)
CHUNKS, CASES_PER_CHUNK = 4, 600  # 2400 cases
POLICIES = ("topoep", "static", "topoep_plus", "topoep_plus_local")
TOKEN_BYTES = 4096


def case_params(rng: random.Random) -> tuple:
    """A random case's parameters, drawn from rng (everything random_case draws, in the same order):
    R 8-128, E 40-1280, 1-16 domains, 0-4 slots, skews from uniform to extreme, layouts random / clustered
    / scattered, up to a quarter of the rows zero."""
    R = rng.choice([8, 16, 32, 64, 128])
    ks = [k for k in range(1, 1281) if 40 <= R * k <= 1280]
    E = R * rng.choice(ks)
    M = rng.choice([m for m in (1, 2, 4, 8, 16) if R % m == 0])
    N = rng.randint(0, 4)
    routing = (rng.choice([0, 16, 128, 512]), rng.randint(1, 8), rng.choice([0.0, -1.0, -2.0, -4.0, -8.0]),
               rng.randrange(1 << 30), rng.choice(["random", "clustered", "scattered"]))
    zero_rows = rng.sample(range(R), rng.randint(0, R // 4))
    return R, E, M, N, routing, zero_rows, rng.choice(W_CHOICES)


def build_case(params: tuple):
    """(omega, topology, num_slots, expert_bytes) of case_params' parameters."""
    R, E, M, N, (tokens, topk, skew, seed, layout), zero_rows, W = params
    omega = biased_routing(R, E, tokens, topk, skew, seed=seed, layout=layout)
    omega[zero_rows] = 0
    return omega, Topology(num_domains=M, ranks_per_domain=R // M), N, W


def random_case(rng: random.Random):
    return build_case(case_params(rng))


def chunk_cases(chunk: int, count: int = CASES_PER_CHUNK, workers: int = 1) -> list:
    """The first `count` cases of a chunk (each case continues the chunk's random stream); `workers` > 1
    builds their omega in that many processes."""
    rng = random.Random(1000 + chunk)
    params = [case_params(rng) for _ in range(count)]
    if workers <= 1:
        return [build_case(p) for p in params]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        built = list(pool.map(_build_case_numpy, params, chunksize=16))
    return [(torch.from_numpy(omega), *rest) for omega, *rest in built]


def _build_case_numpy(params: tuple):
    """build_case in a worker process; omega travels back as a numpy array (plain pickling, much faster
    than torch's shared-memory tensor transfer for many small tensors)."""
    torch.set_num_threads(1)
    omega, *rest = build_case(params)
    return (omega.numpy(), *rest)


def large_cases() -> list:
    """80 cases beside the chunks: half with omega scaled by 2^11, 2^22 or 2^28 + 3 (domain totals of 2^26
    and more: the refinement's 64-bit path), half with 5-6 slots (no unrolled slot loops)."""
    rng = random.Random(77)
    out = []
    for i in range(80):
        omega, topo, N, W = random_case(rng)
        if i % 2 == 0:
            omega = omega * rng.choice([1 << 11, 1 << 22, (1 << 28) + 3])
        else:
            N = rng.choice([5, 6])
        out.append((omega, topo, N, W))
    return out


def with_dense(i: int) -> bool:
    """Whether case i's dense view is compared too (to_dense is slow)."""
    return i % 10 == 0


def digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def plan_digests(plan, dense: bool) -> list[str]:
    """[slot_expert, route] (+ [dense x, dense q] when dense) digests of a plan."""
    out = [digest(plan.slot_expert), digest(plan.route)]
    if dense:
        out += [digest(v) for v in plan.to_dense()]
    return out


REFUSED = "refused"  # the reference raised ValueError: omega is beyond the policy's integer range


def reference_digests(i: int, case) -> dict:
    """{"omega": digest, policy: plan_digests or REFUSED} of case i's reference plans."""
    omega, topo, N, W = case
    out = {"omega": digest(omega)}
    for policy in POLICIES:
        try:
            ref = solve(omega, topo, num_slots=N, policy=policy, expert_bytes=W, token_bytes=TOKEN_BYTES,
                        backend="reference")
        except ValueError as err:
            if "int64 arithmetic" not in str(err):
                raise
            out[policy] = REFUSED
            continue
        out[policy] = plan_digests(ref, with_dense(i))
    return out


def reference_digests_batch(items) -> list[dict]:
    """reference_digests of [(i, case), ...] (runs in a worker process)."""
    torch.set_num_threads(1)
    return [reference_digests(i, case) for i, case in items]


def reference_digests_parallel(items, workers: int, desc: str | None = None) -> list[dict]:
    """reference_digests of [(i, case), ...], in order, computed in `workers` processes (batches of 10 cases;
    a progress bar when desc is given)."""
    batches = [items[k:k + 10] for k in range(0, len(items), 10)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = pool.map(reference_digests_batch, batches)
        if desc is not None:
            results = tqdm(results, total=len(batches), desc=desc)
        return [d for batch in results for d in batch]


def sources_key() -> str:
    """Digest of the torch version, SOURCES, and this module's case generators and constants."""
    h = hashlib.sha256(torch.__version__.encode())
    for rel in SOURCES:
        h.update(rel.encode())
        h.update((ROOT / rel).read_bytes())
    for f in (case_params, build_case, random_case, chunk_cases, _build_case_numpy, large_cases, with_dense, digest,
              plan_digests, reference_digests):  # (REFUSED is in reference_digests' source)
        h.update(inspect.getsource(f).encode())
    h.update(repr((W_CHOICES, CHUNKS, CASES_PER_CHUNK, POLICIES, TOKEN_BYTES)).encode())
    return h.hexdigest()


def cases_of(chunk: int | str, workers: int = 1) -> list:
    """The cases of chunk 0 .. CHUNKS - 1, or of "large"."""
    return large_cases() if chunk == "large" else chunk_cases(chunk, workers=workers)


CHUNK_NAMES = tuple(range(CHUNKS)) + ("large",)


def load_digests(chunk: int | str) -> list[dict] | None:
    """The stored digests of a chunk's cases, or None when the file is missing or stale."""
    if not DIGESTS.exists():
        return None
    data = json.loads(DIGESTS.read_text())
    if data.get("key") != sources_key():
        return None
    return data["chunks"].get(str(chunk))
