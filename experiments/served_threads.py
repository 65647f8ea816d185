"""Where a served token's CPU goes, thread by thread: CPU time and voluntary / involuntary context switches of every
thread of tritonserver, its python-backend stubs and the OpenAI endpoint (`/proc/<pid>/task/<tid>`), before and after
greedy streamed requests through the OpenAI endpoint (`cache_prompt: false`), divided by the tokens answered.

    make serve &   # the flagship, then:
    PYTHONPATH=. .venv/bin/python experiments/served_threads.py build/qwen_coder.yaml --requests 4 --new 128

Thread names are the OS's (`comm`); py-spy dump names the stub's Python threads (`decode`, `responses`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import psutil

from pipeline import spec as specmod
from pipeline.openai_client import base_url, complete

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime, with tests."


def served_pids() -> list[int]:
    """tritonserver, its children (the stubs) and the OpenAI endpoint."""
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["name"] == "tritonserver":
            out += [p.pid, *(c.pid for c in p.children())]
        elif "pipeline.triton.openai_api" in cmd:
            out.append(p.pid)
    return out


def snapshot(pids: list[int]) -> dict[tuple[int, int], tuple[str, int, int, int]]:
    """(pid, tid) -> (name, CPU ticks, voluntary switches, involuntary switches)."""
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = (task / "status").read_text()
                name = (task / "comm").read_text().strip()
            except OSError:
                continue
            sw = {ln.split(":")[0]: int(ln.split()[1]) for ln in status.splitlines() if "ctxt_switches" in ln}
            out[(pid, int(task.name))] = (name, int(stat[11]) + int(stat[12]), sw["voluntary_ctxt_switches"],
                                          sw["nonvoluntary_ctxt_switches"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--method", default="baseline")
    a = ap.parse_args(argv)
    s = specmod.load(a.spec)
    url, pids = base_url(s), served_pids()
    if not pids:
        raise SystemExit("no tritonserver running: start `make serve` first")
    tick_ms = 1000 / psutil.os.sysconf("SC_CLK_TCK")

    def ask(text: str, n: int) -> dict:
        return complete(url, s.name, messages=[{"role": "user", "content": text}], max_tokens=n, method=a.method,
                        temperature=0.0, extra={"cache_prompt": False})

    ask(PROMPT, 16)  # warm
    before, tokens = snapshot(pids), 0
    for i in range(a.requests):
        tokens += ask(f"{PROMPT} Variant {i}.", a.new)["usage"]["completion_tokens"]
    after = snapshot(pids)
    print(f"{a.requests} requests, {tokens} tokens; per token: CPU ms, voluntary, involuntary switches")
    rows = []
    for key, (name, cpu, vol, inv) in after.items():
        _, cpu0, vol0, inv0 = before.get(key, (name, 0, 0, 0))
        if (cpu - cpu0, vol - vol0, inv - inv0) != (0, 0, 0):
            rows.append((key, name, (cpu - cpu0) * tick_ms / tokens, (vol - vol0) / tokens, (inv - inv0) / tokens))
    for (pid, tid), name, cpu, vol, inv in sorted(rows, key=lambda r: -r[2])[:16]:
        print(f"{pid:>7} {tid:>7} {name:16} {cpu:7.2f} {vol:6.1f} {inv:6.2f}")


if __name__ == "__main__":
    main()
