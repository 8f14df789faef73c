"""Data-parallel frameworks as objects, and the registry that names them.

``base.py`` says what a framework is to the cluster simulation (its messages, queues, policy,
synchronisation points, copies and CPU costs); ``ddp.py``, ``horovod.py`` and
``parameter_server.py`` are the three there are. A new framework is a module with a
:class:`Framework` subclass, and its line in :data:`FRAMEWORKS`.
"""

from .base import Framework, FrameworkOptions, Message
from .ddp import DDP
from .horovod import Horovod
from .parameter_server import ParameterServer

#: The frameworks by the name a scenario's ``framework:`` gives.
FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (DDP(), Horovod(), ParameterServer())}


def framework(name: str) -> Framework:
    """The framework called ``name``."""
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}; choose from {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


__all__ = ["FRAMEWORKS", "Framework", "FrameworkOptions", "Message", "framework"]
