"""The device operator models describe: the one at hand, and whether models were measured on it.

A models file names the device its sweep ran on (:mod:`~whatif.sim.perfmodels.models`); the
sweep runs on the CPU, so the device is this machine's CPU model. Models measured on another
device predict that device's operators, not this one's: loading them warns.
"""

from __future__ import annotations

from typing import Optional

from whatif.collectors.host import cpu_model


def current_device() -> dict:
    """The device at hand, as a models file names it (the sweep runs on the CPU)."""
    return {"type": "cpu", "name": cpu_model()}


def device_mismatch(device: dict) -> Optional[str]:
    """Why models measured on ``device`` do not describe this machine, or None when they do."""
    here = current_device()
    if (here["type"], here["name"]) != (device.get("type"), device.get("name")):
        return (
            f"the models were measured on {device.get('type')} {device.get('name')!r}, not on this "
            f"machine's {here['name']!r}; refit them here with `whatif perfmodel fit`"
        )
    return None
