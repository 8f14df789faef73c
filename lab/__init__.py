"""The lab: real training runs to hold the simulator's predictions against.

A second product beside the simulator. It runs real Horovod and PyTorch DDP jobs on CPU workers,
each machine of a cluster a network namespace on this one box with its NIC shaped by ``tc``, and
compares their iteration times with what ``whatif predict`` says for the same configuration.

* ``cluster``: the emulated cluster (namespaces, veths, a bridge, token-bucket shaping) and
  running a job's workers on it with the environment Horovod or DDP reads.
* ``calibrate``: fits the lab's own network and CPU sharing to the topology model
  (``whatif lab calibrate``), from the measurement jobs in ``probes``.
* ``probes``: the jobs that run inside the workers: all-reduce timing, Horovod's background loop,
  memory shared between workers.
* ``horovod_rendezvous``: Horovod's Gloo rendezvous server, for workers started without
  ``horovodrun``; ``horovod_build.sh`` builds Horovod for the lab (``make horovod``).
* ``validate``: one point held against a real run: capture 1x1, predict, run, compare
  (``whatif validate``; ``bench/validation_grid.py`` runs a grid of them).
* ``cli``: the ``whatif lab`` and ``whatif validate`` commands.

The lab imports the simulator (``whatif.collectors``, ``whatif.sim``, ``whatif.topology``, the
facade); the simulator never imports the lab. It needs root, network namespaces and, for
Horovod, ``make horovod``.
"""
