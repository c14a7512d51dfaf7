"""The benchmark tools in bench/ still run: the load generators (Python and wrk) against the bare
app on the Procfile's server stack, the statistics behind the table, bench/gpu.sh's reduced
CPU mode end to end, and the CPU step's tools on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402
import spawned  # noqa: E402
from figures import Figure, interleaved, percentile, spread, table, write_section  # noqa: E402
from harness import Bench, Reading, Scenario, perform  # noqa: E402
from spawned import BenchError, Cluster  # noqa: E402


def test_a_figure_is_judged_on_the_median_of_its_run_by_run_ratios_or_in_every_run() -> None:
    fig = Figure("1", "throughput", "req/s", [80, 90, 200], [100, 100, 100], (">= 0.8x", lambda r: r >= 0.8))
    assert fig.ratios == [0.8, 0.9, 2.0] and fig.met() is True
    fig.values = [70, 75, 200]
    assert fig.met() is False
    assert Figure("2", "overhead", "ms", values=[12.0], target=("<= 10", lambda v: v <= 10)).met() is False
    assert Figure("5", "info", "x", values=[1.0]).met() is None
    every = Figure("9", "p95", "ms", [10, 20, 60], [100, 100, 100], ("<= 0.5x in every run", lambda r: r <= 0.5))
    assert every.met() is True  # the median ratio, 0.2
    every.every = True
    assert every.met() is False
    every.values[2] = 50
    assert every.met() is True


def test_table_shows_median_and_range_and_flags_a_missed_target() -> None:
    figs = [Figure("1", "rps", "req/s", [80, 90, 200], [100, 100, 100], (">= 0.95x", lambda r: r >= 0.95))]
    text = table(figs, markdown=False)
    assert "90 [80–200]" in text and "0.90 [0.80–2.00]x" in text and "NO" in text
    md = table(figs, markdown=True)
    assert md.splitlines()[0].startswith("| # | figure |") and md.count("\n") == 2
    assert spread([3.0], 1) == "3.0"
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2], 99) == pytest.approx(1.99)
    assert list(interleaved(2, "a", "b")) == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]


def test_a_scenario_measures_one_side_at_a_time_into_its_columns() -> None:
    calls: list[tuple[str, int]] = []

    def measure(side: str, round_: int) -> list[Reading]:
        calls.append((side, round_))
        return [100.0 * round_ + (1 if side == "new" else 0), None if side == "base" else 7.0]

    def two_parts(b: Bench) -> None:
        pair = [b.figure("rate", "req/s"), b.figure("only the subject's", "x")]
        b.compare(pair, measure, sides=("base", "new"))
        # A later comparison may use what an earlier one measured.
        b.compare([b.figure(f"after {len(pair[0].values)} runs", "ms")], lambda side, r: [(10.0 + r, 5.0)])
        if b.size("fail"):
            b.compare([b.figure("x", "ms")], lambda side, r: [])

    with Cluster() as cluster:
        b = Bench(quick=False, cluster=cluster, model_dir=cluster.tmp, batch=8)
        b.quick = True  # rounds: 1 in the quick plan, 3 in the full one
        perform(b, Scenario("9", "a test", two_parts, {"fail": (False, True)}, stack=False))
        assert calls == [("base", 0), ("new", 0)]
        b.quick, calls[:] = False, []
        b.figures.clear()
        with pytest.raises(BenchError, match="0 readings for 1 figures"):
            perform(b, Scenario("9", "a test", two_parts, {"fail": (False, True)}, stack=False))
        assert calls == [("base", 0), ("new", 0), ("new", 1), ("base", 1), ("base", 2), ("new", 2)]  # A B, B A
        rate, subject_only, after, _ = b.figures
        assert (rate.values, rate.baseline) == ([1.0, 101.0, 201.0], [0.0, 100.0, 200.0])
        assert (subject_only.values, subject_only.baseline) == ([7.0] * 3, [])
        assert after.name == "after 3 runs" and (after.values, after.baseline) == ([10.0, 11.0, 12.0], [5.0] * 3)


def test_write_section_replaces_its_own_block_and_keeps_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    write_section(doc, "<!-- a:begin -->", "<!-- a:end -->", "first")
    assert doc.read_text() == "# Benchmarks\n\n<!-- a:begin -->\n\nfirst\n\n<!-- a:end -->\n"
    doc.write_text("intro\n\n" + doc.read_text() + "\nnotes by hand\n")
    write_section(doc, "<!-- b:begin -->", "<!-- b:end -->", "other")
    write_section(doc, "<!-- a:begin -->", "<!-- a:end -->", "second")
    text = doc.read_text()
    assert "first" not in text and text.count("second") == 1 and "notes by hand" in text
    assert text.startswith("intro\n\n# Benchmarks") and text.endswith("<!-- b:begin -->\n\nother\n\n<!-- b:end -->\n")


def test_a_free_port_is_one_no_outgoing_connection_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers the tests and benchmarks start are given a port below the ephemeral range, so a client's
    connection opened meanwhile (which the kernel places in that range) cannot take it before they bind."""
    low = spawned.ephemeral_low()
    if low <= spawned.PRIVATE_PORTS.start + 1000:
        pytest.skip(f"this host's ephemeral range starts at {low}: free_port takes any port there")
    ports = {spawned.free_port() for _ in range(50)}
    assert all(spawned.PRIVATE_PORTS.start <= port < low for port in ports), sorted(ports)
    assert len(ports) > 40, "chosen at random, so two servers rarely get the same one"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", min(ports)))
        listening.listen()
        draws = iter([min(ports), min(ports), max(ports)])
        monkeypatch.setattr(spawned.random, "choice", lambda _: next(draws))
        assert spawned.free_port() == max(ports), "a port in use is passed over"


def test_servers_take_the_procfile_web_flags_on_loopback() -> None:
    flags = spawned.web_flags(8123)
    assert flags[flags.index("--host") + 1] == "127.0.0.1" and flags[flags.index("--port") + 1] == "8123"
    assert flags[flags.index("--loop") + 1] == "uvloop"
    assert flags[flags.index("--http") + 1] == "web.protocol:BoundedHttpToolsProtocol"
    assert "--factory" in flags and "service:create_app" not in flags


@pytest.mark.slow
def test_load_generators_against_the_bare_app_on_the_procfile_stack(redis: Redis, redis_url: str) -> None:
    """Keep-alive connections, GET and POST, answers counted and timed, by loadgen and by wrk; a wrong status
    fails the run."""
    redis.set("bench:test:wav", b"RIFF" + bytes(200_000))
    redis.set("bench:test:post", json.dumps({"id": "x"}))
    with Cluster() as cluster:
        cluster.redis_url = redis_url
        _, port = cluster.start_app("bare", "bench/baselines:bare", procfile=True)
        get = loadgen.request("GET", "/raw/bench:test:wav")
        res = asyncio.run(loadgen.run(port, lambda: get, connections=4, duration=0.5, warmup=0.1))
        assert res.completed > 5 and res.rps > 10 and 0 < res.p(50) <= res.p(99)
        post = loadgen.request("POST", "/raw/bench:test:post", {"text": "hello"})
        assert asyncio.run(loadgen.run(port, lambda: post, connections=2, duration=0.3)).completed > 0
        missing = loadgen.request("GET", "/raw/bench:test:nothing")
        with pytest.raises(BenchError, match="answered 404"):
            asyncio.run(loadgen.run(port, lambda: missing, connections=1, duration=0.2))
        if shutil.which("wrk") is None:
            pytest.skip("wrk is not installed (apt-get install wrk; .ci/run installs it)")
        got = loadgen.wrk(port, "/raw/bench:test:wav", connections=4, seconds=1, min_bytes=200_004)
        assert got.requests > 10 and got.rps > 10 and 0 < got.p50_ms <= got.p99_ms <= got.max_ms
        assert got.bytes >= got.requests * 200_004
        # The bare app parses the body: a body the Lua script mangled would be a 500.
        body = json.dumps({"text": "Lua's long brackets ]] ]=] [==[ stay as they are"}).encode()
        assert loadgen.wrk(port, "/raw/bench:test:post", 2, 1, method="POST", body=body).requests > 10
        with pytest.raises(BenchError, match="errors"):
            loadgen.wrk(port, "/raw/bench:test:nothing", 1, 1)  # 404
        with pytest.raises(BenchError, match="expected at least 10000"):
            loadgen.wrk(port, "/raw/bench:test:post", 1, 1, method="POST", body=body, min_bytes=10_000)


def test_kit_then_gpu_script_runs_its_reduced_cpu_mode(tiny_model: Path) -> None:
    """bench/kit.sh then bench/gpu.sh end to end without a GPU: the device kit collected (PyPI), a wheel per pin,
    installed offline into a temporary folder and the worker imported from there; tiny model, engine alone in
    float32 and bfloat16 with their fidelity, 1 and 2 real workers, time to first chunk, both schedulers at 1 and 4
    streams, one table."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    env["PYTHON"] = sys.executable
    kit = subprocess.run(["bash", "bench/kit.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-3000:]
    pins = [line for line in (ROOT / "requirements-gpu.in").read_text().splitlines() if "==" in line]
    wheels = {path.name.split("-")[0].replace("_", "-").lower() for path in (ROOT / ".whl").glob("*.whl")}
    assert wheels == {pin.split("==")[0].replace("_", "-").lower() for pin in pins}
    assert f"kit: {len(pins)} wheels" in kit.stdout
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--quick", "--cpu", "--model", str(tiny_model)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "device kit: installing" in out and "device kit: imports ok" in out and "reduced CPU mode" in out
    for line in (
        "real-time factor, batch 1, float32",
        "real-time factor, batch 4, bfloat16 (vs float32)",
        "engine throughput, batch 4, bfloat16",
        "real-time factor, batch 4, loop (vs float32)",
        "fidelity bfloat16: first-step logits cosine vs float32",
        "fidelity bfloat16: first 64 sampled steps equal to float32's",
        "RSS per worker, idle after warm-up (CPU mode), cross-batching on",
        "time to first chunk, 4-chunk request, idle worker, cross-batching on",
        "1 worker(s) per machine: throughput",
        "2 worker(s) per machine: throughput (vs 1)",
        "2 worker(s): audio seconds made per second",
        "4 concurrent stream(s), continuous (vs static): real-time factor per stream",
        "4 concurrent stream(s), continuous (vs static): throughput",
        "4 concurrent stream(s), continuous (vs static): time to first audio p95",
        "1 concurrent stream(s), continuous (vs static): RSS above idle at the peak",
    ):
        assert line in out, out


# Bench scripts run one after another in one interpreter, each as `python SCRIPT ARGS` runs it (as __main__, with
# its own sys.argv), the line in argv[1] printed after each; a script's nonzero exit ends the child with its status.
SCRIPTS = """
import json, runpy, sys
done, commands = sys.argv[1], json.loads(sys.argv[2])
for command in commands:
    sys.argv = command
    try:
        runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    print(done, flush=True)
"""
SCRIPT_DONE = "-- bench script done --"


def run_scripts(*commands: list[str], env: dict[str, str]) -> list[str]:
    """Each command (a bench script and its arguments) run to its end in one child process, which imports torch and
    ChatTTS once for them all; each one's stdout. Fails the test with the output's end when one fails."""
    argv = [sys.executable, "-c", SCRIPTS, SCRIPT_DONE, json.dumps(commands)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    *outputs, rest = done.stdout.split(SCRIPT_DONE + "\n")
    assert len(outputs) == len(commands) and not rest, done.stdout[-3000:]
    return outputs


def test_the_cpu_step_tools_run_on_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    """bench/step_parts.py, engine_bench.py --floors and bench/worker_memory.py end to end on the tiny checkpoint:
    every part of a step and the real-time factor reported at each batch size for this tree's C step and for HEAD's
    (built from its own tree, as --before builds a commit's), a bandwidth, a step's bytes and the C step's time, and a
    worker's memory with its 4-bit layers' bytes. The three share one interpreter (engine_bench.py first, before
    step_parts.py wraps the model's classes in its timers); worker_memory.py still loads in a process of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    out, tuning = tmp_path / "engine.json", "loop:float32+int4-weight"
    engine = ["bench/engine_bench.py", "--model", str(tiny_model), "--tunings", tuning, "--batch-sizes", "1"]
    engine += ["--chunks", "1", "--rounds", "1", "--floors", "--json", str(out)]
    parts = ["bench/step_parts.py", "--model", str(tiny_model), "--rounds", "1", "--batch-sizes", "1,2"]
    parts += ["--before", "HEAD"]
    memory = ["bench/worker_memory.py", "--model", str(tiny_model), "--settings", "TTS_QUANTIZE=int4-weight"]
    _, parts_out, memory_out = run_scripts(engine, parts, memory, env=env)
    for size in (1, 2):
        for build in ("this tree", "HEAD"):
            assert re.search(rf"\nBatch {size} \({build}'s C step: .* real-time factor \d+\.\d\d \(", parts_out), build
    for part in ("GPT step", "GPT prefill", "code heads", "sampling", "DVAE decoder", "Vocos", "Redis (a piece's"):
        assert parts_out.count(f"| {part}") == 4, part
    paired = parts_out.split("This tree against HEAD, round by round on the same rows")[1]
    for size in (1, 2):
        assert re.search(rf"\n\| {size} \| \d+\.\d\dx \[", paired), paired
    floors = json.loads(out.read_text())["floors"]
    assert floors["tuning"] == tuning and floors["bandwidth"] > 1e8 and floors["gpt_step_seconds"] > 0
    assert all(floors["bytes"][part] > 0 for part in ("gpt", "heads", "decoders"))
    assert "| this tree | TTS_QUANTIZE=int4-weight | " in memory_out
