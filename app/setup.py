"""Process groups, megatron parallel state, the TransformerConfig, model, optimizer and scheduler of a job."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from app.config import EplbConfig, ModelConfig, ParallelConfig, RouterConfig, TopologyConfig, TrainerConfig
from topoep.metrics import ffn_time_per_assignment
from topoep.runtime.backend import local_gpu
from topoep.topology import Topology, slurm_tasks_per_node


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device


def init_distributed(trainer: TrainerConfig) -> Dist:
    """torch.distributed from the launcher's environment (torchrun or srun); gloo on CPU, NCCL on GPU."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:  # srun without torchrun
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE") or slurm_tasks_per_node(env.get("SLURM_NTASKS_PER_NODE")) or world)
    if dist.is_initialized():  # an earlier job of this process (keep_distributed): reuse its group
        device = torch.device("cuda", local_rank) if trainer.device == "cuda" else torch.device("cpu")
        if (dist.get_backend() == "nccl") != (trainer.device == "cuda"):
            raise ValueError(f"trainer.device={trainer.device} differs from the process group this process already "
                             f"has ({dist.get_backend()}): run CPU and GPU jobs in separate processes")
        return Dist(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device)
    if world == 1:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    if trainer.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is available: use trainer=cpu")
        device = local_gpu(local_rank, f"torchrun --nproc_per_node={torch.cuda.device_count()}, or srun with "
                                       f"--ntasks-per-node={torch.cuda.device_count()} (launch/)")
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                timeout=datetime.timedelta(minutes=10))
    else:
        from topoep.megatron.cpu_compat import enable_cpu_compat

        enable_cpu_compat()
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    return Dist(rank, world, local_rank, local_world, device)


def resolve_parallel(par: ParallelConfig, model: ModelConfig, world: int) -> ParallelConfig:
    """Fill ep and check the layout against the world size; errors name the field and the fix."""
    if world % (par.tp * par.pp):
        raise ValueError(f"world size {world} is not divisible by parallel.tp * parallel.pp = {par.tp * par.pp}")
    ep = par.ep if par.ep is not None else max(1, world // (par.tp * par.pp * par.expert_tp))
    if (world // par.pp) % (ep * par.expert_tp):
        raise ValueError(f"parallel.ep={ep} x parallel.expert_tp={par.expert_tp} must divide the ranks of a pipeline "
                         f"stage ({world // par.pp}); pick ep among the divisors")
    if model.num_moe_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide model.num_moe_experts={model.num_moe_experts}: choose an "
                         "ep that divides the number of experts")
    if par.tp > 1 and model.num_attention_heads % par.tp:
        raise ValueError(f"parallel.tp={par.tp} must divide model.num_attention_heads={model.num_attention_heads}")
    if model.num_layers % par.pp:
        raise ValueError(f"parallel.pp={par.pp} must divide model.num_layers={model.num_layers}")
    return ParallelConfig(tp=par.tp, pp=par.pp, ep=ep, expert_tp=par.expert_tp, num_microbatches=par.num_microbatches)


def init_model_parallel(par: ParallelConfig) -> None:
    """megatron's parallel state for this layout; kept when an earlier job of the process left the same one
    (its groups, and the workspaces cached per group, are reused), rebuilt when the layout differs. Also
    clears megatron's per-layer router-bias cache (moe_router_force_biased draws a bias once per process and
    layer number and keeps it): each job draws its own, as a fresh process would."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.moe_utils import RandomSTEShared

    RandomSTEShared._cache.clear()
    # megatron's process-wide MoE metrics tracker sizes its entries by the first model's layer count and
    # keeps adding to them: a fresh one per job
    moe_logging.set_moe_metrics_tracker(None)
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size() == par.tp
                and ps.get_pipeline_model_parallel_world_size() == par.pp
                and ps.get_expert_model_parallel_world_size() == par.ep
                and ps.get_expert_tensor_parallel_world_size() == par.expert_tp)
        if same:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                                 expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.expert_tp)


def build_topology(topo: TopologyConfig, ep: int, local_world_size: int) -> Topology:
    """NVLink domains of the EP group: a node, or virtual domains of topology.ranks_per_domain ranks."""
    rpd = topo.ranks_per_domain or min(local_world_size, ep)
    if rpd > ep or ep % rpd:
        raise ValueError(f"the domain size {rpd} (topology.ranks_per_domain, or the ranks per node) does not divide "
                         f"the expert-parallel size {ep}: set topology.ranks_per_domain to a divisor of {ep}"
                         + (" (or run more processes: e.g. torchrun --nproc_per_node=4 for trainer=cpu's 2 virtual "
                            "domains of 2; topology=node makes one domain of the ranks there are)" if ep == 1 else ""))
    return Topology(num_domains=ep // rpd, ranks_per_domain=rpd, intra_cost=1e-9 / topo.intra_gbytes_per_s,
                    inter_cost=1e-9 / topo.inter_gbytes_per_s)


def transformer_config(model: ModelConfig, par: ParallelConfig, trainer: TrainerConfig, router: RouterConfig):
    """megatron-core's (MLA)TransformerConfig for this job."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = torch.bfloat16 if trainer.bf16 else torch.float32
    moe_layer_freq = [0] * model.first_k_dense + [1] * (model.num_layers - model.first_k_dense)
    kw = dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
        normalization=model.normalization, layernorm_epsilon=model.layernorm_epsilon, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=model.num_moe_experts, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk, moe_layer_freq=moe_layer_freq,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_pre_softmax=model.moe_router_pre_softmax, moe_router_dtype=model.moe_router_dtype,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type, moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp, expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp, sequence_parallel=par.tp > 1,
        bf16=trainer.bf16, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=trainer.device == "cpu",
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    if model.kv_channels is not None:
        kw["kv_channels"] = model.kv_channels
    if router.name == "synthetic":
        # paper 6.4: random logits + fixed expert bias; measuring balancers: no aux loss
        kw.update(moe_router_force_biased=router.router_skew, moe_aux_loss_coeff=0.0,
                  moe_router_load_balancing_type="none")
    if router.name == "balanced":  # the balanced upper bound: random logits only
        kw.update(moe_router_force_load_balancing=True, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    if model.multi_latent_attention:
        kw.update(multi_latent_attention=True, **model.mla)
        return MLATransformerConfig(**kw)
    return TransformerConfig(**kw)


def install_router_bias(model, router: RouterConfig, num_experts: int, ep: int, dtype=torch.float32) -> int:
    """router.layout other than megatron: put our fixed bias (`topoep.workloads.expert_bias`, the same on
    every rank) into megatron's per-layer bias cache, which moe_router_force_biased with a negative std
    reads instead of drawing its own. Returns the number of routers given a bias."""
    if router.name != "synthetic" or router.layout == "megatron" or not router.router_skew:
        return 0
    from megatron.core.transformer.moe.moe_utils import RandomSTEShared
    from megatron.core.transformer.moe.router import TopKRouter

    from topoep.workloads import expert_bias

    n = 0
    for m in model.modules():
        if isinstance(m, TopKRouter):
            bias = expert_bias(num_experts, router.router_skew, num_ranks=ep, seed=router.seed + m.layer_number,
                               layout=router.layout)
            RandomSTEShared._cache[m.layer_number] = bias.to(m.weight.device, dtype)
            n += 1
    return n


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = 128 * tp
    return (vocab + multiple - 1) // multiple * multiple


def default_t_ffn(model: ModelConfig, eplb: EplbConfig) -> float:
    return eplb.t_ffn if eplb.t_ffn is not None else ffn_time_per_assignment(model.hidden_size, model.moe_ffn_hidden_size)
