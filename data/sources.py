"""Opening a source as a streaming `datasets.IterableDataset`, and getting the text out of its records.

One code path for the Hub and for local copies: a source is always read through
`datasets.load_dataset(..., streaming=True)`, except a `save_to_disk` directory, which `load_from_disk`
opens and `to_iterable_dataset()` turns into the same kind of stream. Resuming a stream uses the
`state_dict()` that datasets keeps for it.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from typing import Any

import numpy as np

from data.config import SourceConfig

STDLIB_PLACEHOLDER = "{stdlib}"


class SourceUnavailableError(RuntimeError):
    """A source cannot be opened or read (offline, gated, missing files, bad layout)."""


def stdlib_dir() -> str:
    """This interpreter's standard-library directory (what `{stdlib}` expands to)."""
    return sysconfig.get_path("stdlib")


def _expand(path: str) -> str:
    return path.replace(STDLIB_PLACEHOLDER, stdlib_dir())


def _is_saved_to_disk(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))


def _read_file_list(location: str) -> list[str]:
    import fsspec

    with fsspec.open(_expand(location), "rt") as f:
        files = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if not files:
        raise FileNotFoundError(f"{location} lists no data files")
    return files


def _describe(name: str, spec: SourceConfig) -> str:
    where = spec.path or spec.dataset
    parts = [f"source {name!r} ({where}"]
    parts += [f", {k}={v}" for k, v in (("subset", spec.subset), ("data_dir", spec.data_dir),
                                        ("split", spec.split)) if v]
    return "".join(parts) + ")"


def _unavailable(name: str, spec: SourceConfig, err: BaseException) -> SourceUnavailableError:
    first = str(err).splitlines()[0] if str(err) else ""
    fix = (f"Fix: check network access to the Hugging Face Hub and, for gated datasets such as "
           f"bigcode/starcoderdata, accept its terms and set HF_TOKEN; or point data.sources.{name}.path "
           "at a local copy (a save_to_disk directory or the repository's data files); or build the offline "
           "corpus (data=offline).")
    if spec.path:
        fix = f"Fix: check that data.sources.{name}.path ({spec.path}) exists and holds the data files."
    elif spec.data_files and not any("://" in f for f in spec.data_files):
        fix = f"Fix: check that data.sources.{name}.data_files ({spec.data_files}) match files on this machine."
    return SourceUnavailableError(f"cannot read {_describe(name, spec)}: {type(err).__name__}: {first}. {fix}")


def open_source(name: str, spec: SourceConfig, state: dict[str, Any] | None = None):
    """The source as a datasets.IterableDataset, positioned at `state` (a previous `state_dict()`)."""
    import datasets

    try:
        if spec.path and _is_saved_to_disk(_expand(spec.path)):
            ds = datasets.load_from_disk(_expand(spec.path))
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise KeyError(f"split {spec.split!r} not in {sorted(ds)}")
                ds = ds[spec.split]
            stream = ds.to_iterable_dataset()
        else:
            data_files = spec.data_files
            if spec.data_files_from is not None:
                data_files = _read_file_list(spec.data_files_from)
                if spec.shuffle_files_seed is not None:
                    order = np.random.RandomState(spec.shuffle_files_seed).permutation(len(data_files))
                    data_files = [data_files[i] for i in order]
            if data_files is not None:
                data_files = [_expand(f) for f in data_files]
            stream = datasets.load_dataset(
                _expand(spec.path) if spec.path else spec.dataset, name=spec.subset, data_dir=spec.data_dir,
                data_files=data_files, split=spec.split, revision=spec.revision, streaming=True,
                **dict(spec.builder_kwargs))
    except Exception as err:  # noqa: BLE001 - connection, gating, missing files, scripts: all "cannot read"
        raise _unavailable(name, spec, err) from err
    if state is not None:
        stream.load_state_dict(state)
    return stream


def iterate_records(name: str, spec: SourceConfig, stream) -> Iterator[dict[str, Any]]:
    """Records of an opened stream; a failure while reading (network drop, corrupt file) is reported as
    SourceUnavailableError naming the source."""
    it = iter(stream)
    while True:
        try:
            record = next(it)
        except StopIteration:
            return
        except Exception as err:  # noqa: BLE001
            raise _unavailable(name, spec, err) from err
        yield record


def check_readable(name: str, spec: SourceConfig) -> None:
    """Open a source and read its first record; SourceUnavailableError when it cannot be read or is empty
    (a pattern that matches no file, a wrong split)."""
    records = iterate_records(name, spec, open_source(name, spec))
    try:
        first = next(records, None)
    finally:
        records.close()
    if first is None:
        raise _unavailable(name, spec, FileNotFoundError("it yields no records (do its data_files, data_dir "
                                                         "and split match any data?)"))


def extract_text(record: dict[str, Any], field: str, source: str) -> str:
    """The document text of a record: a string field, or chat messages (a list of {role, content}
    dicts, e.g. DAPO-Math-17K's `prompt`) whose contents are joined by blank lines."""
    if field not in record:
        raise ValueError(f"source {source!r}: records have no field {field!r}; their fields are "
                       f"{sorted(record)}. Fix: set data.sources.{source}.text_field to one of them.")
    value = record[field]
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        return "\n\n".join(m["content"] for m in value)
    raise ValueError(f"source {source!r}: field {field!r} holds {type(value).__name__}, not text or chat "
                    f"messages. Fix: set data.sources.{source}.text_field to a text field of {sorted(record)}.")
