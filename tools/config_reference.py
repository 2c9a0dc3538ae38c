"""Write docs/config.md: every field of the layer's config (`topoep.LayerConfig`) and of the trainer's Hydra
groups (`app/config.py`), with its type, default and the docstring under it, read from the dataclasses' source.

Usage: python tools/config_reference.py [--check]   (--check: exit 1 when docs/config.md is not up to date)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "docs" / "config.md"


def field_docs(cls) -> dict[str, str]:
    """{field: the string literal right under its annotation} over the class and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:] + [None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return "(required)"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return repr(v) if isinstance(v, str) else str(v)


def table(cls, prefix: str) -> list[str]:
    docs = field_docs(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        rows.append(_row(f, prefix, docs))
    return rows


def _row(f: dataclasses.Field, prefix: str, docs: dict[str, str]) -> str:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    cells = [f"`{prefix}{f.name}`", f"`{kind}`", f"`{_default(f)}`", docs.get(f.name, "")]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def render() -> str:
    from app.config import GROUPS, EplbConfig
    from topoep.config import LayerConfig

    lines = [
        "# Configuration reference",
        "",
        "Generated from the dataclasses by `python tools/config_reference.py`; do not edit by hand.",
        "",
        "## The layer: `topoep.LayerConfig`",
        "",
        "`ExpertParallelMoE(config=LayerConfig(...))`, or the same fields as keywords; the megatron adapter takes it in",
        "`TopoEPSpec(topology, config)`. In training these are the fields of the Hydra group `eplb` (below). Every",
        "field is checked when the config is made, and an error names the field and what to set.",
        "",
        *table(LayerConfig, ""),
        "",
        "## The trainer's Hydra groups (`train.py`, `configs/<group>/*.yaml`)",
        "",
        "Override any field on the command line as `<group>.<field>=<value>`, e.g. `eplb.num_slots=4`. Every run",
        "writes the resolved values to `<run_dir>/config.yaml`, with those the run derived where a field was left to it",
        "(`parallel.ep`, `topology.ranks_per_domain`, `eplb.t_ffn`).",
    ]
    for group, cls in GROUPS.items():
        doc = " ".join((cls.__doc__ or "").split()) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__) else ""
        lines += ["", f"### `{group}` ({cls.__name__})", ""]
        if doc:
            lines += [doc, ""]
        if cls is EplbConfig:
            lines += ["`name`, `policy` and every field of `LayerConfig` above, as `eplb.<field>`:", ""]
            own = [f for f in dataclasses.fields(cls) if f.name in ("name", "policy")]
            docs = field_docs(cls)
            lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
            lines += [_row(f, "eplb.", docs) for f in own]
            continue
        lines += table(cls, f"{group}.")
    lines += data_group()
    return "\n".join(lines) + "\n"


def data_group() -> list[str]:
    """The `data` group (`data.config.DataConfig`, configs/data/*.yaml): the corpus fields and those of its parts."""
    from data.config import DataConfig, DedupConfig, SourceConfig, TokenizerConfig

    lines = ["", "### `data` (DataConfig)", "", " ".join(DataConfig.__doc__.split()),
             "`data=offline` (the default: a corpus built on first use from the Python standard library, no network) "
             "or `data=paper` (the paper's corpus, built once with `HF_TOKEN=... python -m data.build data=paper`; docs/training.md).", ""]
    lines += table(DataConfig, "data.")
    for name, cls in (("data.tokenizer", TokenizerConfig), ("data.dedup", DedupConfig),
                      ("data.sources.<name>", SourceConfig)):
        lines += ["", f"`{name}` ({cls.__name__}): {' '.join(cls.__doc__.split())}", ""]
        lines += table(cls, f"{name}.")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/config.md differs from the dataclasses")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run python tools/config_reference.py")
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
