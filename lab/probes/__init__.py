"""Measurement jobs the lab runs as every worker of an emulated cluster (``python -m
whatif.lab.probes.NAME``); rank 0 writes what it measured as JSON to ``$WHATIF_LAB_OUT``, and
``lab/calibrate.py`` fits the topology's figures from it.

* ``allreduce``: Gloo all-reduces of several sizes, idle and beside a computing thread.
* ``horovod_loop``: the CPU time Horovod's background loop takes from a worker's core per cycle.
* ``memory``: how much workers sharing the box's memory slow each other down.
"""
