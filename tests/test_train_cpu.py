"""End-to-end tests (CPU, torchrun with 4 gloo processes as 2 virtual domains): the quickstart trains and
logs, eplb=topoep follows megatron's baseline loss curve, checkpoints resume the same curve and move
between eplb=none and eplb=topoep, the net-benefit guard's statistic is logged, and bad configs fail fast
with the field name."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = 50


def train(run_dir: Path, *overrides: str, nproc: int = 4, check: bool = True,
          script: str = "train.py") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           "model=tiny", "trainer=cpu", f"trainer.run_dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    out = {}
    out["topoep_proc"] = train(root / "topoep", "eplb=topoep", f"trainer.steps={STEPS}")
    out["topoep"] = metrics(root / "topoep")
    out["none_proc"] = train(root / "none", "eplb=none", f"trainer.steps={STEPS}", "trainer.save_interval=25",
                             "logger=none")
    out["none"] = metrics(root / "none")
    out["root"] = root
    return out


def test_the_trainer_profile_follows_the_machine(monkeypatch):
    import torch

    sys.path.insert(0, str(REPO))
    from train import trainer_profile

    argv, header = trainer_profile(["train.py", "model=tiny", "trainer=default"])
    assert argv[-1] == "trainer=default" and header == "trainer profile: default (from the command line)"
    for cuda, name in ((True, "default"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        argv, header = trainer_profile(["train.py", "model=tiny"])
        assert argv == ["train.py", "model=tiny", f"trainer={name}"] and header.startswith(f"trainer profile: {name} (")


def test_quickstart_trains_and_logs(runs):
    root = runs["root"] / "topoep"
    stdout = runs["topoep_proc"].stdout
    assert f"step   {STEPS}/{STEPS} (100 %, ETA 0:00) | loss" in stdout and "tok/s" in stdout and "imbalance" in stdout
    assert "trainer profile: cpu (from the command line)" in stdout
    m = runs["topoep"]
    assert [r["step"] for r in m] == list(range(1, STEPS + 1))
    assert all(r["loss"] == r["loss"] and r["tokens_per_s"] > 0 for r in m)
    assert m[-1]["loss"] < m[0]["loss"] - 0.5  # it learns
    assert all(r["moe/replica_fraction"] > 0 for r in m)  # replicas are used
    assert all(r["moe/imbalance_after"] <= r["moe/imbalance_before"] + 1e-9 for r in m)
    assert "moe/layer2/imbalance_after" in m[0] and m[0]["moe/planner_ms"] > 0
    assert all(r["moe/guard_fired"] == 0.0 for r in m) and "guard 0 %" in stdout  # trainer=cpu: guard off
    assert all(r["moe/slot_skip"] == 0.0 for r in m)  # backend torch never leaves the replica machinery out
    assert all(r["data/epoch"] == 0 for r in m)  # 50 steps of 16 samples: the corpus's first epoch
    assert (root / "config.yaml").read_text().count("eplb:") == 1
    import dataclasses

    import yaml

    from topoep import LayerConfig

    config = yaml.safe_load((root / "config.yaml").read_text())
    eplb = config["eplb"]  # every option of the layers is recorded
    assert set(eplb) == {f.name for f in dataclasses.fields(LayerConfig)} | {"name"}
    assert (eplb["policy"], eplb["num_chunks"], eplb["prefetch"], eplb["guard"]) == ("topoep", None, False, False)
    # the values the run derived where the config left them to it (4 processes, trainer=cpu's virtual domains of 2)
    assert (config["parallel"]["ep"], config["topology"]["ranks_per_domain"]) == (4, 2)
    assert eplb["t_ffn"] > 0  # from the model's shape
    none = yaml.safe_load((runs["root"] / "none" / "config.yaml").read_text())
    assert none["parallel"]["ep"] == 4 and none["eplb"]["t_ffn"] is None  # megatron's layer uses no t_ffn
    assert list((root / "heatmaps").glob("expert_load_step*.png"))
    assert list((root / "wandb").glob("offline-run-*"))  # W&B offline run directory


def test_topoep_follows_megatron_baseline(runs):
    a, b = runs["none"], runs["topoep"]
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-6, abs=0)  # same routing: same step-1 loss
    rel = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
    assert max(rel) < 1e-3, rel  # float reduction order only
    # the baseline logs the same routing statistics, without balancing
    assert all(r["moe/imbalance_after"] == r["moe/imbalance_before"] for r in a)
    assert a[0]["moe/imbalance_before"] == pytest.approx(b[0]["moe/imbalance_before"])


def test_backend_cuda_logic_trains_on_the_cpu_like_backend_torch(tmp_path):
    """eplb.backend=cuda on the internal CPU harness (tests/train_cpu_harness.py: backend cuda's code on CPU
    processes, torch references for its kernels; bf16 as on the GPU) trains like backend torch: the same losses up
    to bf16 rounding."""
    steps = ("trainer.steps=3", "trainer.bf16=true", "logger=none")
    train(tmp_path / "cuda", "eplb=topoep", "eplb.backend=cuda", *steps, script="tests/train_cpu_harness.py")
    train(tmp_path / "torch", "eplb=topoep", *steps)
    a, b = metrics(tmp_path / "cuda"), metrics(tmp_path / "torch")
    assert [r["step"] for r in a] == [1, 2, 3]
    assert all(abs(x["loss"] - y["loss"]) < 2e-3 * abs(y["loss"]) for x, y in zip(a, b)), (a, b)
    assert all(r["moe/replica_fraction"] > 0 for r in a)
    # the pool's fetches per step (2 MoE layers): 2 forward fills and layer 1's reload; layer 2's reload left out
    assert [(r["moe/replica_fetches"], r["moe/reloads_skipped"], r["moe/prefetches"]) for r in a] == [(3, 1, 0)] * 3
    assert "moe/replica_fetches" not in b[0]  # backend torch has no such pool


def test_guard_on_cpu_executes_the_static_plan(runs, tmp_path):
    """eplb.guard=true on a CPU with the guard's GPU constants: at the tiny model's size no saving pays for
    the planning estimate, so every call executes the static plan: no replicas, the baseline's losses. (Without
    the capacity step, which would place replicas where the static plan overflows the receive regions.)"""
    train(tmp_path / "guard", "eplb.guard=true", "eplb.capacity_factor=null", "trainer.steps=3", "logger=none")
    m = metrics(tmp_path / "guard")
    assert [r["moe/guard_fired"] for r in m] == [1.0, 1.0, 1.0]
    assert all(r["moe/layer1/guard_fired"] == 1.0 and r["moe/replica_fraction"] == 0.0 for r in m)
    assert all(r["moe/imbalance_after"] == pytest.approx(r["moe/imbalance_before"]) for r in m)
    assert [r["loss"] for r in m] == pytest.approx([r["loss"] for r in runs["none"][:3]], rel=1e-4)


def _resume_from(runs, name, *overrides):
    root = runs["root"]
    ckpt = root / f"ckpt_{name}"
    shutil.copytree(root / "none" / "checkpoints" / "iter_0000025", ckpt / "iter_0000025")
    (ckpt / "latest").write_text("iter_0000025\n")
    train(root / name, "trainer.steps=30", f"trainer.checkpoint_dir={ckpt}", "logger=none", *overrides)
    return metrics(root / name)


def test_resume_continues_the_same_curve(runs):
    resumed = _resume_from(runs, "resume_none", "eplb=none")
    assert [r["step"] for r in resumed] == [26, 27, 28, 29, 30]
    for r in resumed:
        assert r["loss"] == pytest.approx(runs["none"][r["step"] - 1]["loss"], rel=1e-6)


def test_checkpoint_from_baseline_loads_with_topoep(runs):
    resumed = _resume_from(runs, "resume_topoep", "eplb=topoep")
    for r in resumed:
        assert r["loss"] == pytest.approx(runs["none"][r["step"] - 1]["loss"], rel=1e-4)
        assert r["moe/replica_fraction"] > 0


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from app.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["eplb.num_slots=-1"], "eplb.num_slots must be an integer >= 0"),
    (["eplb.planner_blocks=-4"], "eplb.planner_blocks must be an integer >= 0"),
    (["eplb.policy=greedy"], "eplb.policy='greedy' is unknown"),
    (["eplb.policy=joint"], "eplb.policy='joint' is an offline planner"),
    (["eplb.backend=nccl"], "eplb.backend='nccl' is unknown; choose one of torch, cuda"),
    (["router=synthetic", "router.router_skew=null"], "router.router_skew"),
    (["trainer.device=tpu"], "trainer.device must be cuda or cpu"),
    (["trainer.steps=2", "trainer.warmup_steps=2"], "trainer.warmup_steps=2 must be in"),
    (["model.moe_router_topk=9"], "model.moe_router_topk=9 exceeds model.num_moe_experts=8"),
    (["model.moe_router_load_balancing_type=bogus"], "model.moe_router_load_balancing_type='bogus' is unknown"),
    (["model.moe_router_dtype=fp8"], "model.moe_router_dtype must be fp32, fp64 or null"),
    (["model.num_query_groups=3"], "model.num_query_groups=3 must divide model.num_attention_heads=4"),
    (["+model.mla={q_lora_rank: 8}"], "model.mla sets q_lora_rank but model.multi_latent_attention is false"),
    (["eplb=none", "eplb.num_slots=-3"], "eplb.num_slots must be an integer >= 0, got -3"),
    (["eplb=none", "eplb.backend=gpu"], "eplb.backend='gpu' is unknown"),
    (["eplb=none", "eplb.policy=topoep"], "eplb.policy=topoep has no effect with eplb=none"),
    (["eplb.prefetch=true"], "eplb.prefetch=true applies to eplb.backend=cuda"),
    (["router.router_skew=-4"], "router.router_skew=-4.0 biases router=synthetic only"),
    (["topology.inter_gbytes_per_s=0"], "topology.inter_gbytes_per_s must be a finite number > 0, got 0.0"),
    (["trainer.lr=-1"], "trainer.lr must be a finite number > 0, got -1.0"),
    (["trainer.lr=nan"], "trainer.lr must be a finite number > 0, got nan"),
    (["trainer.min_lr=1"], "trainer.min_lr=1.0 exceeds trainer.lr"),
    (["trainer.clip_grad=-1"], "trainer.clip_grad must be a finite number >= 0"),
    (["trainer.heatmap_interval=-1"], "trainer.heatmap_interval must be an integer >= 0, got -1"),
    (["trainer.seed=4294967296"], "trainer.seed must be below 2.32 .numpy.s seeds"),
    (["trainer.run_dir=' '"], "trainer.run_dir must name a directory"),
])
def test_bad_config_values_name_the_field(overrides, message):
    from omegaconf import OmegaConf

    from app.config import GROUPS

    cfg = compose(*overrides)
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        for group in GROUPS:
            OmegaConf.to_object(cfg[group])


def test_bad_layouts_name_the_field():
    from omegaconf import OmegaConf

    from app.config import ParallelConfig, TopologyConfig
    from app.setup import build_topology, resolve_parallel

    model = OmegaConf.to_object(compose().model)  # tiny: 8 experts
    with pytest.raises(ValueError, match="parallel.ep=3 does not divide model.num_moe_experts=8"):
        resolve_parallel(ParallelConfig(ep=3), model, world=3)
    with pytest.raises(ValueError, match="parallel.ep=4 x parallel.expert_tp=1 must divide"):
        resolve_parallel(ParallelConfig(ep=4), model, world=6)
    with pytest.raises(ValueError, match="topology.ranks_per_domain"):
        build_topology(TopologyConfig(ranks_per_domain=3), ep=4, local_world_size=4)
    assert build_topology(TopologyConfig(), ep=32, local_world_size=8).num_domains == 4  # a node is a domain


def test_bad_config_fails_fast_from_the_command_line(tmp_path):
    """A config error is printed once (rank 0), naming the field, without a traceback; every rank exits."""
    proc = train(tmp_path / "bad", "parallel.ep=3", "logger=none", nproc=3, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("config error: parallel.ep=3 does not divide model.num_moe_experts=8") == 1, out[-3000:]
    assert "ValueError" not in out  # no rank's traceback (torchrun still reports the failed children its own way)
    for bad, says, field in (
            ("eplb.num_slots=-1", "config error: eplb.num_slots must be an integer >= 0, got -1", "eplb.num_slots"),
            ("eplb.num_chunks=3", "config error: eplb.num_chunks=3: backend cuda runs 1 or 2", "eplb.num_chunks"),
            ("eplb.num_slots=two", "config error:", "eplb.num_slots"),
            ("eplb.backend=cuda", "config error: eplb.backend=cuda runs bf16 on GPUs", "trainer.device=cuda"),
            ("parallel.expert_tp=2", "config error: parallel.expert_tp=2 with eplb=topoep", "parallel.expert_tp=1"),
            ("parallel.tp=2", "config error: parallel.tp=2 runs sequence parallelism", "parallel.tp=1"),
            ("trainer.seq_length=100000000", "config error: corpus", "trainer.seq_length")):
        extra = ("eplb.backend=cuda",) if "num_chunks" in bad else ()
        proc = train(tmp_path / "bad", bad, *extra, "logger=none", nproc=2, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and out.count(says) == 1 and "ValueError" not in out and "ValidationError" not in out, (bad, out[-3000:])
        assert field in out, (bad, out[-3000:])
    proc = train(tmp_path / "bad", "model=llama", nproc=1, check=False)
    assert proc.returncode != 0 and "model/llama" in proc.stdout + proc.stderr


@pytest.mark.parametrize("model", ["tiny_glm45air", "tiny_deepseekv2"])
def test_glm_and_deepseek_structures_match_baseline(tmp_path, model):
    """Sigmoid router with expert bias, shared experts, dense first layer (GLM-4.5-Air); multi-latent
    attention and group-limited routing (DeepSeek-V2): megatron's router is kept, so the losses match."""
    losses = {}
    for eplb in ("none", "topoep"):
        train(tmp_path / eplb, f"model={model}", f"eplb={eplb}", "trainer.steps=3", "logger=none")
        losses[eplb] = [r["loss"] for r in metrics(tmp_path / eplb)]
    assert losses["topoep"][0] == pytest.approx(losses["none"][0], rel=1e-6)
    assert losses["topoep"] == pytest.approx(losses["none"], rel=1e-4)


def test_pipeline_parallel_with_a_stage_without_moe_layers(tmp_path):
    """PP 2 x EP 2 on 4 ranks; the first stage holds only the dense first layer (GLM-4.5-Air structure)."""
    losses = {}
    for eplb in ("none", "topoep"):
        train(tmp_path / eplb, "model=tiny_glm45air", "model.num_layers=2", "parallel.pp=2", f"eplb={eplb}",
              "topology=node", "trainer.steps=3", "logger=none")
        losses[eplb] = [r["loss"] for r in metrics(tmp_path / eplb)]
    assert losses["topoep"] == pytest.approx(losses["none"], rel=1e-4)


def test_synthetic_router_skews_and_topoep_balances(tmp_path):
    """router=synthetic is megatron's moe_router_force_biased (random logits + fixed expert bias)."""
    train(tmp_path / "syn", "router=synthetic", "router.router_skew=-4", "eplb=topoep", "trainer.steps=3",
          "logger=none")
    for r in metrics(tmp_path / "syn"):
        assert r["moe/imbalance_before"] > 1.5
        assert r["moe/imbalance_after"] < r["moe/imbalance_before"] - 0.3
        assert r["moe/replica_fraction"] > 0.2


def test_microbatches_log_interval_and_resume(tmp_path):
    """With 4 micro-batches the imbalance before balancing is averaged per micro-batch as the layers' plans are (the
    static plan's "after" equals it); trainer.log_interval logs every 2nd step and the last; the token bytes of both
    layers reach the logs; a resumed run logs each step once; save_interval also saves the last step; a step that
    saves is logged whatever the log interval (its counts would be lost to a resume otherwise)."""
    run = tmp_path / "static"
    common = ("parallel.num_microbatches=4", "trainer.log_interval=2", "trainer.warmup_steps=0", "logger=none")
    train(run, "eplb=static", "trainer.steps=3", "trainer.save_interval=2", *common)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [2, 3]
    for r in rows:
        assert r["moe/imbalance_before"] == pytest.approx(r["moe/imbalance_after"], rel=1e-9, abs=0)
        assert r["moe/token_bytes_inter"] > 0 and r["moe/token_bytes_intra"] > 0  # 2 domains of 2 ranks
        assert r["moe/replica_bytes_inter"] == r["moe/replica_bytes_intra"] == 0  # static: no replicas
    # saved at steps 2 and 3 (the last); as if the run had stopped after logging step 3 but before saving it:
    (run / "checkpoints" / "latest").write_text("iter_0000002\n")
    train(run, "eplb=static", "trainer.steps=4", "trainer.save_interval=2", *common)  # resumes at step 2
    assert [r["step"] for r in metrics(run)] == [2, 4]  # step 3's row went with the step it was made in
    odd = tmp_path / "odd"  # saves at step 3, logs every 2nd: step 3 is logged, with its count of one step
    train(odd, "eplb=static", "trainer.steps=4", "trainer.save_interval=3", *common)
    assert [r["step"] for r in metrics(odd)] == [2, 3, 4]
    base = tmp_path / "none"
    train(base, "eplb=none", "trainer.steps=2", *common)
    row = metrics(base)[0]
    assert row["step"] == 2 and row["moe/token_bytes_inter"] > 0 and row["moe/replica_bytes_inter"] == 0
    assert row["moe/token_bytes_inter"] == pytest.approx(rows[0]["moe/token_bytes_inter"], rel=0.05)


def test_resume_keeps_the_synthetic_routing_and_says_which_schedule_it_keeps(tmp_path):
    """The synthetic router draws its logits from megatron's RNG tracker, which the checkpoint keeps: a run resumed at
    step 2 routes steps 3-4 as the uninterrupted run does (not steps 1-2 again). Resumed with more trainer.steps, it
    keeps the checkpoint's LR schedule and says so; another trainer.lr is a config error."""
    common = ("eplb=none", "router=synthetic", "trainer.warmup_steps=0", "trainer.lr_decay_style=constant",
              "logger=none")
    whole, part = tmp_path / "whole", tmp_path / "part"
    train(whole, *common, "trainer.steps=4", nproc=2)
    train(part, *common, "trainer.steps=2", "trainer.save_interval=2", nproc=2)
    assert (part / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    proc = train(part, *common, "trainer.steps=4", nproc=2)
    assert "the LR schedule continues the checkpoint's: lr_decay_steps 2 (trainer.steps=4)" in proc.stdout
    a, b = metrics(whole), metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for step in (3, 4):
        ra, rb = a[step - 1], b[step - 1]
        assert rb["lr"] == ra["lr"] and rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        layers = [k for k in ra if k.startswith("moe/layer") and k.endswith("imbalance_before")]
        assert layers and all(rb[k] == ra[k] for k in layers), step  # the same random routing
    assert b[2]["moe/imbalance_before"] != b[0]["moe/imbalance_before"]  # not step 1's routing again
    config = (part / "config.yaml").read_text()
    proc = train(part, *common, "trainer.steps=6", "trainer.lr=1e-2", nproc=2, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "config error:" in out and "of a run configured otherwise: trainer.lr: 0.001 -> 0.01" in out, out[-3000:]
    assert (part / "config.yaml").read_text() == config  # a refused resume leaves the run's record as it was
    (part / "config.yaml").unlink()  # without the record, the optimizer's groups still refuse it, in trainer terms
    proc = train(part, *common, "trainer.steps=6", "trainer.lr=1e-2", nproc=2, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "saved with other trainer.lr" in out and "max_lr 0.001" in out, out[-3000:]
    assert "Parameter group key" not in out  # megatron's own dump of the groups is left out
    proc = train(part, *common, "trainer.steps=1", "trainer.resume=false", nproc=2)
    assert "starting anew in" not in proc.stdout  # (no config.yaml was left there to replace)
    proc = train(part, *common, "trainer.steps=1", "trainer.resume=false", nproc=2)
    assert f"starting anew in {part}" in proc.stdout and [r["step"] for r in metrics(part)] == [1]


def test_resume_changes_tell_what_a_resumed_run_may_change():
    """app.loop.resume_changes: a resumed run may change how long it trains, what it writes, the balancer and the
    topology (listed as changes); any other field is a conflict, named with both values."""
    from app.loop import _yaml_of, resume_changes

    old = {"trainer": {"steps": 10, "lr": 3e-4, "micro_batch_size": 1, "log_interval": 1, "tags": [1, 2]},
           "eplb": {"name": "none", "num_slots": 2}, "logger": {"name": "wandb"}, "model": {"name": "tiny"}}

    def resolved(**groups):
        r = {g: {**old[g], **groups.get(g, {})} for g in old}
        return {**r, "_yaml": _yaml_of(r)}

    assert resume_changes(_yaml_of(old), resolved()) == ([], [])
    conflicts, changes = resume_changes(_yaml_of(old), resolved(
        trainer={"steps": 20, "log_interval": 5, "micro_batch_size": 4}, eplb={"name": "topoep"},
        logger={"name": "none"}))
    assert conflicts == ["trainer.micro_batch_size: 1 -> 4"]
    assert changes == ["eplb.name: none -> topoep", "logger.name: wandb -> none", "trainer.log_interval: 1 -> 5",
                       "trainer.steps: 10 -> 20"]
    assert resume_changes(_yaml_of(old), resolved(model={"name": "qwen3"}))[0] == ["model.name: tiny -> qwen3"]


def test_console_line_says_plan_skip_and_slot_skip_only_with_backend_cuda():
    from app.loop import _line

    m = {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "step_time_s": 0.1, "moe/imbalance_before": 2.0,
         "moe/imbalance_after": 1.0, "moe/internode_after": 0.1, "moe/replica_fraction": 0.2, "moe/planner_ms": 0.5,
         "moe/guard_fired": 1.0, "moe/plan_skip": 1.0, "moe/slot_skip": 0.0}
    assert _line(1, 10, m, True).endswith("guard 100 % (plan skip 100 %)")
    assert _line(1, 10, m, True, backend_cuda=True).endswith("guard 100 % (plan skip 100 %, slot skip 0 %)")


def test_wandb_runs_of_a_run_directory_share_its_group(tmp_path, monkeypatch):
    """app.logger.Logger: the W&B run is named after the run directory and grouped by it; a resumed run's W&B run is
    named after the checkpoint it continues, in the same group."""
    import sys
    import types

    from app.config import LoggerConfig
    from app.logger import Logger

    seen = []

    class _Run:
        dir = str(tmp_path)

    fake = types.SimpleNamespace(init=lambda **kw: seen.append(kw) or _Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "qwen3-topoep-natural"
    Logger(LoggerConfig(), run, {}, enabled=True).finish = lambda: None
    Logger(LoggerConfig(), run, {}, enabled=True, fresh=False, resumed_from="iter_0000025")
    assert [(kw["name"], kw["group"]) for kw in seen] == [
        ("qwen3-topoep-natural", "qwen3-topoep-natural"), ("qwen3-topoep-natural-from-iter_0000025", "qwen3-topoep-natural")]
