"""This machine's default operator models, fitted once and cached.

``whatif simulate --batch-size`` and a scenario's ``batch_size`` without a models file use
them. Where they live: :func:`cache_dir`.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from .device import current_device
from .fit import fit_models
from .models import PerfModelError, PerfModels, load_models


def cache_dir() -> Path:
    """Where fitted models are cached: $WHATIF_CACHE_DIR, else $XDG_CACHE_HOME/whatif or ~/.cache/whatif."""
    if os.environ.get("WHATIF_CACHE_DIR"):
        return Path(os.environ["WHATIF_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "whatif"


def default_models(progress=None) -> PerfModels:
    """This machine's models from the quick sweep, fitted once (a few seconds) and then cached.

    The cache is keyed by the device and by the code that measures and fits (a hash of this
    package's modules): models cached by an older whatif, whose features differ, are refitted
    rather than fed features they were not trained on."""
    device = current_device()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device["name"]).strip("-").lower() or "cpu"
    path = cache_dir() / f"perfmodels-quick-{slug}-{_code_fingerprint()}.json"
    if path.is_file():
        return load_models(path)
    try:
        from whatif.sim.perfmodels.sweep import run_sweep

        samples, measured = run_sweep(quick=True)
    except ImportError as err:
        raise PerfModelError(
            f"no operator models given (--perfmodel) and none cached in {path.parent}; fitting them needs torch ({err})"
        ) from None
    models = fit_models(samples, measured, sources=["sweep quick"])
    models.save(path)
    if progress:
        progress(f"fitted operator models on the quick sweep; cached in {path}")
    return models


def _code_fingerprint() -> str:
    digest = hashlib.sha1()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]
