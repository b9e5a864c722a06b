"""A normal request's latency while hostile requests are in flight, as a ratio to its idle latency
(issue 39's floor: <= 2x).

Starts `servescope serve` (the embedded model unless --model; the default limits, a key from a
file) in its own process. A normal request is a chat completion of a short question, greedy,
--max-tokens tokens. Rounds interleave two modes (the machine may be shared and noisy):
  idle     the normal requests alone, one after another;
  hostile  the same, while a separate process sends the hostile catalogue of the test suite
           (tests/server/hostile_cases.py: auth on every route, Host, bodies, types, surrogates,
           grammar caps and combinations, stop caps, overlong prompts, control tokens in content,
           path tricks, seeded mutations) from --hostile-clients threads without pause, and holds
           --slow-clients connections trickling headers. That process runs at nice 19 by default
           (--attacker-nice): on a small machine the attacker's own CPU would otherwise be taken
           from the engine, which a remote attacker's is not. The catalogue's one valid prompt at the
           context limit is left out unless --with-long-prompt: it is no attack, only long work, and
           what it costs a short request beside it is the scheduler's (see docs/BENCHMARKS.md).
Reports the median latency of each mode, their ratio, and what the hostile clients got (status
counts; a 5xx or a transport error is listed).

    python benchmarks/hostile_latency.py --rounds 3 --json benchmarks/results/hostile_latency.json
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-hostile-bench"


def _start_server(a, key_file: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "servescope.cli", "serve", "--port", str(a.port), "--api-key-file", key_file]
    if a.model:
        cmd += ["--model", a.model]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def _normal(client: httpx.Client, i: int, max_tokens: int) -> float:
    body = {
        "messages": [{"role": "user", "content": f"Question {i}: what is the capital of France?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    dt = time.perf_counter() - t0
    if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != max_tokens:
        raise SystemExit(f"a normal request failed: {r.status_code} {r.text[:300]}")
    return dt


def _hostile_worker(url: str, clients: int, slow: int, nice: int, long_prompt: bool, stop, counts) -> None:
    """Runs in its own process: the catalogue in a loop from `clients` threads, `slow` slowloris sockets."""
    os.nice(nice)  # the attacker's own CPU is not the server's: on a 2-core machine it would be the engine's
    import threading  # noqa: PLC0415 - the child process's own imports

    sys.path.insert(0, str(ROOT / "tests" / "server"))
    import hostile_cases  # noqa: PLC0415 - test data, shared with the suite

    from servescope.server.limits import ServerLimits  # noqa: PLC0415

    routes = [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/embeddings"),
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("GET", "/dashboard"),
        ("GET", "/v1/internals"),
    ]
    cases = hostile_cases.catalogue(routes, ServerLimits(), 8192 * 2 * 81, 8192)
    if not long_prompt:  # a valid request at the context limit: expensive, but no attack
        cases = [c for c in cases if c.name != "prompt near context"]
    host, port = url.split("//")[1].split(":")

    def loop(offset: int):
        with httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {KEY}"}) as c:
            i = offset
            while not stop.is_set():
                case = cases[i % len(cases)]
                i += clients
                hdrs = dict(case.headers)
                if not case.auth:
                    hdrs["authorization"] = hdrs.get("authorization", "")
                try:
                    status = c.request(case.method, case.path, content=case.body, headers=hdrs).status_code
                except httpx.HTTPError as e:
                    status = f"transport {type(e).__name__}"
                counts.append(str(status))

    def slowloris():
        while not stop.is_set():
            try:
                s = socket.create_connection((host, int(port)))
                s.sendall(b"GET /health HTTP/1.1\r\n")  # and nothing more: the header deadline ends it
                s.recv(4096)
                s.close()
            except OSError:
                time.sleep(0.1)

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(clients)]
    threads += [threading.Thread(target=slowloris, daemon=True) for _ in range(slow)]
    for t in threads:
        t.start()
    stop.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8, help="normal requests per mode and round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hostile-clients", type=int, default=4)
    p.add_argument("--slow-clients", type=int, default=8)
    p.add_argument(
        "--attacker-nice",
        type=int,
        default=19,
        help="niceness of the hostile process (0: it competes with the server for the cores)",
    )
    p.add_argument(
        "--with-long-prompt",
        action="store_true",
        help="keep the catalogue's one valid prompt at the context limit (its prefill is long)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            a.port = s.getsockname()[1]
    url = f"http://127.0.0.1:{a.port}"
    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write(KEY + "\n")
    proc = _start_server(a, f.name)
    lat = {"idle": [], "hostile": []}
    manager = multiprocessing.Manager()
    counts = manager.list()
    try:
        _wait_healthy(url, proc)
        with httpx.Client(base_url=url, timeout=300, headers={"authorization": f"Bearer {KEY}"}) as c:
            for i in range(3):
                _normal(c, -1 - i, a.max_tokens)  # warm-up
            n = 0
            for _ in range(a.rounds):
                for mode in ("idle", "hostile"):
                    stop, worker = manager.Event(), None
                    if mode == "hostile":
                        worker = multiprocessing.Process(
                            target=_hostile_worker,
                            args=(
                                url,
                                a.hostile_clients,
                                a.slow_clients,
                                a.attacker_nice,
                                a.with_long_prompt,
                                stop,
                                counts,
                            ),
                        )
                        worker.start()
                        time.sleep(3.0)  # the hostile load is running before the first normal request
                    for _ in range(a.requests):
                        lat[mode].append(_normal(c, n, a.max_tokens))
                        n += 1
                    if worker is not None:
                        stop.set()
                        worker.join(30)
                        if worker.is_alive():
                            worker.terminate()
    finally:
        proc.terminate()
        proc.wait(30)
        os.unlink(f.name)
    statuses = collections.Counter(counts)
    idle, hostile = statistics.median(lat["idle"]), statistics.median(lat["hostile"])
    bad = {s: k for s, k in statuses.items() if not s.isdigit() or int(s) >= 500}
    result = {
        "idle_median_s": round(idle, 4),
        "hostile_median_s": round(hostile, 4),
        "ratio": round(hostile / idle, 3),
        "hostile_requests": sum(statuses.values()),
        "hostile_statuses": dict(sorted(statuses.items())),
        "hostile_5xx_or_transport_errors": bad,
        "latencies": {k: [round(x, 4) for x in v] for k, v in lat.items()},
        "args": vars(a),
        "machine": platform.processor() or platform.machine(),
        "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "latencies"}, indent=1))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
