#!/usr/bin/env python3
"""Our whole step through the actors vs vLLM's per-step allocation loop, interleaved.

Starts `vllm_alloc.py` (vLLM's `KVCacheManager`, imported from vLLM's own install) and
`examples/step_bench.rs` (our engine loop's `commit_and_step`) once each, in `--serve`
mode. Then, for R rounds: both sides build a fresh state (untimed: 256 decoding
requests), and K timed steps of each side are run in alternating chunks of C steps
(vLLM C steps, ours C steps, vLLM C steps, ...; which side goes first alternates by
round), so that a change in the host's speed or load hits both sides of a round alike.
The state is rebuilt (untimed) every 100 steps on both sides. C defaults to 100, one
chunk per side and round: each side then steps back to back as an engine loop does.
Smaller chunks pair the two sides closer in time but measure cold steps: after the
other side's chunk, the first steps of a chunk run with cold caches and parked threads
(ours took ~500 µs for the first step after a 10-step vLLM chunk, ~180 µs from the
fifth on; vLLM's first step ~30 % above its others). Prints and saves each
round's medians and the ratio vLLM step / our step. Standard library only; Linux
(/proc/stat for the load other processes put on the host meanwhile).

    python3 benches/vllm_step/run.py --rounds 30 --steps 100 \\
        --vllm-python /work/vllm-venv/bin/python \\
        --out benches/results/2026-12-03-vllm-step

Setup of the vLLM side: `python3 -m venv /work/vllm-venv &&
/work/vllm-venv/bin/pip install vllm==0.33.0` (see the results' README).

`--ours-before PATH` adds a third side, another `step_bench` binary (a build of an
earlier commit), stepped in the same rounds: before and after a change, each against
vLLM and against each other, in one run (the rounds go through every order of the
three, so each side follows each other side equally often).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ROOT / "target" / "release" / "examples" / "step_bench"
VLLM_SCRIPT = ROOT / "benches" / "vllm_step" / "vllm_alloc.py"
REBUILD = 100  # as in both programs: sequences stay within 1,000-3,200 tokens
OUR_INTERVALS = ("to_coordinator", "commit", "schedule", "enqueue", "to_device", "device",
                 "from_device", "overlapped", "finish", "to_caller")


def sh(cmd: str) -> str:
    try:
        return subprocess.run(
            cmd, shell=True, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError as e:
        return f"({e})"


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = v
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def proc_jiffies(pid: int) -> int:
    """utime + stime of process `pid` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class Side:
    """One side's process in `--serve` mode: a request line in, a JSON line out."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.p = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if not self._read().get("ready"):
            sys.exit(f"{shlex.join(cmd)}: no ready line")

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            sys.exit(f"{shlex.join(self.cmd)} exited ({self.p.wait()})")
        return json.loads(line)

    def ask(self, request: str) -> dict:
        self.p.stdin.write(request + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        if self.p.wait() != 0:
            sys.exit(f"{shlex.join(self.cmd)} failed ({self.p.returncode})")


def environment(vllm_python: str) -> dict:
    cpu = sh("lscpu | sed -n 's/^Model name:[[:space:]]*//p'")
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": sh("nproc"),
        "cpu_model": cpu,
        "kernel": platform.release(),
        "git_commit": sh(f"git -C {shlex.quote(str(ROOT))} rev-parse HEAD"),
        "git_dirty": bool(
            sh(f"git -C {shlex.quote(str(ROOT))} status --porcelain --untracked-files=no")
        ),
        "rustc": sh("rustc --version"),
        "vllm_python": sh(f"{shlex.quote(vllm_python)} --version"),
        "pip_freeze_vllm_torch": sh(
            f"{shlex.quote(vllm_python)} -m pip freeze | grep -E 'vllm|torch'"
        ).splitlines(),
    }


def median_us(ns: list[int]) -> float:
    return statistics.median_low(ns) / 1e3


def run_round(sides: dict[str, Side], order: tuple[str, str], steps: int, chunk: int) -> dict:
    """One round: both sides build, then `steps` steps each in alternating chunks."""
    got = {s: {"step_ns": [], "parts": []} for s in sides}
    pids = [side.p.pid for side in sides.values()]
    other_busy = other_total = 0
    done = 0
    while done < steps:
        if done % REBUILD == 0:
            for s in order:
                assert sides[s].ask("build").get("built")
        n = min(chunk, steps - done, REBUILD - done % REBUILD)
        b0, t0 = cpu_jiffies()
        p0 = sum(map(proc_jiffies, pids))
        for s in order:
            out = sides[s].ask(f"steps {n}")
            got[s]["step_ns"] += out["step_ns"]
            if s == "vllm":
                got[s]["parts"] += [dict(zip(out["part_ns"], v))
                                    for v in zip(*out["part_ns"].values())]
            else:
                got[s]["parts"] += out["timing_ns"]
        b1, t1 = cpu_jiffies()
        p1 = sum(map(proc_jiffies, pids))
        other_busy += (b1 - b0) - (p1 - p0)
        other_total += t1 - t0
        done += n
    v, o = got["vllm"], got["ours"]
    ncpu = os.cpu_count() or 1
    before = {}
    if "before" in got:
        b = got["before"]
        before = {
            "before_median_us": median_us(b["step_ns"]),
            "before_mean_us": statistics.fmean(b["step_ns"]) / 1e3,
            "ratio_vllm_over_before": median_us(v["step_ns"]) / median_us(b["step_ns"]),
            "ratio_ours_over_before": median_us(o["step_ns"]) / median_us(b["step_ns"]),
            "before_interval_medians_us": {
                k: median_us([p[k] for p in b["parts"]]) for k in OUR_INTERVALS
            },
            "before_step_ns": b["step_ns"],
        }
    return {
        **before,
        "first": order[0],
        "vllm_median_us": median_us(v["step_ns"]),
        "vllm_mean_us": statistics.fmean(v["step_ns"]) / 1e3,
        "ours_median_us": median_us(o["step_ns"]),
        "ours_mean_us": statistics.fmean(o["step_ns"]) / 1e3,
        "ratio_of_medians": median_us(v["step_ns"]) / median_us(o["step_ns"]),
        # CPUs that every other process of the host kept busy during the timed chunks
        # (0 on a quiet host; this machine is shared).
        "other_cpus": other_busy / max(1, other_total / ncpu),
        "vllm_part_medians_us": {
            k: median_us([p[k] for p in v["parts"]]) for k in ("allocate", "block_ids", "update")
        },
        "ours_interval_medians_us": {
            k: median_us([p[k] for p in o["parts"]]) for k in OUR_INTERVALS
        },
        "vllm_step_ns": v["step_ns"],
        "ours_step_ns": o["step_ns"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per side per round")
    ap.add_argument("--chunk", type=int, default=100,
                    help="steps a side runs before the other side runs as many")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                    help="the Python of the venv that has vllm==0.33.0")
    ap.add_argument("--ours-idle-spin-us", type=int, default=0,
                    help="our runtime's idle_spin (µs; default 0: off, as an engine starts)")
    ap.add_argument("--no-build", action="store_true",
                    help="use target/release/examples/step_bench as it is")
    ap.add_argument("--quiet", type=float, default=0.2,
                    help="a round is quiet when other processes kept fewer CPUs busy")
    ap.add_argument("--out", type=Path, help="folder for results.json, summary.txt, env.txt")
    ap.add_argument("--ours-before", type=Path,
                    help="a step_bench binary of an earlier commit: a third side, same rounds")
    args = ap.parse_args()

    if not args.no_build:
        subprocess.run(
            ["cargo", "build", "--release", "--example", "step_bench"],
            cwd=ROOT, check=True, env={**os.environ, "CARGO_INCREMENTAL": "0"},
        )
    ours_cmd = [str(OURS), "--serve", "--idle-spin-us", str(args.ours_idle_spin_us)]
    vllm_cmd = [args.vllm_python, str(VLLM_SCRIPT), "--serve"]
    env = environment(args.vllm_python)
    sides = {"vllm": Side(vllm_cmd), "ours": Side(ours_cmd)}
    before_cmd = None
    if args.ours_before:
        before_cmd = [str(args.ours_before), "--serve", "--idle-spin-us",
                      str(args.ours_idle_spin_us)]
        sides["before"] = Side(before_cmd)

    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"{args.rounds} rounds x {args.steps} steps per side, alternating chunks of "
        f"{args.chunk} steps; {env['nproc']} CPUs ({env['cpu_model']})")
    say(f"{'round':>5} {'first':>5} {'vLLM median µs':>15} {'ours median µs':>15} {'ratio':>7} "
        f"{'vLLM mean µs':>13} {'ours mean µs':>13} {'other CPUs busy':>16}")
    rounds = []
    names = list(sides)
    for i in range(args.rounds):
        if len(names) == 2:
            order = ("vllm", "ours") if i % 2 == 0 else ("ours", "vllm")
        else:
            # Every order of the three in turn: each side follows every other side
            # (a side run right after vLLM's big process starts with cold caches).
            order = list(itertools.permutations(names))[i % 6]
        r = {"round": i, **run_round(sides, order, args.steps, args.chunk)}
        rounds.append(r)
        extra = ""
        if "before_median_us" in r:
            extra = (f"  before {r['before_median_us']:.1f} µs, "
                     f"ours/before {r['ratio_ours_over_before']:.2f}")
        say(f"{i:>5} {r['first']:>5} {r['vllm_median_us']:>15.1f} {r['ours_median_us']:>15.1f} "
            f"{r['ratio_of_medians']:>6.1f}x {r['vllm_mean_us']:>13.1f} "
            f"{r['ours_mean_us']:>13.1f} {r['other_cpus']:>16.2f}{extra}")
    for side in sides.values():
        side.close()

    med = statistics.median
    all_v = [x for r in rounds for x in r["vllm_step_ns"]]
    all_o = [x for r in rounds for x in r["ours_step_ns"]]
    quiet = [r for r in rounds if r["other_cpus"] < args.quiet]
    summary = {
        "median_of_round_medians_vllm_us": med(r["vllm_median_us"] for r in rounds),
        "median_of_round_medians_ours_us": med(r["ours_median_us"] for r in rounds),
        "median_of_round_ratios": med(r["ratio_of_medians"] for r in rounds),
        "min_round_ratio": min(r["ratio_of_medians"] for r in rounds),
        "max_round_ratio": max(r["ratio_of_medians"] for r in rounds),
        "pooled_median_vllm_us": median_us(all_v),
        "pooled_median_ours_us": median_us(all_o),
        "pooled_mean_vllm_us": statistics.fmean(all_v) / 1e3,
        "pooled_mean_ours_us": statistics.fmean(all_o) / 1e3,
        "quiet_threshold_other_cpus": args.quiet,
        "quiet_rounds": len(quiet),
    }
    summary["ratio_of_pooled_medians"] = (
        summary["pooled_median_vllm_us"] / summary["pooled_median_ours_us"]
    )
    summary["ratio_of_pooled_means"] = (
        summary["pooled_mean_vllm_us"] / summary["pooled_mean_ours_us"]
    )
    if quiet:
        summary["quiet_median_of_round_medians_vllm_us"] = med(r["vllm_median_us"] for r in quiet)
        summary["quiet_median_of_round_medians_ours_us"] = med(r["ours_median_us"] for r in quiet)
        summary["quiet_median_of_round_ratios"] = med(r["ratio_of_medians"] for r in quiet)
    if before_cmd:
        all_b = [x for r in rounds for x in r["before_step_ns"]]
        summary["median_of_round_medians_before_us"] = med(r["before_median_us"] for r in rounds)
        summary["median_of_round_ratios_vllm_over_before"] = med(
            r["ratio_vllm_over_before"] for r in rounds)
        summary["median_of_round_ratios_ours_over_before"] = med(
            r["ratio_ours_over_before"] for r in rounds)
        summary["pooled_median_before_us"] = median_us(all_b)
    parts = {k: med(r["vllm_part_medians_us"][k] for r in rounds)
             for k in rounds[0]["vllm_part_medians_us"]}
    intervals = {k: med(r["ours_interval_medians_us"][k] for r in rounds) for k in OUR_INTERVALS}

    say("")
    say(f"median of the round medians: vLLM {summary['median_of_round_medians_vllm_us']:.1f} µs, "
        f"ours {summary['median_of_round_medians_ours_us']:.1f} µs; "
        f"median of the round ratios {summary['median_of_round_ratios']:.1f}x "
        f"(rounds {summary['min_round_ratio']:.1f}-{summary['max_round_ratio']:.1f}x)")
    say(f"all {len(all_v)} steps per side pooled: medians {summary['pooled_median_vllm_us']:.1f} / "
        f"{summary['pooled_median_ours_us']:.1f} µs = {summary['ratio_of_pooled_medians']:.1f}x; "
        f"means {summary['pooled_mean_vllm_us']:.1f} / {summary['pooled_mean_ours_us']:.1f} µs "
        f"= {summary['ratio_of_pooled_means']:.1f}x")
    if quiet:
        say(f"{len(quiet)} quiet rounds (other processes below {args.quiet} CPU): "
            f"vLLM {summary['quiet_median_of_round_medians_vllm_us']:.1f} µs, ours "
            f"{summary['quiet_median_of_round_medians_ours_us']:.1f} µs, median ratio "
            f"{summary['quiet_median_of_round_ratios']:.1f}x")
    else:
        say(f"no quiet round (other processes below {args.quiet} CPU)")
    if before_cmd:
        say(f"before (same rounds): median of the round medians "
            f"{summary['median_of_round_medians_before_us']:.1f} µs; vLLM/before "
            f"{summary['median_of_round_ratios_vllm_over_before']:.1f}x; ours/before "
            f"{summary['median_of_round_ratios_ours_over_before']:.2f} (median of the rounds' "
            f"ratios); pooled medians ours {summary['pooled_median_ours_us']:.1f} / before "
            f"{summary['pooled_median_before_us']:.1f} µs")
    say("vLLM step parts (medians of round medians, µs): "
        + ", ".join(f"{k} {x:.1f}" for k, x in parts.items()))
    say("our step's intervals (medians of round medians, µs): "
        + ", ".join(f"{k} {x:.1f}" for k, x in intervals.items()))

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "command": shlex.join(["python3", *sys.argv]),
            "vllm_command": shlex.join(vllm_cmd),
            "ours_command": shlex.join(ours_cmd),
            "before_command": shlex.join(before_cmd) if before_cmd else None,
            "environment": env,
            "summary": summary,
            "vllm_part_medians_us": parts,
            "ours_interval_medians_us": intervals,
            "rounds": rounds,
        }
        (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
        env_lines = [f"{k}: {v}" for k, v in env.items() if not isinstance(v, list)]
        env_lines += ["pip freeze | grep -E 'vllm|torch':"] + env["pip_freeze_vllm_torch"]
        (args.out / "env.txt").write_text("\n".join(env_lines) + "\n")
        print(f"saved results.json, summary.txt and env.txt in {args.out}")


if __name__ == "__main__":
    main()
