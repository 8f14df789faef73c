"""This machine's default operator models: fitted once by ``whatif perfmodel fit --cache``, then found here.

``whatif simulate --batch-size`` without ``--perfmodel``, and a scenario's ``batch_size``
without ``perfmodel``, use them (:func:`default_models`). Nothing fits them silently: where
none are cached, :class:`~whatif.sim.perfmodels.models.PerfModelError` names the command that
does. They are cached per device and per version of the code that measures and fits them
(:func:`cached_models_path`), in :func:`cache_dir`.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from whatif.collectors.cache_folder import cache_dir  # where whatif caches (the models here)

from .device import current_device, device_mismatch

if TYPE_CHECKING:
    from .models import PerfModels


def cached_models_path(device: Optional[dict] = None) -> Path:
    """The file of the default models of ``device`` (default: this machine's).

    The cache is keyed by the device and by the code that measures and fits (a hash of this
    package's modules): models cached by an older whatif, whose features differ, are refitted
    rather than fed features they were not trained on."""
    return cache_dir() / f"perfmodels-{_device_slug(device or current_device())}-{_code_fingerprint()}.json"


def default_models() -> PerfModels:
    """This machine's default models, as ``whatif perfmodel fit --cache`` left them; raises
    :class:`~whatif.sim.perfmodels.models.PerfModelError` naming the command that fits them
    where there are none."""
    from .models import PerfModelError, load_models

    device = current_device()
    path = cached_models_path(device)
    if path.is_file():
        return load_models(path)
    older = [p for p in path.parent.glob(f"perfmodels-{_device_slug(device)}-*.json") if p != path]
    why = f"none cached in {path.parent}" + (" for this version of whatif" if older else "")
    raise PerfModelError(
        f"no operator models for this device ({device['name']}): {why}; fit them with `whatif perfmodel fit "
        "--quick --out models.json` (one to three minutes) and pass --perfmodel models.json (in a scenario, "
        "`perfmodel: models.json`), or run `whatif perfmodel fit --quick --cache` to make them this machine's default"
    )


def cache_models(models: PerfModels) -> Path:
    """Make ``models``, measured on this machine, its default models; the file written."""
    from .models import PerfModelError

    mismatch = device_mismatch(models.device)
    if mismatch:
        raise PerfModelError(f"cannot make these models this machine's default: {mismatch}")
    path = cached_models_path()
    models.save(path)
    return path


def _device_slug(device: dict) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", device["name"]).strip("-").lower() or "cpu"


def _code_fingerprint() -> str:
    digest = hashlib.sha1()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]
