"""A YAML file a user gives (a scenario, a cluster, its links), read within bounds.

PyYAML's safe loader builds a document as written, but a few lines of aliases (``*name``) can
name one list inside another nine times over, a "billion laughs" that whatever walks the result
expands into gigabytes; and a trace passed by mistake is megabytes of JSON, or gzip bytes. So a
file is refused, with one line naming it and the limit, when it is larger than
:data:`MAX_YAML_BYTES`, uses more than :data:`MAX_YAML_ALIASES` aliases, or is not UTF-8 text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .units import TopologyError

#: A scenario or cluster file is a page of YAML: larger than this (bytes) is not one; and a
#: document may use this many aliases, which bounds what a few lines can expand to (16 aliases
#: make at most about 256 copies).
MAX_YAML_BYTES = 1_000_000
MAX_YAML_ALIASES = 16


class _TooManyAliases(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing more than :data:`MAX_YAML_ALIASES` aliases."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases = getattr(self, "aliases", 0) + 1
            if self.aliases > MAX_YAML_ALIASES:
                raise _TooManyAliases
        return super().compose_node(parent, index)


#: libyaml's safe loader where PyYAML was built with it: the same documents, parsed in C
_FAST_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_preset(text: str) -> Any:
    """A preset file of ours (``topology/presets/``): trusted and small, so parsed by libyaml
    where PyYAML has it, five to ten times faster than its Python loader (a few ms a command)."""
    return yaml.load(text, Loader=_FAST_SAFE_LOADER)


def read_yaml(path: Path) -> Any:
    """The document in ``path``; a :class:`TopologyError` whose key is "" and whose message
    says what is wrong with the file (not its name: the caller says which file and key)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise TopologyError("", "no such file") from None
    except OSError as err:
        raise TopologyError("", f"cannot be read ({err.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        raise TopologyError("", "is gzip data, not YAML (a trace? name it in a scenario's trace: key)")
    if len(raw) > MAX_YAML_BYTES:
        raise TopologyError("", f"{len(raw) / 1e6:.1f} MB is not a page of YAML (at most {MAX_YAML_BYTES / 1e6:g} MB; "
                                "a trace? name it in a scenario's trace: key)")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_BoundedLoader)
    except UnicodeDecodeError:
        raise TopologyError("", "is not UTF-8 text, so not YAML") from None
    except _TooManyAliases:
        raise TopologyError("", f"more than {MAX_YAML_ALIASES} YAML aliases (*name); refusing a document that may "
                                "expand beyond bounds (write the values out)") from None
    except RecursionError:
        raise TopologyError("", "YAML nested deeper than Python's recursion limit: no scenario or cluster nests so deep") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise TopologyError("", "not valid YAML" + (f" at line {mark.line + 1}" if mark else "")) from None
    if isinstance(data, (dict, list)) and _is_trace(data):
        raise TopologyError("", "is a profiler trace (Chrome trace events), not YAML of whatif's (name it in a "
                                "scenario's trace: key)")
    return data


def _is_trace(data) -> bool:
    """Whether a document is a Chrome/Kineto trace: JSON is YAML, so a plain trace file loads."""
    events = data.get("traceEvents") if isinstance(data, dict) else data
    return isinstance(events, list) and bool(events) and all(isinstance(e, dict) and "ph" in e for e in events[:8])


def with_cluster_file(block: Any, base_dir: Path) -> Any:
    """A cluster block that names a file holding one, read: ``calibrated.yaml`` (the file's
    cluster as it is) or ``{file: calibrated.yaml, machines: [8, 64]}`` (the file's cluster with
    the block's other keys in place of its own; a mapping given for a mapping, such as
    ``nccl: {version: 2.26.2}``, changes only the keys it names, so the calibration stays). The
    file is a cluster YAML (``whatif calibrate nccl-tests --out``) or a scenario (its
    ``cluster:``), relative to ``base_dir``; a relative ``links:`` in it is relative to it. Any
    other block comes back as it is. A file that cannot be read, or holds no cluster, raises a
    :class:`TopologyError` with key ``file`` and a message that names it."""
    if isinstance(block, str):
        block = {"file": block}
    if not isinstance(block, dict) or "file" not in block:
        return block
    if not isinstance(block["file"], str):
        raise TopologyError("file", f"expected the name of one cluster file, got {block['file']!r} (several "
                                    "clusters: a scenario each, or a list of machines or links in one)")
    given = Path(block["file"])
    path = given if given.is_absolute() else Path(base_dir) / given
    try:
        doc = read_yaml(path)
    except TopologyError as err:
        raise TopologyError("file", f"{path}: {err.message}") from None
    if isinstance(doc, dict) and "cluster" in doc:
        doc = doc["cluster"]
    named = doc if isinstance(doc, str) else doc.get("file") if isinstance(doc, dict) else None
    if named is not None:
        raise TopologyError("file", f"{path}: names another file ({named}); name that one instead")
    if not isinstance(doc, dict):
        raise TopologyError("file", f"{path}: holds no cluster (a mapping of machine, machines, ..., or a "
                                    "scenario's cluster: block)")
    merged = dict(doc)
    links = merged.get("links")
    if isinstance(links, str) and not Path(links).is_absolute():
        merged["links"] = str(path.parent / links)
    for key, value in block.items():
        if key == "file":
            continue
        mine = merged.get(key)
        merged[key] = {**mine, **value} if isinstance(mine, dict) and isinstance(value, dict) else value
    return merged
