"""NCCL's communication, modelled: its topology search (``graphs``), its tuner's tables
(``tuning``) and cost models and choice (``model``), point-to-point operations (``p2p``), and
the transfers each algorithm sends (``plans``). The public entry point is
:func:`whatif.topology.collective_cost`; this package imports nothing so that ``fabric.py`` can
use its names."""
