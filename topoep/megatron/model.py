"""Build megatron-core GPT models with TopoEP in their MoE blocks.

`build_gpt_model` takes megatron's own TransformerConfig, builds the decoder block spec megatron would
build (local spec, or Transformer Engine's when TE is importable and wanted), swaps every MoELayer for
`TopoEPMoELayer` when a `TopoEPSpec` is given, and returns the GPTModel. With topoep=None it is
megatron's baseline model (its alltoall dispatcher), with identical parameters for the same seed.
"""

from __future__ import annotations

import copy
from functools import partial

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from topoep.megatron.moe_layer import TopoEPSpec, TopoEPMoELayer


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


class LocalMLACoreAttention(DotProductAttention):
    """megatron's local attention for multi-latent attention: MLA passes separate key and value head
    sizes (k_channels, v_channels) that the local DotProductAttention does not accept."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def _swap_moe(mlp, topoep: TopoEPSpec):
    if isinstance(mlp, partial) and isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer):
        return partial(TopoEPMoELayer, *mlp.args, **{**mlp.keywords, "topoep": topoep})
    if isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer):
        return ModuleSpec(module=TopoEPMoELayer, submodules=mlp.submodules, params={**mlp.params, "topoep": topoep})
    return mlp


def decoder_block_spec(config, *, use_te: bool, topoep: TopoEPSpec | None, vp_stage=None, pp_rank=None):
    spec = copy.deepcopy(get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                    normalization=config.normalization, vp_stage=vp_stage,
                                                    pp_rank=pp_rank))
    for layer in spec.layer_specs:
        sub = layer.submodules
        if topoep is not None:
            sub.mlp = _swap_moe(sub.mlp, topoep)
        if not use_te and getattr(config, "multi_latent_attention", False):
            attn = sub.self_attention.submodules
            if getattr(attn, "core_attention", None) is DotProductAttention:
                attn.core_attention = LocalMLACoreAttention
    return spec


def build_gpt_model(config, *, vocab_size: int, max_sequence_length: int, topoep: TopoEPSpec | None = None,
                    use_te: bool | None = None, rotary_base: float = 10000.0, rotary_percent: float = 1.0,
                    pre_process: bool = True, post_process: bool = True, vp_stage=None, pp_rank=None) -> GPTModel:
    """megatron GPTModel with RoPE and untied embeddings; MoE layers use TopoEP when `topoep` is given."""
    if use_te is None:
        use_te = transformer_engine_available()
    spec = decoder_block_spec(config, use_te=use_te, topoep=topoep, vp_stage=vp_stage, pp_rank=pp_rank)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=rotary_base, rotary_percent=rotary_percent, vp_stage=vp_stage)


def moe_layers(model) -> list[MoELayer]:
    """Every MoELayer (baseline or TopoEP) of a model (or list of pipeline chunks), in layer order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
