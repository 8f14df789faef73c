"""``whatif profile``'s runs: a training script, or one training step, measured at every level.

XSP (Li et al., "XSP: Across-Stack Profiling and Analysis of Machine Learning Models on GPUs",
IPDPS 2020) runs the workload once per level of the stack. ``whatif profile -- python
SCRIPT.py`` (:func:`profile_command`) reruns a script that uses
:class:`~whatif.collectors.xsp.measure.LeveledProfile` once per level, with the level, folder
and steps in environment variables that override the script's own arguments, as ``whatif
collect`` does for :class:`~whatif.collectors.capture.Capture`; :func:`run_levels` runs every
level in one process. Both can alternate the levels in rounds, whose steps the view pools, so
that a shared machine's bursts of other work slow every level alike; both end by writing the
view (:mod:`whatif.collectors.xsp.view`) into the profile's folder.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from ..capture import script_of
from .levels import (
    LEVEL_ENV,
    LEVELS,
    LEVELS_ENV,
    OUT_ENV,
    ROUND_ENV,
    STEPS_ENV,
    WARMUP_ENV,
    ProfileError,
    parse_levels,
    read_runs,
    round_of,
)
from .measure import LeveledProfile
from .view import TABLE_FILE, VIEW_FILE, build_view, flat_table


def profile_command(
    command: Sequence[str],
    levels: Union[str, Sequence[str]] = LEVELS,
    out: Optional[Path] = None,
    steps: Optional[int] = None,
    warmup: Optional[int] = None,
    rounds: int = 1,
) -> dict:
    """Run ``command`` (a training script using :class:`LeveledProfile`) once per level, least
    intrusive first, ``rounds`` times over, into the folder ``out`` (default: ``SCRIPT.xsp``),
    then build the view (:func:`build_view`) and write it there as ``view.json`` and
    ``view.csv``. Alternating the levels round by round spreads each level's steps over the
    same stretch of time, so that a machine busy with other work for a while slows every level
    alike rather than one. An earlier leveled profile in ``out`` is replaced; a folder holding
    anything else is refused. Raises :class:`ProfileError` for an unknown level, a missing
    script, a script that fails or writes no record."""
    levels = parse_levels(levels)
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ProfileError("no command to run: whatif profile [--levels LEVELS] -- python SCRIPT.py ARGS...")
    script = script_of(command)
    if script is not None and not Path(script).is_file():
        raise ProfileError(f"{script}: no such script")
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    for what, value in (("--steps", steps), ("--warmup", warmup), ("--rounds", rounds)):
        if value is not None and value < 1:
            raise ProfileError(f"{what} must be at least 1, not {value}")
    out = Path(out) if out is not None else Path(f"{Path(script).stem if script else 'profile'}.xsp")
    _clear(out)
    shown = shlex.join(command)
    counts = {STEPS_ENV: steps, WARMUP_ENV: warmup}
    inherited = {name: value for name, value in os.environ.items() if name not in counts}
    chosen = {name: str(value) for name, value in counts.items() if value is not None}
    for level, round_ in ((level, r) for r in range(rounds) for level in levels):
        if round_ and not read_runs(out)[level][0]["run"]:
            continue  # a level that cannot run here (the kernel level without a GPU) says so once
        env = inherited | chosen | {
            LEVEL_ENV: level, LEVELS_ENV: ",".join(levels), OUT_ENV: str(out.resolve()), ROUND_ENV: str(round_)
        }
        record = out / (f"{level}.json" if round_ == 0 else f"{level}.{round_}.json")
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True)
        except FileNotFoundError:
            raise ProfileError(f"{command[0]}: no such command") from None
        except PermissionError:
            raise ProfileError(f"{command[0]}: not executable") from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            why = f": {lines[-1].strip()[:300]}" if lines else ""
            status = f"was killed by signal {-done.returncode}" if done.returncode < 0 else f"exited with status {done.returncode}"
            raise ProfileError(f"`{shown}` {status} at the {level} level{why}")
        if not record.is_file():
            raise ProfileError(
                f"`{shown}` wrote no {record.name} to {out}: does it use whatif.collectors.xsp.measure.LeveledProfile "
                "and call profile.step() every step?"
            )
    return _write_view(out)


def run_levels(
    step: Callable[[], object],
    model,
    out: Union[str, Path],
    levels: Union[str, Sequence[str]] = LEVELS,
    rounds: int = 1,
    steps: int = 10,
    warmup: int = 3,
    name: Optional[str] = None,
) -> dict:
    """Every level in this process: call ``step`` (one training step of ``model``) under a
    :class:`LeveledProfile` of each level in turn, least intrusive first, ``rounds`` times over,
    then build the view and write it into ``out`` as :func:`profile_command` does.

    One process saves a Python start and a torch import per run, which lets the levels
    alternate in more, shorter rounds on a busy machine; the model stays warm between runs (the
    hooks and the profiler of one run are gone before the next begins). Under ``whatif
    profile``, which chooses the level of each process, use :class:`LeveledProfile` alone."""
    if os.environ.get(LEVEL_ENV):
        raise ProfileError(f"run_levels chooses each level itself; {LEVEL_ENV} is set (running under `whatif profile`?)")
    levels = parse_levels(levels)
    out = Path(out)
    _clear(out)
    not_run: set = set()
    for level, round_index in ((level, r) for r in range(rounds) for level in levels):
        if level in not_run:
            continue
        with LeveledProfile(out, model=model, level=level, levels=levels, steps=steps, warmup=warmup, name=name, round_index=round_index) as profile:
            step()
            while profile.step():
                step()
        if not profile.record["run"]:
            not_run.add(level)
    return _write_view(out)


def _write_view(out: Path) -> dict:
    result = build_view(out) | {"folder": str(out)}
    (out / VIEW_FILE).write_text(json.dumps(result, indent=1) + "\n")
    flat_table(result).to_csv(out / TABLE_FILE, index=False)
    return result


def _clear(out: Path) -> None:
    """Make ``out`` an empty folder, removing an earlier leveled profile's files, refusing others."""
    if out.exists() and not out.is_dir():
        raise ProfileError(f"{out}: exists and is not a folder")
    if out.is_dir():
        present = list(out.iterdir())
        others = [p.name for p in present if p.name not in (VIEW_FILE, TABLE_FILE) and round_of(p.name) is None]
        if others:
            raise ProfileError(f"{out}: refusing to write into a folder that holds other files ({others[0]}) than a leveled profile")
        for p in present:
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
