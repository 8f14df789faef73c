"""Does ``whatif advise`` rank first what is really fastest? Its ranking held against the lab.

For each example model (``examples/``, as ``lab/validate.py`` runs them): capture a 1x1 bundle
and calibrate the lab's links (``lab.validate.capture`` and ``links``, kept under ``--out``),
write the scenario the lab's validation predicts from (``lab.validate.predict``'s: the
calibrated links, Horovod's fusion buffer and cycle time) with a grid over the frameworks the
lab runs (``--frameworks``, default Horovod and DDP) on ``--config`` at ``--bandwidth``, and ask
``whatif advise`` (``whatif/advice.py``, its alternatives only) to rank them. Then run every
one of them for real on the emulated cluster, ``--repeats`` times in turn (``lab.validate.measure``), and
check that the configuration advise ranked first is the one whose median run is the fastest.
Of what advise compares, only what the lab can run is asked of it and held against it: the
grid's frameworks with FIFO (``whatif advise`` also proposes a parameter server and P3, which the
lab does not run).

Target (issue 29): the first-ranked is the fastest for real on at least three models. Writes
``results.json`` and ``table.md`` under ``--out`` (default ``bench/out/advise_lab``), prints a
line per model and PASS or FAIL.

Needs root and the lab's Horovod build (``make horovod``); takes the lab, so run it under
``flock /work/wt/lab.lock`` where others share the box:

    sudo .venv/bin/python bench/advise_lab.py [--models vgg,transformer,wide_mlp]
        [--config 2x1] [--bandwidth 400] [--frameworks horovod,ddp] [--repeats 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from whatif.advice import advise
from whatif.collectors.capture import STEADY_ALLOCATOR
from whatif.lab.cluster import LabError, LabSpec, check_can_run
from whatif.lab.validate import CYCLE_TIME_MS, FUSION_BUFFER_BYTES, MODELS, capture, links, measure
from whatif.scenario import Scenario

TARGET_MODELS = 3


def scenario_for(trace: Path, links_file: Path, machines: int, gpus: int, bandwidth_mbps: float,
                 frameworks: list[str]) -> Scenario:
    """The lab validation's scenario (``lab.validate.predict``) with a grid over ``frameworks``."""
    doc = {
        "trace": str(trace),
        "cluster": {"machines": machines, "gpus_per_machine": gpus, "links": str(links_file),
                    "inter_node": {"bandwidth": f"{bandwidth_mbps:g}Mbps"}},
        "framework": frameworks,
        "policy": "fifo",
        "framework_options": {"fusion_buffer": f"{FUSION_BUFFER_BYTES}B", "cycle_time": f"{CYCLE_TIME_MS:g}ms"},
    }
    return Scenario.from_dict(doc, name=f"the advice for {trace} at {machines}x{gpus}")


def ranked_runnable(advice, frameworks: list[str]) -> list[dict]:
    """What advise compared that the lab can run, best first: the baseline and the alternatives
    of the grid's frameworks with FIFO, each with its predicted iteration and gain."""
    options = [advice.baseline] + [o for o in advice.ranked if o.kind == "alternative"]
    rows = [{"framework": o.configuration["framework"], "predicted_ms": o.predicted_ms, "gain_pct": o.gain_pct,
             "name": o.name} for o in options
            if o.configuration.get("framework") in frameworks and o.configuration.get("policy") == "fifo"]
    return sorted(rows, key=lambda r: -r["gain_pct"])


def check_model(model: str, args, work: Path) -> dict:
    machines, gpus = (int(x) for x in args.config.split("x"))
    spec = LabSpec(machines, gpus, args.bandwidth)
    check_can_run(spec)
    trace = capture(model, work, allocator=STEADY_ALLOCATOR)
    links_file = links(args.bandwidth, work)
    scenario = scenario_for(trace.resolve(), links_file.resolve(), machines, gpus, args.bandwidth, args.frameworks)
    advice = advise(trace, scenario, recipes=(), every_framework=False)  # what the lab cannot run, left out
    ranked = ranked_runnable(advice, args.frameworks)
    for row in ranked:
        row["runs_ms"] = []
    for r in range(args.repeats):  # the options in turn, so that a drift of the box's speed meets them alike
        for row in ranked:
            out = work / "runs" / f"{model}_{row['framework']}_{args.config}_{args.bandwidth:g}mbps" / f"run{r}"
            report = measure(model, spec, row["framework"], out, steps=args.steps, allocator=STEADY_ALLOCATOR)
            row["runs_ms"].append(float(report["median_ms"]))
    for row in ranked:
        row["measured_ms"] = statistics.median(row["runs_ms"])
    fastest = min(ranked, key=lambda r: r["measured_ms"])
    first = ranked[0]
    return {"model": model, "config": args.config, "bandwidth_mbps": args.bandwidth, "options": ranked,
            "ranked_first": first["framework"], "fastest": fastest["framework"],
            "agrees": first["framework"] == fastest["framework"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vgg,transformer,wide_mlp")
    parser.add_argument("--config", default="2x1", help="MACHINESxGPUS of the lab's job")
    parser.add_argument("--bandwidth", type=float, default=400.0, help="Mbps between machines")
    parser.add_argument("--frameworks", default="horovod,ddp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed iterations per real run (after 5 of warm-up)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "advise_lab")
    args = parser.parse_args(argv)
    args.frameworks = args.frameworks.split(",")
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    work = (args.out / "work").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    started = time.time()
    for model in models:
        try:
            result = check_model(model, args, work)
        except LabError as err:
            print(f"{model}: not run: {err}", file=sys.stderr)
            results.append({"model": model, "error": str(err)})
            continue
        results.append(result)
        options = ", ".join(f"{o['framework']} predicted {o['predicted_ms']:.1f} ms measured {o['measured_ms']:.1f} ms "
                            f"(runs {', '.join(f'{x:.1f}' for x in o['runs_ms'])})" for o in result["options"])
        print(f"{model}: advise ranks {result['ranked_first']} first, the lab's fastest is {result['fastest']}: "
              f"{'agrees' if result['agrees'] else 'DISAGREES'} ({options})", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    agreed = sum(1 for r in results if r.get("agrees"))
    lines = ["| model | config | option | predicted ms | gain % | measured ms (median run) | runs ms |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in results:
        for o in r.get("options", []):
            lines.append(f"| {r['model']} | {r['config']} @ {r['bandwidth_mbps']:g} Mbps | {o['framework']} | "
                         f"{o['predicted_ms']:.1f} | {o['gain_pct']:+.1f} | {o['measured_ms']:.1f} | "
                         f"{' '.join(f'{x:.1f}' for x in o['runs_ms'])} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    verdict = "PASS" if agreed >= TARGET_MODELS else "FAIL"
    print(f"advise's first-ranked was the fastest for real on {agreed} of {len(results)} models "
          f"(target: at least {TARGET_MODELS}); {(time.time() - started) / 60:.0f} minutes\n{verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
