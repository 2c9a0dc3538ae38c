"""The megatron adapter (topoep.megatron.TopoEPMoELayer) refuses the megatron options it would otherwise compute
wrong without a word: experts split over tensor-parallel ranks, the dispatcher's shared-expert overlap, an expert MLP
other than bias-free SwiGLU, probabilities applied on the input. One gloo process builds the tiny model with each."""

from pathlib import Path

import pytest
import torch.nn.functional as F

from distributed import run_ranks

REPO = Path(__file__).resolve().parents[1]
CHANGES = {  # TransformerConfig field -> (value, what the error says)
    "moe_shared_expert_overlap": (True, "unset moe_shared_expert_overlap"),
    "activation_func": (F.gelu, "SwiGLU without biases"),
    "add_bias_linear": (True, "SwiGLU without biases"),
    "moe_apply_probs_on_input": (True, "unset moe_apply_probs_on_input"),
}


def _build(rank, world, changes):
    from hydra import compose, initialize_config_dir

    from app import setup
    from app.config import register_configs
    from app.loop import _quiet_megatron, job_from_config
    from topoep.megatron.cpu_compat import enable_cpu_compat
    from topoep.megatron.model import build_gpt_model
    from topoep.megatron.moe_layer import TopoEPSpec

    enable_cpu_compat()
    _quiet_megatron()
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", "trainer=cpu", "logger=none",
                                                               "topology=node"])
    job, _ = job_from_config(cfg)
    par = setup.resolve_parallel(job.parallel, job.model, world)
    setup.init_model_parallel(par)
    topology = setup.build_topology(job.topology, par.ep, world)
    out = {}
    for name, value in changes:
        tc = setup.transformer_config(job.model, par, job.trainer, job.router)
        setattr(tc, name, value)  # after megatron's own checks: what a caller could hand the layer
        spec = TopoEPSpec(topology, job.eplb.layer_config(t_ffn=1e-9))
        try:
            build_gpt_model(tc, vocab_size=256, max_sequence_length=16, topoep=spec)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def test_unsupported_megatron_options_are_refused():
    got = run_ranks(_build, 1, [(name, value) for name, (value, _) in CHANGES.items()])[0]
    for name, (_, says) in CHANGES.items():
        assert got[name] is not None and says in got[name], (name, got[name])
