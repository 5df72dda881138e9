"""The client matrix: the libraries' own training loops, unmodified, under lmsrt and beside each
library's own memory saver, at GPU caps down to that saver's peak. One command on a GPU machine:

    python benchmarks/clients/matrix.py --out benchmarks/results/clients        # the whole matrix
    python benchmarks/clients/matrix.py --quick --out /tmp/quick                 # 5 rows, minutes
    python benchmarks/clients/matrix.py --clients hf --caps 20 --methods lmsrt,peer
    python benchmarks/clients/matrix.py --clients hf --lmsrt-args="--recompute off"
    python benchmarks/clients/matrix.py --dry-run                                # the runs only

Methods, each run in its own process (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the
environment sets it): ``plain`` (no lmsrt, uncapped), ``peer`` (the library's own saver, e.g.
``gradient_checkpointing=True``; uncapped and at each cap, the script's own --gpu-limit),
``lmsrt`` (``python -m lmsrt run --gpu-limit CAP --stats FILE script``, the defaults) and
``lmsrt+peer`` (both). A peer run at a cap is taken from the uncapped one where that peaked at
under 85% of the cap (the row says "=uncapped"; --full runs it), and lmsrt+peer runs at the caps
below the peer's uncapped peak and at the lowest cap above it, where lmsrt must cost nothing
(--full: at every cap). Caps of lightning and timm are fractions of their plain run's peak.

Per row: the outcome, the settled step (median of the last 10) and its CPU time (all the
process's threads, median of the last 10: near the step's time, the host is the limit), x
uncapped (over plain's settled step), x peer (over the peer's at the same cap), the first-30 cost
(the first 30 steps over 30 settled ones) and 2-31 (the same from step 2: step 1 starts CUDA's
libraries and builds what the script builds lazily, with or without lmsrt), the first 30 steps'
seconds over the peer's first 30 at the same cap (what a user waits for either way: a peer
whose first steps search cuDNN's algorithms pays for them there), the peak
(torch.cuda.max_memory_allocated), and from lmsrt's --stats the bytes moved, rebuilt and
recomputed in the last step, and the optimizer state it kept in host memory ("state GiB").
Writes clients.json and clients.md to --out, and each run's JSON, stats and log under
--out/runs/. A run that fails or times out is recorded and the matrix goes
on.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GiB = 2**30
METHODS = ("plain", "peer", "lmsrt", "lmsrt+peer")
PEER_REUSE = 0.85          # a peer run at a cap is the uncapped one's if it peaked under this x cap
SETTLED_STEPS = 10
FIRST_STEPS = 30


@dataclasses.dataclass(frozen=True)
class Client:
    script: str
    args: Tuple[str, ...]
    peer: Tuple[str, ...]       # the flags that turn the library's own memory saver on
    caps: Tuple[float, ...]     # GiB, or (if every one is < 1) fractions of plain's peak
    what: str
    # Guesses for the estimate, on an H100: one run's start-up, the uncapped step, the peaks of
    # plain and peer uncapped.
    setup_s: float
    step_s: float
    peak_gib: float
    peer_peak_gib: float
    methods: Tuple[str, ...] = METHODS      # run by default (--methods: these for every client)


CLIENTS: Dict[str, Client] = {
    "hf": Client("hf_trainer.py", (), ("--gradient-checkpointing",), (20, 14, 10),
                 "transformers Trainer, Llama 370M, batch 8 x 2048, bf16", 20, 0.20, 31.9, 11.8),
    "gpt2": Client("gpt2_script.py", (), ("--checkpoint",), (18, 14),
                   "GPT-2 medium script, batch 16 x 1024, bf16 autocast", 15, 0.11, 27.5, 15),
    "gpt2c": Client("gpt2_script.py", ("--compile",), ("--checkpoint",), (14,),
                    "the same under torch.compile", 60, 0.09, 25, 14, ("plain", "lmsrt")),
    "tv": Client("tv_reference.py", ("--channels-last",), ("--checkpoint",), (12,),
                 "torchvision reference, resnet152, batch 256, AMP, channels_last", 30, 0.19,
                 22.3, 9, ("plain", "peer", "lmsrt")),
    "lightning": Client("lightning_trainer.py", (), ("--checkpoint",), (0.6, 0.4),
                        "Lightning Trainer, GPT d1024 x 24, batch 8 x 2048, bf16-mixed", 20,
                        0.15, 30, 12),
    "timm": Client("timm_train.py", (), ("--checkpoint",), (0.6, 0.4),
                   "timm ViT-B/16, batch 256, AMP", 20, 0.30, 30, 10),
    # Parameters, gradients and AdamW's state over the cap (issue 49): the peer is FSDP2's CPU
    # offload on one GPU. Run only when named (OPT_IN): its peer's CPU optimizer takes seconds
    # a step.
    "llama": Client("llama_offload.py", (), ("--fsdp2-offload",), (16,),
                    "Llama 1.5B, fp32 weights, AdamW, batch 2 x 1024, bf16 autocast", 40, 0.12,
                    28, 6, ("plain", "peer", "lmsrt")),
}
OPT_IN = ("llama",)     # clients run only when named (--clients)
# --quick: the rows that say most, fast.
QUICK = [("hf", "plain", None), ("hf", "peer", None), ("hf", "lmsrt", 20),
         ("gpt2", "plain", None), ("gpt2", "lmsrt", 14),
         ("tv", "plain", None), ("tv", "lmsrt", 12)]


@dataclasses.dataclass
class Run:
    client: str
    method: str
    cap: Optional[float]               # GiB; None uncapped
    fraction: Optional[float] = None   # the cap as a fraction of plain's peak, until known

    @property
    def name(self) -> str:
        cap = "none" if self.cap is None and self.fraction is None else (
            f"{self.cap:g}" if self.cap is not None else f"{self.fraction:g}x")
        return f"{self.client}-{self.method.replace('+', '_')}-{cap}"


def planned_runs(args) -> List[Run]:
    """The runs in order: per client, the uncapped ones first, then each cap from high to low."""
    if args.quick:
        return [Run(c, m, cap) for c, m, cap in QUICK]
    runs = []
    for name in args.clients.split(","):
        client = CLIENTS[name]
        methods = args.methods.split(",") if args.methods else client.methods
        runs += [Run(name, m, None) for m in ("plain", "peer") if m in methods]
        caps = [float(c) for c in args.caps.split(",")] if args.caps else list(client.caps)
        fractions = all(c < 1 for c in caps)
        for cap in sorted(caps, reverse=True):
            for m in ("peer", "lmsrt", "lmsrt+peer"):
                if m in methods:
                    runs.append(Run(name, m, None, cap) if fractions else Run(name, m, cap))
    return runs


def command(args, run: Run, json_path: str, stats_path: str) -> List[str]:
    client = CLIENTS[run.client]
    script = [os.path.join(HERE, client.script), *client.args, *shlex.split(args.script_args),
              "--steps", str(args.steps), "--json", json_path]
    if "peer" in run.method:
        script += client.peer
    cap = "CAP" if run.cap is None and run.fraction is not None else run.cap
    if run.method.startswith("lmsrt"):
        return [sys.executable, "-m", "lmsrt", "run", "--gpu-limit", str(cap), "--stats",
                stats_path, *shlex.split(args.lmsrt_args), *script]
    return [sys.executable, *script] + ([] if cap is None else ["--gpu-limit", str(cap)])


def estimate_s(args, runs: List[Run]) -> float:
    """Seconds of GPU time, from each client's guesses (lmsrt: 2x the step), without the runs
    that the guessed peaks say would be taken from another."""
    total = 0.0
    for run in runs:
        client = CLIENTS[run.client]
        cap = run.cap if run.fraction is None else run.fraction * client.peak_gib
        if cap is not None and not args.full and not args.quick and taken_elsewhere(
                run, runs, cap, client.peer_peak_gib, lambda r: r.cap if r.fraction is None
                else r.fraction * client.peak_gib):
            continue
        slower = 2.0 if run.method.startswith("lmsrt") else 1.3 if "peer" in run.method else 1.0
        total += client.setup_s + args.steps * client.step_s * slower
    return total


def taken_elsewhere(run: Run, runs: List[Run], cap: float, peer_peak: Optional[float],
                    cap_of=lambda r: r.cap) -> bool:
    """Whether ``run`` at ``cap`` GiB need not run, the peer having peaked at ``peer_peak``
    uncapped: a peer run that peaked under PEER_REUSE x the cap is the uncapped one; lmsrt+peer
    where the peer fits alone runs only at the lowest such cap (where lmsrt must cost nothing)."""
    if peer_peak is None:
        return False
    if run.method == "peer":
        return peer_peak < PEER_REUSE * cap
    if run.method == "lmsrt+peer" and peer_peak < cap:
        caps = [cap_of(r) for r in runs if r.client == run.client and r.method == run.method]
        return any(c is not None and peer_peak < c < cap for c in caps)
    return False


def settled(times: List[float]) -> Optional[float]:
    return statistics.median(times[-SETTLED_STEPS:]) if times else None


def first_cost(times: List[float], skip: int = 0) -> Optional[float]:
    """The first 30 steps together over 30 settled steps (learning and planning included);
    with ``skip`` 1, steps 2-31 (step 1 builds what the script builds lazily and starts CUDA's
    libraries, with or without lmsrt)."""
    step = settled(times)
    first = times[skip:skip + FIRST_STEPS]
    return sum(first) / (len(first) * step) if step and first else None


def lmsrt_figures(stats: dict) -> dict:
    """Per step (the last one): bytes moved, rebuilt and recomputed, optimizer state written
    back to host memory; and the region note."""
    last = stats.get("last_step") or {}
    regions = stats.get("regions") or {}
    return {"moved_gib": last.get("out_bytes", 0) / GiB,
            "state_gib": last.get("optimizer_out_bytes", 0) / GiB,
            "rebuilt_gib": last.get("recipe_bytes", 0) / GiB,
            "recomputed_gib": last.get("recomputed_bytes", 0) / GiB,
            "alloc_retries": last.get("alloc_retries"),
            "alloc_failures": last.get("alloc_failures"),
            "regions_note": regions.get("note"),
            "lmsrt_step_median_s": stats.get("step_time_median_s")}


def execute(args, run: Run) -> dict:
    runs_dir = os.path.join(args.out, "runs")
    base = os.path.join(runs_dir, run.name)
    json_path, stats_path, log_path = base + ".json", base + ".stats.json", base + ".log"
    for path in (json_path, stats_path):
        if os.path.exists(path):
            os.remove(path)
    cmd = command(args, run, json_path, stats_path)
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    row = {"client": run.client, "method": run.method, "cap_gib": run.cap,
           "command": shlex.join(cmd), "log": log_path}
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout)
            row["exit"] = proc.returncode
        except subprocess.TimeoutExpired:
            row["exit"] = None
    row["wall_s"] = round(time.time() - t0, 1)
    data = _read(json_path)
    if data is None:
        row["outcome"] = "timeout" if row["exit"] is None else "crash"
        row["message"] = _last_line(log_path)
    else:
        times = data["step_times_s"]
        row.update(outcome=data["outcome"], message=data["message"], oom_step=data["oom_step"],
                   device=data["device"], torch=data["torch"], steps=data["steps_done"],
                   lmsrt_active=data["lmsrt_active"], versions=data.get("versions"),
                   peak_gib=data["peak_gib"], step_times_s=times, losses=data["losses"],
                   settled_s=settled(times), cpu_s=settled(data.get("step_cpu_s") or []),
                   retries=settled(data.get("step_retries") or []),
                   first30=first_cost(times),
                   after1=first_cost(times, skip=1))
        if row["exit"] not in (0, 3):
            row.update(outcome="crash", message=_last_line(log_path))
    stats = _read(stats_path)
    if stats is not None:
        row.update(lmsrt_figures(stats), lmsrt_version=stats.get("lmsrt_version"))
    return row


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1][:300] if lines else ""


def resolve_caps(rows: List[dict], runs: List[Run], client: str) -> None:
    """Fractions of plain's peak become GiB (one decimal), once plain has run."""
    plain = next((r for r in rows if r["client"] == client and r["method"] == "plain"), None)
    if not plain or plain["outcome"] != "ok":
        return
    for run in runs:
        if run.client == client and run.fraction is not None and run.cap is None:
            run.cap = round(run.fraction * plain["peak_gib"], 1)


def ratios(rows: List[dict]) -> None:
    """x uncapped (over plain's settled step) and x peer (over the peer's at the same cap)."""
    for row in rows:
        plain = next((r for r in rows if r["client"] == row["client"] and r["method"] == "plain"
                      and r.get("settled_s")), None)
        peer = next((r for r in rows if r["client"] == row["client"] and r["method"] == "peer"
                     and r["cap_gib"] == row["cap_gib"] and r.get("settled_s")), None)
        step = row.get("settled_s") if row.get("outcome") == "ok" else None
        row["x_uncapped"] = step / plain["settled_s"] if step and plain else None
        row["x_peer"] = (step / peer["settled_s"] if step and peer and row["method"] != "peer"
                         else None)
        row["first30_x_peer"] = (first_against(row["step_times_s"], peer["step_times_s"])
                                 if step and peer and row["method"] != "peer" else None)


def first_against(times: List[float], peer: List[float]) -> Optional[float]:
    """The first 30 steps' seconds over the peer's first 30 (None where either ran fewer)."""
    if min(len(times), len(peer)) < FIRST_STEPS:
        return None
    return sum(times[:FIRST_STEPS]) / sum(peer[:FIRST_STEPS])


def table(rows: List[dict]) -> str:
    head = ["client", "cap", "method", "outcome", "settled s", "CPU s", "retries", "x uncapped",
            "x peer",
            "first-30", "2-31", "first-30 x peer", "peak GiB", "moved GiB", "rebuilt GiB",
            "recomp. GiB", "state GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ok = r["outcome"] == "ok"
        outcome = r["outcome"] + (f" (step {r['oom_step']})" if r.get("oom_step") else "")
        cells = [r["client"], "-" if r["cap_gib"] is None else f"{r['cap_gib']:g}",
                 r["method"] + (f" {r['reused']}" if r.get("reused") else ""), outcome,
                 _num(r.get("settled_s") if ok else None, 3),
                 _num(r.get("cpu_s") if ok else None, 3),
                 _num(r.get("retries") if ok else None, 1), _num(r.get("x_uncapped"), 2, "x"),
                 _num(r.get("x_peer"), 2, "x"), _num(r.get("first30") if ok else None, 2, "x"),
                 _num(r.get("after1") if ok else None, 2, "x"),
                 _num(r.get("first30_x_peer"), 2, "x"),
                 _num(r.get("peak_gib"), 2), _num(r.get("moved_gib"), 2),
                 _num(r.get("rebuilt_gib"), 2), _num(r.get("recomputed_gib"), 2),
                 _num(r.get("state_gib"), 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rows: List[dict]) -> str:
    """One line per lmsrt row: what lmsrt's regions did, and failures' messages."""
    lines = []
    for r in rows:
        cap = "no cap" if r["cap_gib"] is None else f"{r['cap_gib']:g} GiB"
        where = f"{r['client']} {r['method']} at {cap}"
        if r.get("regions_note"):
            lines.append(f"- {where}: regions: {r['regions_note']}")
        if r["outcome"] != "ok" and r.get("message"):
            lines.append(f"- {where}: {r['outcome']}: {r['message']}")
    return "\n".join(lines)


def _num(x, digits: int, unit: str = "") -> str:
    return "" if x is None else f"{x:.{digits}f}{unit}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=",".join(c for c in CLIENTS if c not in OPT_IN),
                    help=f"{', '.join(CLIENTS)} (default: all but {', '.join(OPT_IN)})")
    ap.add_argument("--caps", help="GiB, comma-separated, for every client chosen (default: each "
                                   "client's own)")
    ap.add_argument("--methods", help=f"of {', '.join(METHODS)} (default: each client's own, "
                                      "all but gpt2c's peer runs and tv's lmsrt+peer)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=420, help="seconds per run")
    ap.add_argument("--out", default="benchmarks/results/clients")
    ap.add_argument("--lmsrt-args", default="", help="more options of lmsrt run, e.g. "
                                                     "--lmsrt-args='--recompute off'")
    ap.add_argument("--script-args", default="", help="more flags of every client script, e.g. "
                                                      "--script-args=--tiny (a CPU try-out)")
    ap.add_argument("--quick", action="store_true", help="only " + ", ".join(
        f"{c} {m}{'' if cap is None else f' at {cap}'}" for c, m, cap in QUICK))
    ap.add_argument("--full", action="store_true",
                    help="every peer and lmsrt+peer run, none taken from another")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and the estimate")
    args = ap.parse_args(argv)
    unknown = set(args.clients.split(",")) - set(CLIENTS)
    unknown |= {m for m in (args.methods or "").split(",") if m and m not in METHODS}
    if unknown:
        ap.error(f"unknown client or method: {', '.join(sorted(unknown))}")
    args.out = os.path.abspath(args.out)
    runs = planned_runs(args)
    unresolved = sorted({r.client for r in runs if r.fraction is not None}
                        - {r.client for r in runs if r.method == "plain"})
    if unresolved and not args.quick:
        ap.error(f"caps under 1 are shares of the plain run's peak, and {', '.join(unresolved)} "
                 "has no plain run: add plain to --methods, or give the caps in GiB")
    print(f"{len(runs)} runs at most; about {estimate_s(args, runs) / 60:.0f} min on an H100, "
          "some peer runs taken from the uncapped one", file=sys.stderr)
    if args.dry_run:
        for k, run in enumerate(runs, 1):
            cmd = command(args, run, f"{run.name}.json", f"{run.name}.stats.json")
            print(f"run {k} of {len(runs)}: {run.name}: {shlex.join(cmd)}")
        return
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    if (any(run.method.startswith("lmsrt") for run in runs)
            and os.environ.get("LMSRT_DEVICE") != "sim"):
        # lmsrt's C++ copy path is built once per torch version (on a GPU, by the first LMS):
        # ahead, not in a timed step. The simulated device does not use it.
        subprocess.run([sys.executable, "-m", "lmsrt", "build"], cwd=ROOT, check=False,
                       timeout=args.timeout)
    rows: List[dict] = []
    for k, run in enumerate(runs, 1):
        if run.fraction is not None and run.cap is None:
            print(f"run {k} of {len(runs)}: {run.name}: skipped, no plain run to take the cap "
                  "from", file=sys.stderr)
            continue
        peer = next((r for r in rows if r["client"] == run.client and r["method"] == "peer"
                     and r["cap_gib"] is None and r["outcome"] == "ok"), None)
        if (not args.full and not args.quick and run.cap is not None and peer
                and taken_elsewhere(run, runs, run.cap, peer["peak_gib"])):
            print(f"run {k} of {len(runs)}: {run.name}: taken from the uncapped peer's peak "
                  f"({peer['peak_gib']:.2f} GiB)", file=sys.stderr)
            if run.method == "peer":
                rows.append(dict(peer, cap_gib=run.cap, reused="=uncapped"))
            continue
        print(f"run {k} of {len(runs)}: {run.client} {run.method} at "
              f"{'no cap' if run.cap is None else f'{run.cap:g} GiB'}", file=sys.stderr,
              flush=True)
        row = execute(args, run)
        rows.append(row)
        if run.method == "plain":
            resolve_caps(rows, runs, run.client)
        shown = f"{row['settled_s']:.3f} s" if row.get("settled_s") else ""
        print(f"  {row['outcome']} {shown} peak {_num(row.get('peak_gib'), 2)} GiB "
              f"({row['wall_s']} s){': ' + row['message'] if row['outcome'] != 'ok' else ''}",
              file=sys.stderr, flush=True)
    ratios(rows)
    text = table(rows)
    first = next((r for r in rows if r.get("device")), {})
    versions = {k: v for r in rows for k, v in (r.get("versions") or {}).items()}
    head = {"gpu": first.get("device"), "torch": first.get("torch"), "versions": versions,
            "lmsrt": next((r["lmsrt_version"] for r in rows if r.get("lmsrt_version")), None),
            "date": datetime.date.today().isoformat(), "steps": args.steps,
            "command": shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}
    print(f"\n{head['gpu']}, torch {head['torch']}, {head['date']}, {args.steps} steps\n")
    print(text)
    print("\n" + notes(rows))
    with open(os.path.join(args.out, "clients.json"), "w") as f:
        json.dump({**head, "rows": rows, "table": text}, f, indent=1)
    with open(os.path.join(args.out, "clients.md"), "w") as f:
        f.write(f"# Client matrix\n\n{head['gpu']}, torch {head['torch']}, {head['date']}; "
                f"`{head['command']}`\n\n" + text + "\n\n" + notes(rows) + "\n")
    print(f"\nwrote {args.out}/clients.json and clients.md")


if __name__ == "__main__":
    main()
