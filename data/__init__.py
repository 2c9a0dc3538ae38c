"""TopoEP training corpus: build (six public sources, or an offline stand-in) and loaders.

    from data import build_loader, compose_data_config
    cfg = compose_data_config("offline")               # or the `data` node of the trainer's Hydra config
    loader = build_loader(cfg, seq_length=4096, micro_batch_size=1, dp_rank=0, dp_size=1, seed=1234)
    batch = next(loader)                               # tokens, labels, position_ids, loss_mask: [B, S]

See data/README.md. Heavy dependencies (datasets, megatron-core, transformers) load on first use.
"""

from data.builder import build_corpus
from data.config import DataConfig, DedupConfig, SourceConfig, TokenizerConfig
from data.loader import Corpus, PackedLoader, PackedSequences, build_loader, ensure_corpus
from data.manifest import Manifest
from data.sources import SourceUnavailableError
from data.store import compose_data_config, register_configs, to_data_config
from data.tokenizers import TokenizerUnavailableError

__all__ = [
    "Corpus", "DataConfig", "DedupConfig", "Manifest", "PackedLoader", "PackedSequences", "SourceConfig",
    "SourceUnavailableError", "TokenizerConfig", "TokenizerUnavailableError", "build_corpus", "build_loader",
    "compose_data_config", "ensure_corpus", "register_configs", "to_data_config",
]
