#!/usr/bin/env python3
"""Our whole step through the actors vs vLLM's per-step allocation loop, interleaved.

Starts `vllm_alloc.py` (vLLM's `KVCacheManager`, from vLLM's own install) and
`examples/step_bench.rs` (our engine loop's `commit_and_step`) once each, in `--serve`
mode, then for R rounds asks each for K timed steps from a fresh state, one side right
after the other (the order alternates by round), so that a change in the host's load
hits both sides of a round alike. Prints and saves each round's medians and the ratio
vLLM step / our step. Standard library only.

    python3 benches/vllm_step/run.py --rounds 10 --steps 100 \
        --vllm-python /work/vllm-venv/bin/python \
        --out benches/results/2026-12-03-vllm-step

Setup of the vLLM side: `python3 -m venv /work/vllm-venv &&
/work/vllm-venv/bin/pip install vllm==0.33.0` (see the results' README).
"""

from __future__ import annotations

import argparse
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


def sh(cmd: str) -> str:
    try:
        return subprocess.run(
            cmd, shell=True, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError as e:
        return f"({e})"


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat (Linux)."""
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
    """One side's process in `--serve` mode: a line in, one round's JSON line out."""

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

    def round(self) -> dict:
        """One round, with `other_cpus`: the CPUs that every other process of the host
        kept busy meanwhile (0 on a quiet host; this machine is shared)."""
        b0, t0 = cpu_jiffies()
        p0 = proc_jiffies(self.p.pid)
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        out = self._read()
        b1, t1 = cpu_jiffies()
        p1 = proc_jiffies(self.p.pid)
        ncpu = os.cpu_count() or 1
        out["other_cpus"] = ((b1 - b0) - (p1 - p0)) / max(1, (t1 - t0) / ncpu)
        return out

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
        "git_dirty": bool(sh(f"git -C {shlex.quote(str(ROOT))} status --porcelain")),
        "rustc": sh("rustc --version"),
        "vllm_python": sh(f"{shlex.quote(vllm_python)} --version"),
        "pip_freeze_vllm_torch": sh(
            f"{shlex.quote(vllm_python)} -m pip freeze | grep -E 'vllm|torch'"
        ).splitlines(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per side per round")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                    help="the Python of the venv that has vllm==0.33.0")
    ap.add_argument("--no-build", action="store_true",
                    help="use target/release/examples/step_bench as it is")
    ap.add_argument("--quiet", type=float, default=0.2,
                    help="a round is quiet when other processes kept fewer CPUs busy")
    ap.add_argument("--out", type=Path, help="folder for results.json and summary.txt")
    args = ap.parse_args()

    if not args.no_build:
        subprocess.run(
            ["cargo", "build", "--release", "--example", "step_bench"],
            cwd=ROOT, check=True, env={**os.environ, "CARGO_INCREMENTAL": "0"},
        )
    ours_cmd = [str(OURS), "--steps", str(args.steps), "--rounds", "1", "--serve"]
    vllm_cmd = [args.vllm_python, str(VLLM_SCRIPT), "--steps", str(args.steps), "--rounds", "1",
                "--serve"]
    env = environment(args.vllm_python)
    sides = {"vllm": Side(vllm_cmd), "ours": Side(ours_cmd)}

    rounds = []
    lines = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"{args.rounds} rounds x {args.steps} steps per side, interleaved; "
        f"{env['nproc']} CPUs ({env['cpu_model']})")
    say(f"{'round':>5} {'first':>6} {'vLLM median µs':>15} {'ours median µs':>15} "
        f"{'ratio':>7} {'vLLM mean µs':>13} {'ours mean µs':>13} {'other CPUs busy (vLLM, ours)'}")
    for i in range(args.rounds):
        order = ("vllm", "ours") if i % 2 == 0 else ("ours", "vllm")
        got = {}
        for side in order:
            got[side] = sides[side].round()
        v, o = got["vllm"], got["ours"]
        rnd = {
            "round": i,
            "first": order[0],
            "vllm_median_us": v["median_us"],
            "vllm_mean_us": v["mean_us"],
            "vllm_part_medians_us": v["rounds"][0]["part_medians_us"],
            "ours_median_us": o["median_us"],
            "ours_mean_us": o["mean_us"],
            "ours_timing_medians_us": o["rounds"][0]["timing_medians_us"],
            "ratio_of_medians": v["median_us"] / o["median_us"],
            "other_cpus": {"vllm": v["other_cpus"], "ours": o["other_cpus"]},
            "vllm_step_ns": v["rounds"][0]["step_ns"],
            "ours_step_ns": o["rounds"][0]["step_ns"],
        }
        rounds.append(rnd)
        say(f"{i:>5} {order[0]:>6} {v['median_us']:>15.1f} {o['median_us']:>15.1f} "
            f"{rnd['ratio_of_medians']:>6.1f}x {v['mean_us']:>13.1f} {o['mean_us']:>13.1f} "
            f"{v['other_cpus']:>5.2f} {o['other_cpus']:>5.2f}")

    for side in sides.values():
        side.close()
    med = statistics.median
    all_v = [x for r in rounds for x in r["vllm_step_ns"]]
    all_o = [x for r in rounds for x in r["ours_step_ns"]]
    summary = {
        "median_of_round_medians_vllm_us": med(r["vllm_median_us"] for r in rounds),
        "median_of_round_medians_ours_us": med(r["ours_median_us"] for r in rounds),
        "median_of_round_ratios": med(r["ratio_of_medians"] for r in rounds),
        "min_round_ratio": min(r["ratio_of_medians"] for r in rounds),
        "max_round_ratio": max(r["ratio_of_medians"] for r in rounds),
        "pooled_median_vllm_us": med(all_v) / 1e3,
        "pooled_median_ours_us": med(all_o) / 1e3,
        "pooled_mean_vllm_us": statistics.fmean(all_v) / 1e3,
        "pooled_mean_ours_us": statistics.fmean(all_o) / 1e3,
    }
    summary["ratio_of_pooled_medians"] = (
        summary["pooled_median_vllm_us"] / summary["pooled_median_ours_us"]
    )
    summary["ratio_of_pooled_means"] = (
        summary["pooled_mean_vllm_us"] / summary["pooled_mean_ours_us"]
    )
    quiet = [r for r in rounds if max(r["other_cpus"].values()) < args.quiet]
    if quiet:
        summary["quiet_threshold_other_cpus"] = args.quiet
        summary["quiet_rounds"] = len(quiet)
        summary["quiet_median_of_round_medians_vllm_us"] = med(r["vllm_median_us"] for r in quiet)
        summary["quiet_median_of_round_medians_ours_us"] = med(r["ours_median_us"] for r in quiet)
        summary["quiet_median_of_round_ratios"] = med(r["ratio_of_medians"] for r in quiet)
    parts = {
        k: med(r["vllm_part_medians_us"][k] for r in rounds)
        for k in rounds[0]["vllm_part_medians_us"]
    }
    timing = {
        k: med(r["ours_timing_medians_us"][k] for r in rounds)
        for k in rounds[0]["ours_timing_medians_us"]
    }
    say("")
    say(f"median of the round medians: vLLM {summary['median_of_round_medians_vllm_us']:.1f} µs, "
        f"ours {summary['median_of_round_medians_ours_us']:.1f} µs; "
        f"ratio median {summary['median_of_round_ratios']:.1f}x "
        f"(rounds {summary['min_round_ratio']:.1f}-{summary['max_round_ratio']:.1f}x)")
    say(f"all {len(all_v)} steps per side pooled: medians {summary['pooled_median_vllm_us']:.1f} / "
        f"{summary['pooled_median_ours_us']:.1f} µs = {summary['ratio_of_pooled_medians']:.1f}x; "
        f"means {summary['pooled_mean_vllm_us']:.1f} / {summary['pooled_mean_ours_us']:.1f} µs "
        f"= {summary['ratio_of_pooled_means']:.1f}x")
    if quiet:
        say(f"{len(quiet)} quiet rounds (other processes below {args.quiet} CPU on both sides): "
            f"vLLM {summary['quiet_median_of_round_medians_vllm_us']:.1f} µs, ours "
            f"{summary['quiet_median_of_round_medians_ours_us']:.1f} µs, ratio median "
            f"{summary['quiet_median_of_round_ratios']:.1f}x")
    else:
        say(f"no quiet round (other processes below {args.quiet} CPU on both sides)")
    say("vLLM step parts (medians of round medians, µs): "
        + ", ".join(f"{k} {x:.1f}" for k, x in parts.items()))
    say("our step's intervals (medians of round medians, µs): "
        + ", ".join(f"{k} {x:.1f}" for k, x in timing.items()))

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "vllm_command": shlex.join(vllm_cmd),
            "ours_command": shlex.join(ours_cmd),
            "environment": env,
            "summary": summary,
            "vllm_part_medians_us": parts,
            "ours_timing_medians_us": timing,
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
