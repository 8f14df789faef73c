"""Hold the tool's outputs fixed across a refactoring: record them once, compare them after.

The commands are the user's: ``whatif replay --json`` of every shared and bundled trace,
``whatif simulate`` / ``critical-path`` / ``overheads --json`` of a few, ``whatif predict
--json`` of every scenario in ``scenarios/`` and of the notebook's, and the notebook's own
printed tables. Each runs through the installed ``whatif`` command (or ``nbclient`` for the
notebook), so the check knows nothing of the code's layout.

    .venv/bin/python bench/identical_outputs.py record   # at the commit to hold fixed
    .venv/bin/python bench/identical_outputs.py          # after a change: exit 1 on a difference

Numbers must agree to ``--rtol`` (1e-9 relative), text exactly; an intended difference is
explained in the commit that makes it and recorded again there. The reference lives in
``bench/reference_outputs/`` (one JSON per command).

The batch-size outputs rest on operator models this script fits from the bundled traces, and
LightGBM's fit differs in its last digits from one CPU to another: on a Xeon, against the
references recorded on an AMD EPYC, two of them differ by about 1e-8 relative at an unchanged
commit. Compare on the machine that recorded, or record at the base commit first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WHATIF_SHARED_TRACES") or REPO.parent / "shared" / "traces")
REFERENCE = REPO / "bench" / "reference_outputs"
NOTEBOOK = REPO / "notebooks" / "bandwidth_10_vs_40.ipynb"
WHATIF = [str(Path(sys.executable).with_name("whatif"))]
RESNET = "kineto-resnet50-v100/resnet50_bs32_workers0.pt.trace.json.gz"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
WORK = REPO / "bench" / "out" / "identical_outputs"  # generated inputs: models fitted from the bundled traces, scenarios
MODELS = WORK / "perfmodels_from_traces.json"
# scenarios beyond scenarios/: GPU traces, DDP and the parameter server with P3, stragglers, batch size
EXTRA_SCENARIOS = {
    "ddp_a100_hierarchical.yaml": """
trace: ../../../../shared/traces/hta-ddp-resnet50/a100_ddp2_rank0.json.gz
cluster: {machines: [1, 2, 4], gpus_per_machine: [2, 8], intra_node: nvlink3, inter_node: [100gbe]}
framework: ddp
collective: hierarchical
""",
    "ps_p3_resnet50.yaml": """
trace: ../../../../shared/traces/kineto-resnet50-v100/resnet50_bs32_workers0.pt.trace.json.gz
cluster: {machines: [2, 4], gpus_per_machine: 1, intra_node: nvlink2, inter_node: [10gbe, 25gbe]}
framework: ps
policy: [fifo, p3]
""",
    "horovod_straggler_v100.yaml": """
trace: ../../../../shared/traces/hta-ddp-resnet50/v100_1gpu_rank0.json.gz
cluster: {machines: 2, gpus_per_machine: 2, intra_node: nvlink2, inter_node: 25gbe}
framework: [horovod, ddp]
stragglers: [{machine: 1, gpu_slowdown: 1.3}]
""",
    "batch_size_convnet.yaml": """
trace: ../../../data/convnet_cpu.bundle
cluster: {machines: [1, 2], gpus_per_machine: 1, intra_node: nvlink2, inter_node: 10gbe}
framework: [horovod, ddp]
batch_size: 64
perfmodel: perfmodels_from_traces.json
""",
}


def prepare_inputs() -> None:
    """Fit operator models from the bundled traces alone (deterministic, no sweep) and write the
    extra scenarios, both under ``bench/out/identical_outputs``."""
    WORK.mkdir(parents=True, exist_ok=True)
    for name, text in EXTRA_SCENARIOS.items():
        (WORK / name).write_text(text.lstrip())
    subprocess.run(WHATIF + ["perfmodel", "fit", "--no-sweep", "--from-trace", "data/convnet_cpu.bundle",
                             "--from-trace", "data/wide_mlp_cpu.pt.trace.json.gz", "--peak-gflops", "50",
                             "--bandwidth-gbps", "10", "--out", str(MODELS.relative_to(REPO))],
                   cwd=REPO, check=True, capture_output=True)


def commands() -> dict[str, list[str]]:
    """Every command to hold fixed, by a stable name; paths relative to the repository."""
    shared = sorted(p.relative_to(REPO.parent) for p in SHARED.rglob("*.json.gz")) if SHARED.is_dir() else []
    bundled = ["data/convnet_cpu.pt.trace.json.gz", "data/wide_mlp_cpu.pt.trace.json.gz", "data/convnet_cpu.bundle"]
    out = {}
    for trace in [f"../{p}" for p in shared] + bundled:
        out[f"replay {trace}"] = ["replay", trace, "--json"]
    some = ["data/convnet_cpu.pt.trace.json.gz"]
    if shared:
        some += [f"../shared/traces/{RESNET}", "../shared/traces/hta-ddp-resnet50/a100_ddp2_rank0.json.gz"]
    for trace in some:
        out[f"simulate amp {trace}"] = ["simulate", trace, "--json", "--optimization", "amp"]
        out[f"simulate fused+faster {trace}"] = [
            "simulate", trace, "--json", "--optimization", "fused-optimizer", "--optimization", "faster-gpu=2"]
        out[f"simulate scale+remove {trace}"] = [
            "simulate", trace, "--json", "--scale", "conv=0.5", "--remove", "DataLoader"]
        out[f"critical-path {trace}"] = ["critical-path", trace, "--json"]
        out[f"overheads {trace}"] = ["overheads", trace, "--json"]
    out["simulate batch 64 data/convnet_cpu.bundle"] = [
        "simulate", "data/convnet_cpu.bundle", "--json", "--batch-size", "64", "--perfmodel", str(MODELS.relative_to(REPO))]
    out["simulate batch 128 from 64 data/wide_mlp_cpu.pt.trace.json.gz"] = [
        "simulate", "data/wide_mlp_cpu.pt.trace.json.gz", "--json", "--batch-size", "128", "--from-batch-size", "64",
        "--perfmodel", str(MODELS.relative_to(REPO))]
    scenarios = [p for p in sorted((REPO / "scenarios").glob("*.yaml")) if shared or "shared/" not in p.read_text()]
    scenarios += [WORK / name for name in EXTRA_SCENARIOS if shared or "shared" not in EXTRA_SCENARIOS[name]]
    for scenario in scenarios:
        out[f"predict {scenario.name}"] = ["predict", str(scenario.relative_to(REPO)), "--json"]
    return out


def run_command(args: list[str]) -> dict:
    done = subprocess.run(WHATIF + args, cwd=REPO, capture_output=True, text=True)
    try:
        stdout = json.loads(done.stdout) if done.stdout.strip() else None
    except json.JSONDecodeError:
        stdout = done.stdout
    return {"args": args, "exit": done.returncode, "stdout": stdout, "stderr": done.stderr.strip()}


def run_notebook() -> dict:
    """The notebook's printed outputs (tables as text), executed from its own folder."""
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=1800, resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            text = data.get("text/plain") if data else output.get("text")
            if text and not str(text).startswith("<IPython"):
                texts.append(str(text))
    return {"args": ["notebook", NOTEBOOK.name], "exit": 0, "stdout": texts, "stderr": ""}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("_")[:150]


def differences(expected, actual, rtol: float, where: str = "") -> list[str]:
    """Where ``actual`` departs from ``expected``: numbers beyond ``rtol``, anything else unequal."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return [] if expected == actual else [f"{where}: {expected!r} != {actual!r}"]
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        if expected == actual or (math.isnan(expected) and math.isnan(actual)):
            return []
        if math.isfinite(expected) and abs(actual - expected) <= rtol * max(abs(expected), abs(actual)):
            return []
        return [f"{where}: {expected!r} != {actual!r}"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{where}.{k}: missing" for k in expected if k not in actual]
        out += [f"{where}.{k}: new" for k in actual if k not in expected]
        for k in expected.keys() & actual.keys():
            out += differences(expected[k], actual[k], rtol, f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: {len(expected)} items != {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, rtol, f"{where}[{i}]")]
    if isinstance(expected, str) and isinstance(actual, str) and expected != actual:
        # printed tables: compare their numbers by value, the rest of the text exactly
        if NUMBER.sub("#", expected) == NUMBER.sub("#", actual):
            pairs = zip(map(float, NUMBER.findall(expected)), map(float, NUMBER.findall(actual)))
            return [d for i, (e, a) in enumerate(pairs) for d in differences(e, a, rtol, f"{where}#{i}")]
    return [] if expected == actual else [f"{where}: {str(expected)[:120]!r} != {str(actual)[:120]!r}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("check", "record"), default="check")
    parser.add_argument("--rtol", type=float, default=1e-9)
    parser.add_argument("--only", metavar="REGEX", help="run only the commands whose name matches")
    args = parser.parse_args(argv)
    todo = {**commands(), "notebook": None}
    if args.only:
        todo = {k: v for k, v in todo.items() if re.search(args.only, k)}
    REFERENCE.mkdir(parents=True, exist_ok=True)
    prepare_inputs()
    failed = 0
    for name, cmd in todo.items():
        t0 = time.perf_counter()
        result = run_notebook() if cmd is None else run_command(cmd)
        path = REFERENCE / f"{_slug(name)}.json"
        if args.mode == "record":
            path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            print(f"recorded {name} (exit {result['exit']}, {time.perf_counter() - t0:.1f} s)")
            continue
        if not path.is_file():
            print(f"NEW      {name}: no reference recorded")
            failed += 1
            continue
        found = differences(json.loads(path.read_text()), json.loads(json.dumps(result)), args.rtol, "")
        print(f"{'SAME' if not found else 'DIFFERS':8} {name} ({time.perf_counter() - t0:.1f} s)")
        for line in found[:10]:
            print(f"    {line}")
        failed += bool(found)
    if args.mode == "check":
        print(f"{'PASS' if not failed else 'FAIL'}: {len(todo) - failed} of {len(todo)} outputs identical "
              f"(numbers to {args.rtol:g} relative)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
