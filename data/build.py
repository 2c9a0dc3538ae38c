"""Corpus build CLI (Hydra, config `configs/build_data.yaml`, group `data/`).

    python -m data.build                          # offline default: stdlib sources, byte tokenizer
    python -m data.build data=paper               # the paper's six sources (network, HF_TOKEN)
    python -m data.build data=paper data.tokenizer.name=zai-org/GLM-4.5-Air data.num_tokens=2000000000

Re-running the same command resumes an interrupted build; a finished corpus is reported, not rebuilt.
"""

from __future__ import annotations

import logging
import warnings

import hydra
from omegaconf import DictConfig, OmegaConf

from data.store import register_configs, to_data_config

register_configs()


def summary(manifest) -> str:
    """One row per source, then the totals."""
    head = f"{'source':<18} {'docs':>9} {'tokens':>12} {'share':>6} {'target':>12} {'exact':>7} {'near':>6} " \
           f"{'trunc':>6} {'parts':>5}"
    rows = [head]
    for name, s in manifest.sources.items():
        rows.append(f"{name:<18} {s['num_documents']:>9} {s['num_tokens']:>12} {s['share']:>6.3f} "
                    f"{s['target_tokens']:>12} {s['num_exact_duplicates']:>7} {s['num_near_duplicates']:>6} "
                    f"{s['num_truncated']:>6} {len(s['parts']):>5}" + ("  (ran out)" if s["exhausted"] else ""))
    rows.append(f"{'total':<18} {manifest.num_documents:>9} {manifest.num_tokens:>12}   "
                f"tokenizer={manifest.tokenizer['name']} build_seconds={manifest.build_seconds}")
    return "\n".join(rows)


@hydra.main(config_path="../configs", config_name="build_data", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    from data.builder import build_corpus
    from data.sources import SourceUnavailableError
    from data.tokenizers import TokenizerUnavailableError

    # megatron-core, torch and datasets are chatty on import and at INFO; keep the build's own output
    for name in ("megatron", "datasets", "torch", "httpx", "huggingface_hub", "fsspec"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    data_cfg = to_data_config(cfg.data)
    try:
        manifest = build_corpus(data_cfg, progress=cfg.progress)
    except (SourceUnavailableError, TokenizerUnavailableError, FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    out = Path(data_cfg.output_dir)
    (out / "build_config.yaml").write_text(OmegaConf.to_yaml(cfg.data, resolve=True))
    print(summary(manifest))
    print(f"corpus: {out.resolve()} (manifest.json, content_hash {manifest.content_hash[:16]})")


if __name__ == "__main__":
    main()
