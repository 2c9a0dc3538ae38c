"""The training job: build everything from the typed configs, train, log, checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from app import setup
from app.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from app.logger import Logger
from app.moe_stats import COLUMNS, COUNTS, SUMMED, MoEStats
from app.plots import expert_load_heatmap
from topoep.runtime.deepep import release_buffers


@dataclasses.dataclass
class Job:
    model: object
    eplb: object
    router: object
    topology: object
    parallel: object
    trainer: object
    logger: object
    data: object


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    # megatron's schedule divides the returned loss in place by num_microbatches: report a copy
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(device, data_iterator, model):
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _mean_loss(losses: list[dict], device) -> float:
    """Mean 'lm loss' over micro-batches and data-parallel ranks of the last pipeline stage."""
    from megatron.core import parallel_state as ps

    t = torch.zeros(2, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
        for m in losses:
            t[0] += m["lm loss"].double()
            t[1] += 1
    dist.all_reduce(t)
    return (t[0] / t[1]).item() if t[1] > 0 else float("nan")


def _not_async_save_notice(record) -> bool:
    return "async save is deprecated" not in record.getMessage()


def _quiet_megatron() -> None:
    """megatron-core logs every gradient bucket and its whole optimizer config at INFO level."""
    import logging
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    # every rank's first checkpoint save warns that the async save, which the trainer does not use, is deprecated
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(_not_async_save_notice)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|absl\.logging).*")


RANK_EXIT_DELAY_S = 5.0  # config_errors: how long ranks other than 0 wait before they exit


@contextlib.contextmanager
def config_errors():
    """A config error (a ValueError of the configs' checks, which names the field and the fix, OmegaConf's type error
    or Hydra's composition error) is printed once, by rank 0, without a traceback, and every rank exits with status 2
    (every rank checks the same config, so every rank stops). The other ranks wait RANK_EXIT_DELAY_S first: torchrun
    stops every rank as soon as one exits, and rank 0 must have printed by then."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except (ValueError, OmegaConfBaseException, HydraException) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            cause = f"\n{e.__cause__}" if e.__cause__ is not None else ""  # Hydra's override errors keep it there
            print(f"config error: {e}{cause}", file=sys.stderr, flush=True)
        else:
            time.sleep(RANK_EXIT_DELAY_S)
        sys.exit(2)


def job_from_config(cfg) -> tuple[Job, dict]:
    """A composed Hydra config (train.py's, or `hydra.compose`'s) -> (Job, resolved config). Converting the
    groups to their dataclasses runs every __post_init__ check."""
    from omegaconf import OmegaConf

    from app.config import GROUPS
    from data.store import to_data_config

    parts = {g: OmegaConf.to_object(cfg[g]) for g in GROUPS}
    if parts["eplb"].enabled and parts["eplb"].transport == "a2a" and parts["parallel"].pp > 1:
        raise ValueError(f"eplb.transport=a2a with parallel.pp={parts['parallel'].pp}: its NVSHMEM buffers are "
                         "collective allocations made at a stage's first forward, which the other stages do not "
                         "reach in step; use parallel.pp=1 or eplb.transport=peer")
    if parts["eplb"].enabled and parts["parallel"].expert_tp > 1:
        raise ValueError(f"parallel.expert_tp={parts['parallel'].expert_tp} with eplb={parts['eplb'].name}: the TopoEP "
                         "layer computes each expert whole on one rank; use parallel.expert_tp=1 (or eplb=none)")
    if parts["eplb"].enabled and parts["eplb"].layer_graphs and parts["parallel"].pp > 1:
        raise ValueError(f"eplb.layer_graphs=true with parallel.pp={parts['parallel'].pp}: a captured layer keeps "
                         "one call's tensors for backward in its graphs' buffers, and a pipeline schedule runs "
                         "several micro-batches' forwards before their backwards; use parallel.pp=1 or "
                         "eplb.layer_graphs=false")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for g, obj in parts.items():  # the values as checked (e.g. eplb.policy filled in from eplb.name)
        resolved[g] = dataclasses.asdict(obj)
    resolved["_yaml"] = _yaml_of(resolved)
    return Job(**parts, data=to_data_config(cfg.data)), resolved


def _yaml_of(resolved: dict) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in resolved.items() if k != "_yaml"}))


# what a resumed run may change: how long it trains and what it writes, the LR schedule's length and shape (the
# checkpoint's schedule is kept, and the run says so), and the balancer and its topology (which do not change the
# model's math); any other field of the checkpoint's config.yaml must stay as it was
RESUME_MAY_CHANGE = ("trainer.steps", "trainer.warmup_steps", "trainer.lr_decay_style", "trainer.log_interval",
                     "trainer.save_interval", "trainer.heatmap_interval", "trainer.resume", "trainer.run_dir",
                     "trainer.checkpoint_dir", "logger.", "eplb.", "topology.")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_changes(previous_yaml: str, resolved: dict) -> tuple[list[str], list[str]]:
    """(conflicts, changes) between the config.yaml a checkpoint's run wrote and this run's resolved config, each
    "field: old -> new": conflicts change what is trained (the model, data, router, parallel layout, optimizer and
    schedule, seed: a resumed run may not), changes are the fields of RESUME_MAY_CHANGE that differ."""
    from omegaconf import OmegaConf

    old, new = (_flat(OmegaConf.to_container(OmegaConf.create(text))) for text in (previous_yaml, resolved["_yaml"]))
    conflicts, changes = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if a != b:
            (changes if key.startswith(RESUME_MAY_CHANGE) else conflicts).append(f"{key}: {a} -> {b}")
    return conflicts, changes


def effective_config(resolved: dict, par, topology, t_ffn: float | None) -> dict:
    """`resolved` with the values the run derived where the config left them to it: parallel.ep (and the rest of
    the layout as resolved), topology.ranks_per_domain (a node, unless set) and eplb.t_ffn (from the model's shape,
    unless set; None with eplb=none), so config.yaml and the logger record what ran."""
    out = {**resolved, "parallel": dataclasses.asdict(par),
           "topology": {**resolved["topology"], "ranks_per_domain": topology.ranks_per_domain},
           "eplb": {**resolved["eplb"], "t_ffn": t_ffn}}
    out["_yaml"] = _yaml_of(out)
    return out


def run(job: Job, resolved_config: dict, keep_distributed: bool = False, cpu_harness: bool = False) -> list[dict]:
    """Train; returns the per-step metrics (rank 0; other ranks get an empty list).

    cpu_harness: tests only (tests/train_cpu_harness.py): eplb.backend=cuda's layers run backend cuda's code on the
    CPU processes over gloo, with torch references for its kernels.

    keep_distributed: leave the process group and megatron's parallel state initialised at the end, for
    the next job of the same process (bench/eval_worker.py runs many short jobs in one torchrun). A job
    then reuses them when its parallel layout is the same, so the layers' symmetric-memory workspaces,
    cached per process group, are reused too."""
    _quiet_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from data.loader import build_loader
    from topoep.megatron.model import build_gpt_model, moe_layers, transformer_engine_available
    from topoep.megatron.moe_layer import TopoEPSpec

    tr, mc, ec = job.trainer, job.model, job.eplb
    d = setup.init_distributed(tr)
    with config_errors():
        if job.parallel.tp > 1 and not transformer_engine_available():
            raise ValueError(f"parallel.tp={job.parallel.tp} runs sequence parallelism, whose LayerNorm needs Transformer "
                             "Engine (not installed): use parallel.tp=1, or install transformer_engine")
        if ec.enabled and ec.backend == "cuda" and not cpu_harness and (tr.device != "cuda" or not tr.bf16):
            raise ValueError(f"eplb.backend=cuda runs bf16 on GPUs (got trainer.device={tr.device}, trainer.bf16="
                             f"{str(tr.bf16).lower()}): set trainer.device=cuda and trainer.bf16=true, or "
                             f"eplb.backend=torch")
        par = setup.resolve_parallel(job.parallel, mc, d.world_size)
        topology = setup.build_topology(job.topology, par.ep, d.local_world_size)
    resolved_config = effective_config(resolved_config, par, topology,
                                       setup.default_t_ffn(mc, ec) if ec.enabled else None)
    setup.init_model_parallel(par)
    torch.manual_seed(tr.seed)
    model_parallel_cuda_manual_seed(tr.seed)  # on CPU the compatibility layer keeps its streams on the CPU
    is_logger = d.rank == 0
    run_dir = Path(tr.run_dir)
    ckpt_dir = Path(tr.checkpoint_dir) if tr.checkpoint_dir else run_dir / "checkpoints"
    latest = latest_checkpoint(ckpt_dir) if tr.resume else None
    previous = run_dir / "config.yaml"
    if latest is not None and previous.is_file():  # every rank reads it: every rank stops on a conflict
        conflicts, changes = resume_changes(previous.read_text(), resolved_config)
        with config_errors():
            if conflicts:
                raise ValueError(f"{run_dir} holds a checkpoint ({latest}) of a run configured otherwise: "
                                 + "; ".join(conflicts) + ". Resume with those values, set trainer.run_dir to "
                                 "another directory, or trainer.resume=false to start anew in this one")
        if changes and is_logger:
            print(f"resuming {latest} with: " + "; ".join(changes), flush=True)
    if is_logger and latest is None and previous.is_file():
        stale = sorted((run_dir / "heatmaps").glob("expert_load_step*.png"))
        for png in stale:  # an earlier run's heatmaps would read as this run's
            png.unlink()
        print(f"starting anew in {run_dir}: the earlier run's metrics.jsonl, config.yaml and {len(stale)} heatmaps "
              "there are replaced" + (" (trainer.resume=false)" if not tr.resume else ""), flush=True)
    logger = Logger(job.logger, run_dir, resolved_config, enabled=is_logger, fresh=latest is None,
                    resumed_from=None if latest is None else latest.name)
    if is_logger:
        if latest is None:  # a resumed run writes it once its checkpoint has loaded
            previous.write_text(resolved_config["_yaml"])
        print(f"world {d.world_size} on {tr.device}: tp {par.tp} pp {par.pp} ep {par.ep} dp "
              f"{ps.get_data_parallel_world_size()}; {topology}; eplb {ec.name}"
              + (f" (policy {ec.policy}, {ec.num_slots} slots, backend {ec.backend}, "
                 f"guard {'on' if ec.guard else 'off'}, capacity {ec.capacity_factor or 'worst case'})"
                 if ec.enabled else ""), flush=True)
        if ec.unused():
            print("eplb=none runs megatron's own MoE layer, which does not use " + ", ".join(ec.unused()), flush=True)

    with config_errors():  # a corpus too small or not the checkpoint's: one line, every rank exits
        loader = build_loader(job.data, seq_length=tr.seq_length, micro_batch_size=tr.micro_batch_size,
                              dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                              seed=tr.seed, progress=is_logger)
    vocab = mc.vocab_size or setup.padded_vocab(loader.vocab_size, par.tp)
    tc = setup.transformer_config(mc, par, tr, job.router)
    topoep_cfg = (TopoEPSpec(topology, ec.layer_config(t_ffn=setup.default_t_ffn(mc, ec)), cpu_harness=cpu_harness)
                  if ec.enabled else None)
    model = build_gpt_model(tc, vocab_size=vocab, max_sequence_length=tr.seq_length, topoep=topoep_cfg,
                            rotary_base=mc.rotary_base, rotary_percent=mc.rotary_percent,
                            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if tr.device == "cuda":
        model.cuda(d.device)
    # our synthetic bias layouts, in the dtype of the router's logits (megatron adds the bias to them)
    setup.install_router_bias(model, job.router, mc.num_moe_experts, par.ep,
                              torch.float32 if mc.moe_router_dtype == "fp32" or not tr.bf16 else torch.bfloat16)
    if tr.bf16:
        model = Float16Module(tc, model)
    ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    tc.finalize_model_grads_func = finalize_model_grads
    tc.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=tr.lr, min_lr=tr.min_lr, weight_decay=tr.weight_decay, adam_beta1=0.9,
                        adam_beta2=0.95, clip_grad=tr.clip_grad, bf16=tr.bf16, params_dtype=tc.params_dtype,
                        use_distributed_optimizer=False), [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if tr.warmup_steps else tr.lr, max_lr=tr.lr, min_lr=tr.min_lr,
        lr_warmup_steps=tr.warmup_steps, lr_decay_steps=tr.steps, lr_decay_style=tr.lr_decay_style,
        start_wd=tr.weight_decay, end_wd=tr.weight_decay, wd_incr_steps=tr.steps, wd_incr_style="constant")
    layers = moe_layers(model)
    stats = MoEStats(layers, topology, mc.num_layers - mc.first_k_dense, mc.num_moe_experts, mc.first_k_dense,
                     d.device, par.num_microbatches, mc.hidden_size * (2 if tr.bf16 else 4))

    start = 0
    if latest is not None:
        config_schedule = scheduler.state_dict()
        with config_errors():
            start = load_checkpoint(latest, ddp, optimizer, scheduler, loader)
            if start > tr.steps:
                raise ValueError(f"{latest} is at step {start}, past trainer.steps={tr.steps}: raise trainer.steps, or "
                                 f"set trainer.resume=false to start anew")
        logger.resume_at(start)
        if is_logger:
            previous.write_text(resolved_config["_yaml"])
            print(f"resumed from {latest} at step {start}", flush=True)
            kept = schedule_kept(config_schedule, scheduler.state_dict())
            if kept:  # megatron's rule: a resumed run continues its checkpoint's schedule
                print(f"the LR schedule continues the checkpoint's: {kept}", flush=True)

    fwd_bwd = get_forward_backward_func()
    dp = ps.get_data_parallel_world_size()
    tokens_per_step = tr.micro_batch_size * tr.seq_length * par.num_microbatches * dp
    history = []
    step_times = []  # seconds of every step of this run (the ETA leaves the first, which compiles and warms up, out)
    unlogged: dict[str, float] = {}  # counts of the steps since the last logged one (trainer.log_interval)
    epoch = loader.consumed_samples // loader.sequences.samples_per_epoch  # of the corpus, on this rank's view
    for step in range(start + 1, tr.steps + 1):
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fwd_bwd(forward_step_func=partial(_forward_step, d.device), data_iterator=loader, model=[ddp],
                         num_microbatches=par.num_microbatches, seq_length=tr.seq_length,
                         micro_batch_size=tr.micro_batch_size, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        if tr.device == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        step_times.append(step_s)
        loss = _mean_loss(losses, d.device)
        moe, loads, pool_counts = stats.collect()
        metrics = {"loss": loss, "lr": optimizer.param_groups[0]["lr"], "grad_norm": float(grad_norm or 0.0),
                   "step_time_s": step_s, "tokens_per_s": tokens_per_step / step_s, "skipped": not ok}
        now = loader.consumed_samples // loader.sequences.samples_per_epoch
        if now > epoch and is_logger:  # every rank's samples come from one global order: the same epoch on each
            print(f"data: step {step} began epoch {now} of the corpus ({loader.sequences.samples_per_epoch} samples "
                  f"each): its samples repeat, in a new order", flush=True)
        epoch = metrics["data/epoch"] = now
        if stats.num_moe_layers:
            m = moe.cpu()
            for j, c in enumerate(COLUMNS):
                metrics[f"moe/{c}"] = m[:, j].sum().item() if c in SUMMED else m[:, j].mean().item()
                for li in range(m.shape[0]):
                    metrics[f"moe/layer{li + 1}/{c}"] = m[li, j].item()
            metrics.update({f"moe/{k}": v for k, v in pool_counts.items()})
        history.append(metrics)
        saving = bool(tr.save_interval and step % tr.save_interval == 0) or (
            step == tr.steps and bool(tr.checkpoint_dir or tr.save_interval))
        # a step that saves a checkpoint is logged too: no count is left unlogged when a run resumes from it
        if step % tr.log_interval == 0 or step == tr.steps or saving:
            # a logged step's counts include those of the steps since the last logged one
            logged = {k: v + unlogged.get(k, 0.0) if _is_count(k) else v for k, v in metrics.items()}
            unlogged.clear()
            if is_logger:
                later = step_times[1:] or step_times
                eta_s = (tr.steps - step) * sum(later) / len(later)
                logger.log(step, logged, _line(step, tr.steps, logged, ec.enabled, eta_s,
                                                    ec.enabled and ec.backend == "cuda"))
        else:
            for k, v in metrics.items():
                if _is_count(k):
                    unlogged[k] = unlogged.get(k, 0.0) + v
        if tr.heatmap_interval and (step % tr.heatmap_interval == 0 or step == tr.steps) and is_logger:
            png = expert_load_heatmap(loads, run_dir / "heatmaps" / f"expert_load_step{step:06d}.png",
                                      f"expert load per MoE layer, step {step} ({mc.name}, eplb {ec.name})")
            logger.log_image(step, "moe/expert_load_heatmap", png)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        if saving:
            path = save_checkpoint(ckpt_dir, step, ddp, optimizer, scheduler, loader)
            if is_logger:
                print(f"saved {path}", flush=True)
    logger.finish()
    if keep_distributed:
        _release_ddp_hooks(ddp)
    else:
        ps.destroy_model_parallel()
        release_buffers()  # transport deepep's buffers, while their process group lives
        dist.destroy_process_group()
    return history if is_logger else []


SCHEDULE_FIELDS = {"lr_decay_steps": "trainer.steps", "lr_warmup_steps": "trainer.warmup_steps",
                   "lr_decay_style": "trainer.lr_decay_style"}


def schedule_kept(config: dict, loaded: dict) -> str:
    """The LR scheduler's fields where the checkpoint's (which a resumed run keeps) differ from the trainer config's,
    as "lr_decay_steps 50 (trainer.steps=30), ..."; empty where they agree."""
    return ", ".join(f"{k} {loaded[k]} ({field}={config[k]})" for k, field in SCHEDULE_FIELDS.items()
                     if loaded[k] != config[k])


def _is_count(key: str) -> bool:
    """A metric that counts events of its step (slot waits, spilled rows, replica fetches): with trainer.log_interval
    > 1 a logged step carries those of the steps since the last logged one."""
    return key.rsplit("/", 1)[-1] in COUNTS


def _release_ddp_hooks(ddp) -> None:
    """Free a finished job's memory when the process goes on to another one. megatron's DDP registers a hook
    on each parameter's grad accumulator (a C++ autograd node) that refers back to the DDP module; the node
    keeps its hooks in a dict the garbage collector cannot see, so the model, its gradient buffers and the
    optimizer would stay alive after the job returns (about 27 GB per rank for model=qwen3). Emptying each
    node's hook dict (reached through the handle of a no-op hook, which lands in the same dict) breaks it."""
    for acc in ddp.grad_accs:
        handle = acc.register_hook(_no_hook)
        hooks = handle.hooks_dict_ref()
        if hooks is not None:
            hooks.clear()
    ddp.grad_accs.clear()


def _no_hook(*_):
    return None


def _eta(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _line(step, steps, m, balanced, eta_s: float = 0.0, backend_cuda: bool = False) -> str:
    """The console's line of a logged step: `guard` the calls whose guard fired, `plan skip` those whose routing no
    plan could pay for (moe/plan_skip), and with backend cuda `slot skip` those its slot hint ran without the
    replica machinery (moe/slot_skip)."""
    s = (f"step {step:>4}/{steps} ({100 * step / steps:.0f} %, ETA {_eta(eta_s)}) | loss {m['loss']:.4f} | "
         f"lr {m['lr']:.2e} | {m['tokens_per_s']:,.0f} tok/s | {1e3 * m['step_time_s']:.0f} ms")
    if "moe/imbalance_before" in m:
        s += f" | imbalance {m['moe/imbalance_before']:.2f}"
        if balanced:
            s += (f" -> {m['moe/imbalance_after']:.2f} | inter-node {100 * m['moe/internode_after']:.1f} % | "
                  f"replica {100 * m['moe/replica_fraction']:.1f} % | planner {m['moe/planner_ms']:.1f} ms | "
                  f"guard {100 * m['moe/guard_fired']:.0f} % (plan skip {100 * m['moe/plan_skip']:.0f} %"
                  + (f", slot skip {100 * m['moe/slot_skip']:.0f} %" if backend_cuda else "") + ")")
        else:
            s += f" | inter-node {100 * m['moe/internode_before']:.1f} %"
    return s
