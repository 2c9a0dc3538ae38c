"""Typed configs of the training job, one dataclass per Hydra group (configs/<group>/*.yaml extend
`base_<group>`), each validated in __post_init__ with errors that name the field and the fix."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from topoep.config import LayerConfig


def _positive(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{obj.group}.{n} must be an integer >= 1, got {v!r}")


def _number(obj, name: str, low: float, *, above: bool = False) -> None:
    """obj.<name> must be a finite number >= low (> low with `above`); ints become floats (YAML gives 1 for 1.0)."""
    v = getattr(obj, name)
    if isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
        setattr(obj, name, v)
    if not isinstance(v, float) or not math.isfinite(v) or v < low or (above and v == low):
        raise ValueError(f"{obj.group}.{name} must be a finite number {'>' if above else '>='} {low:g}, got {v!r}")


# megatron-core's moe_router_load_balancing_type values (TransformerConfig's docstring)
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")


@dataclass(kw_only=True)
class ModelConfig:
    """A megatron-core GPT MoE model (the paper's reduced-depth models, or tiny shapes for CPU)."""

    group: ClassVar[str] = "model"  # how errors name a field: model.<field>

    name: str
    """The model's name in logs, W&B and run directories (configs/model/<name>.yaml)."""
    num_layers: int
    """Transformer layers in total (dense + MoE)."""
    first_k_dense: int = 0
    """Leading dense (non-MoE) layers (GLM-4.5-Air and DeepSeek-V2 have one)."""
    hidden_size: int
    """Model width (megatron TransformerConfig.hidden_size)."""
    num_attention_heads: int
    """Query heads per attention layer."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention; must divide num_attention_heads); None: one per query head."""
    kv_channels: int | None = None
    """Width of one attention head; None: hidden_size / num_attention_heads."""
    ffn_hidden_size: int
    """FFN size of the dense layers."""
    num_moe_experts: int
    """Routed experts per MoE layer (spread over the expert-parallel ranks)."""
    moe_ffn_hidden_size: int
    """FFN size of one routed expert."""
    moe_router_topk: int
    """Experts each token is routed to (k)."""
    moe_shared_expert_intermediate_size: int | None = None
    """FFN size of the shared experts every token goes through (Qwen2-MoE, DeepSeek-V2, GLM-4.5); None: none."""
    moe_router_score_function: str = "softmax"
    """softmax or sigmoid (GLM-4.5's router, with expert bias)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (GLM-4.5, with the sigmoid score): a per-expert bias added to the scores for the
    choice of experts only, not to the routing weights."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V2): number of expert groups ..."""
    moe_router_group_topk: int | None = None
    """... and how many of them a token may use."""
    moe_router_topk_scaling_factor: float | None = None
    """Factor the top-k routing weights are multiplied by (DeepSeek-V2's routed_scaling_factor); None: 1."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (true) or over the chosen k after it (false)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """megatron-core's balancing loss: aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, quantile_balancing or
    none. It shapes the routing the balancer sees; the balancer never changes the routing."""
    moe_aux_loss_coeff: float = 1e-3
    """Weight of the balancing loss in the total loss (>= 0)."""
    moe_router_dtype: str | None = None
    """The router's score dtype: fp32, fp64, or None (the activations' dtype)."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys (Qwen3)."""
    add_qkv_bias: bool = False
    """Bias on the query/key/value projection (Qwen2, GLM-4.5)."""
    normalization: str = "RMSNorm"
    """The model's norm layer (megatron-core's name: RMSNorm or LayerNorm)."""
    layernorm_epsilon: float = 1e-6
    """Epsilon of the norm layers."""
    rotary_base: float = 10000.0
    """RoPE base frequency."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates."""
    multi_latent_attention: bool = False
    """DeepSeek-V2's multi-head latent attention (MLA; its sizes in `mla`) instead of standard attention."""
    mla: dict[str, Any] = field(default_factory=dict)
    """MLATransformerConfig fields (q_lora_rank, kv_lora_rank, qk_head_dim, ...) when MLA is on."""
    init_method_std: float = 0.02
    """Standard deviation of the weights' normal initialisation."""
    vocab_size: int | None = None
    """None: the tokenizer's vocabulary (padded to a multiple of 128)."""
    tokenizer: str = "Qwen/Qwen3-30B-A3B"
    """The model's tokenizer on the Hugging Face Hub: data=paper tokenizes its corpus with it (one corpus per
    tokenizer); data=offline uses its own byte tokenizer."""

    def __post_init__(self):
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_moe_experts",
                  "moe_ffn_hidden_size", "moe_router_topk")
        if not 0 <= self.first_k_dense < self.num_layers:
            raise ValueError(f"model.first_k_dense must be in [0, num_layers={self.num_layers}), got {self.first_k_dense}")
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_moe_experts="
                             f"{self.num_moe_experts}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"model.moe_router_score_function must be softmax or sigmoid, got "
                             f"{self.moe_router_score_function!r}")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"model.moe_router_load_balancing_type={self.moe_router_load_balancing_type!r} is unknown "
                             f"to megatron-core; choose one of {', '.join(LOAD_BALANCING_TYPES)}")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"model.moe_router_dtype must be fp32, fp64 or null (the input's dtype), got "
                             f"{self.moe_router_dtype!r}")
        _number(self, "moe_aux_loss_coeff", 0.0)
        if self.num_query_groups is not None:
            _positive(self, "num_query_groups")
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(f"model.num_query_groups={self.num_query_groups} must divide "
                                 f"model.num_attention_heads={self.num_attention_heads}")
        if self.mla and not self.multi_latent_attention:
            raise ValueError(f"model.mla sets {', '.join(sorted(self.mla))} but model.multi_latent_attention is false: "
                             f"set model.multi_latent_attention=true or remove model.mla")


@dataclass(kw_only=True)
class EplbConfig(LayerConfig):
    """Expert-parallel load balancing: `none` is megatron's own alltoall dispatcher (the baseline); any other name
    runs the TopoEP layer with that planner policy. Every other field is `topoep.LayerConfig`'s (docs/config.md)."""

    prefix: ClassVar[str] = "eplb"

    name: str = "topoep"
    """none (megatron's alltoall layer, the baseline) or a policy name (the TopoEP layer)."""
    policy: str | None = None
    """Planner policy; defaults to `name` (static, topoep, topoep_plus, deepseek, fastermoe, flexmoe)."""

    def __post_init__(self):
        if self.name == "none":  # megatron's baseline: the layer's fields are not used, yet each must be one a layer
            # could take (the same overrides serve every eplb of a comparison, e.g. bench/paper_eval.py's)
            if self.policy is not None:
                raise ValueError(f"eplb.policy={self.policy} has no effect with eplb=none (megatron's own MoE layer): "
                                 f"choose eplb={self.policy} instead, or leave eplb.policy out")
            self._check_values(policy=False)
            return
        self.policy = self.policy or self.name
        super().__post_init__()

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def unused(self) -> list[str]:
        """With eplb=none: the layer's fields set away from their defaults ("eplb.<field>=<value>"), which megatron's
        layer does not use (accepted so one set of overrides serves every eplb of a comparison; the trainer names
        them). Empty otherwise."""
        if self.enabled:
            return []
        return [f"eplb.{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(LayerConfig)
                if f.name != "policy" and getattr(self, f.name) != getattr(LayerConfig(), f.name)]

    def layer_config(self, **changes) -> LayerConfig:
        """The layer's config: these fields without `name`, with `changes` (e.g. t_ffn from the model's shape)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(LayerConfig)}
        return LayerConfig(**own).replace(**changes)


@dataclass(kw_only=True)
class RouterConfig:
    """`natural`: the model's router as trained. `synthetic`: megatron's moe_router_force_biased
    (random logits plus a fixed expert bias of std |router_skew|, paper 6.4). `balanced`: megatron's
    moe_router_force_load_balancing (random logits: every expert, so every rank, gets the mean load in
    expectation), the balanced upper bound. `synthetic` and `balanced` are for performance runs only:
    the loss is meaningless.

    layout (synthetic only): `megatron` keeps megatron's own shared random bias; `random`, `clustered`,
    `scattered` or `concentrated` (`topoep.workloads.expert_bias`, seed `seed` + the layer number) place a
    bias drawn by us, e.g. `concentrated` gives rank 0's experts the largest biases (large rank imbalance
    even at EP 2). Those need router_skew < 0 (megatron's fixed-bias mode) or 0 (no bias)."""

    group: ClassVar[str] = "router"  # how errors name a field: router.<field>

    name: str = "natural"
    """natural, synthetic or balanced (the class docstring)."""
    router_skew: float | None = None
    """router=synthetic only (required there): megatron's moe_router_force_biased, the bias's scale (paper 6.4:
    -4 is a stationary bias of std 4; 0: none)."""
    layout: str = "megatron"
    """router=synthetic: megatron (its own shared random bias) or one of ours (random, clustered, scattered,
    concentrated)."""
    seed: int = 0
    """With a layout of ours: the seed of its bias (+ the layer number)."""

    def __post_init__(self):
        from topoep.workloads import LAYOUTS

        if self.name not in ("natural", "synthetic", "balanced"):
            raise ValueError(f"router.name must be natural, synthetic or balanced, got {self.name!r}")
        if self.name != "synthetic" and self.router_skew is not None:
            raise ValueError(f"router.router_skew={self.router_skew} biases router=synthetic only (router={self.name} "
                             f"would ignore it): set router=synthetic or remove router.router_skew")
        if self.name == "synthetic" and self.router_skew is None:
            raise ValueError("router=synthetic needs router.router_skew (e.g. -4: stationary bias of std 4)")
        if self.layout != "megatron" and self.layout not in LAYOUTS:
            raise ValueError(f"router.layout must be megatron or one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.layout == "megatron" and self.seed != 0:
            raise ValueError(f"router.seed={self.seed} seeds the bias of our layouts (router.layout random, clustered, "
                             "scattered, concentrated); megatron's layout draws its bias from trainer.seed: set "
                             "router.layout, or trainer.seed instead")
        if self.layout != "megatron":
            if self.name != "synthetic":
                raise ValueError(f"router.layout={self.layout} needs router=synthetic (it places the synthetic bias)")
            if self.router_skew > 0:
                raise ValueError(f"router.layout={self.layout} needs router.router_skew <= 0 (a fixed bias per layer), "
                                 f"got {self.router_skew}")


@dataclass(kw_only=True)
class TopologyConfig:
    """NVLink domains of the expert-parallel group."""

    group: ClassVar[str] = "topology"  # how errors name a field: topology.<field>

    name: str = "node"
    ranks_per_domain: int | None = None
    """None: a node (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE ranks) is a domain. A number makes
    virtual domains of that many consecutive EP ranks (tests, single-host runs)."""
    intra_gbytes_per_s: float = 200.0
    """NVLink bandwidth per direction, GB/s: the planners' and the guard's per-byte cost inside a domain."""
    inter_gbytes_per_s: float = 50.0
    """NIC bandwidth per direction, GB/s: their per-byte cost across domains."""

    def __post_init__(self):
        if self.ranks_per_domain is not None:
            _positive(self, "ranks_per_domain")
        _number(self, "intra_gbytes_per_s", 0.0, above=True)
        _number(self, "inter_gbytes_per_s", 0.0, above=True)


@dataclass(kw_only=True)
class ParallelConfig:
    group: ClassVar[str] = "parallel"  # how errors name a field: parallel.<field>

    tp: int = 1
    """Tensor-parallel size (> 1 needs Transformer Engine)."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int | None = None
    """Expert-parallel size (experts are split over ep ranks); None: world size / (tp * pp)."""
    expert_tp: int = 1
    """Expert tensor-parallel size: 1 with a TopoEP layer (it computes each expert whole on one rank)."""
    num_microbatches: int = 1
    """Micro-batches per step and data-parallel rank (gradient accumulation / pipeline fill)."""

    def __post_init__(self):
        _positive(self, "tp", "pp", "expert_tp", "num_microbatches")
        if self.ep is not None:
            _positive(self, "ep")


@dataclass(kw_only=True)
class TrainerConfig:
    group: ClassVar[str] = "trainer"  # how errors name a field: trainer.<field>

    steps: int = 50
    """Optimizer steps to train (>= 1); the LR schedule decays over them."""
    lr: float = 3e-4
    """Peak learning rate (Adam, > 0), reached after warmup_steps."""
    min_lr: float = 3e-5
    """The schedule's final learning rate (0 to lr)."""
    warmup_steps: int = 5
    """Linear warm-up steps from 0 to lr (0 to steps - 1)."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant decay from lr to min_lr after the warm-up."""
    weight_decay: float = 0.1
    """Adam's weight decay (>= 0)."""
    clip_grad: float = 1.0
    """Clip the gradients' global norm to this (>= 0; 0: no clipping)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch and data-parallel rank (>= 1)."""
    seq_length: int = 4096
    """Tokens per sequence (>= 1)."""
    bf16: bool = True
    """bf16 weights and activations (megatron's Float16Module; backend cuda needs it); false: fp32."""
    seed: int = 1234
    """Seeds torch, megatron's RNG tracker (megatron's router bias with router.layout megatron) and the data order
    (0 to 2^32 - 1)."""
    device: str = "cuda"
    """cuda or cpu (cpu: gloo and the megatron CPU compatibility layer)."""
    run_dir: str = "runs/${model.name}-${eplb.name}-${router.name}"
    """The run's config.yaml, metrics.jsonl, heatmaps, W&B run and (by default) checkpoints; one directory per
    configuration (a resume refuses a config that changes what is trained)."""
    checkpoint_dir: str | None = None
    """None: <run_dir>/checkpoints."""
    save_interval: int = 0
    """Save every N steps and at the last (0: only at the last step, when checkpoint_dir is set)."""
    resume: bool = True
    """Continue from the latest checkpoint in checkpoint_dir when there is one."""
    log_interval: int = 1
    """Log every N steps, the last and every step that saves (>= 1); counts cover the steps since the last log."""
    heatmap_interval: int = 25
    """Every N steps, a per-layer expert-load heatmap (paper Fig. 2); 0: none."""

    def __post_init__(self):
        _positive(self, "steps", "micro_batch_size", "seq_length", "log_interval")
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            raise ValueError(f"trainer.run_dir must name a directory (the run's config, metrics and checkpoints), got "
                             f"{self.run_dir!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"trainer.device must be cuda or cpu, got {self.device!r}")
        for name in ("save_interval", "heatmap_interval", "warmup_steps", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"trainer.{name} must be an integer >= 0, got {v!r}")
        if self.seed >= 2**32:
            raise ValueError(f"trainer.seed must be below 2^32 (numpy's seeds, the data order), got {self.seed}")
        _number(self, "lr", 0.0, above=True)
        _number(self, "min_lr", 0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"trainer.min_lr={self.min_lr} exceeds trainer.lr={self.lr}: the schedule decays from lr "
                             f"to min_lr; set min_lr <= lr")
        _number(self, "weight_decay", 0.0)
        _number(self, "clip_grad", 0.0)
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"trainer.warmup_steps={self.warmup_steps} must be in [0, trainer.steps={self.steps}): "
                             "raise trainer.steps, or set trainer.warmup_steps below it (0: no warm-up)")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"trainer.lr_decay_style must be cosine, linear or constant, got {self.lr_decay_style!r}")


@dataclass(kw_only=True)
class LoggerConfig:
    group: ClassVar[str] = "logger"  # how errors name a field: logger.<field>

    name: str = "wandb"
    """wandb or none (console only)."""
    mode: str = "offline"
    """W&B mode: offline (no account needed; `wandb sync` later) or online."""
    project: str = "topoep"
    entity: str | None = None

    def __post_init__(self):
        if self.name not in ("wandb", "none"):
            raise ValueError(f"logger.name must be wandb or none, got {self.name!r}")
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {self.mode!r}")


GROUPS = {"model": ModelConfig, "eplb": EplbConfig, "router": RouterConfig, "topology": TopologyConfig,
          "parallel": ParallelConfig, "trainer": TrainerConfig, "logger": LoggerConfig}


def register_configs() -> None:
    """Register every group's schema as `<group>/base_<group>` (the yaml files extend them)."""
    from hydra.core.config_store import ConfigStore

    from data.store import register_configs as register_data

    cs = ConfigStore.instance()
    for group, cls in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=cls)
    register_data()
