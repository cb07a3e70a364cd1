"""The in-server A/B benchmark's figures (vLLM-free): hook times per step from the switch connectors' reports,
ratios within a round, and the bars' verdicts."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.vllm.bench_serve_switch import (
    FIGURES,
    MT_FIGURES,
    hook_times,
    kvdi_counters,
    run_again,
    stalled,
    table,
    thread_cpu_ms,
)


def _report(
    folder: Path, pid: int, mode: str, times: dict[str, dict[str, list[int]]], gc: dict[str, list[int]] | None = None
) -> None:
    report = {"pid": pid, "mode": mode, "times": times} | ({"gc": gc} if gc else {})
    (folder / str(pid)).write_text(json.dumps(report))


def test_hook_times_are_per_engine_step_of_each_role_and_mode(tmp_path: Path) -> None:
    scheduler = {"noop": {"build_connector_meta": [100, 50_000]}, "kvdi": {"build_connector_meta": [200, 400_000],
                 "get_kv_connector_stats": [200, 600_000], "request_finished": [10, 1_000_000]}}  # fmt: skip
    worker = {"noop": {"bind_connector_metadata": [100, 100_000]}, "kvdi": {"bind_connector_metadata": [200, 200_000]}}
    _report(tmp_path, 11, "noop", scheduler)
    _report(tmp_path, 12, "noop", worker)
    got = hook_times(tmp_path)
    assert got["noop"]["scheduler"]["us_per_step"] == pytest.approx(0.5)
    assert got["kvdi"]["scheduler"]["steps"] == 200
    assert got["kvdi"]["scheduler"]["us_per_step"] == pytest.approx(2 + 3 + 5)  # µs a step, per-request hooks too
    assert got["kvdi"]["scheduler"]["top"][0] == ("request_finished", pytest.approx(5.0))
    assert got["kvdi"]["worker"]["us_per_step"] == pytest.approx(1.0)
    assert "gc_us_per_step" not in got["kvdi"]["worker"]  # a report from before the connector counted collections


def test_garbage_collections_are_per_engine_step_of_each_role_and_mode(tmp_path: Path) -> None:
    scheduler = {"noop": {"build_connector_meta": [100, 50_000]}, "kvdi": {"build_connector_meta": [200, 400_000]}}
    worker = {"noop": {"bind_connector_metadata": [100, 100_000]}, "kvdi": {"bind_connector_metadata": [200, 200_000]}}
    _report(tmp_path, 11, "noop", scheduler, {"noop": [50, 5, 1, 300_000], "kvdi": [100, 10, 2, 1_000_000]})
    _report(tmp_path, 12, "noop", worker, {"noop": [10, 1, 0, 100_000], "kvdi": [40, 2, 0, 600_000]})
    got = hook_times(tmp_path)
    assert got["noop"]["scheduler"]["gc_us_per_step"] == pytest.approx(3.0)
    assert got["kvdi"]["scheduler"]["gc_us_per_step"] == pytest.approx(5.0)
    assert got["kvdi"]["scheduler"]["gc_per_kstep"] == pytest.approx([500.0, 50.0, 10.0])
    assert got["kvdi"]["worker"]["gc_us_per_step"] == pytest.approx(3.0)
    doc = {"minutes": 1.0, "results": [{"config": "null", "rounds": [{"noop": _passes(1.0), "kvdi": _passes(1.0)}],
                                        "hook_times": got}]}  # fmt: skip
    lines = table(doc).splitlines()
    assert (
        "  kvdi scheduler     5.0 in garbage collections (generations 0/1/2: 500.0/50.0/10.0 a thousand steps)" in lines
    )
    # over servers: the collections' extra beside the hooks', one line each
    servers = _servers([1.0], [1.0])
    for k, result in enumerate(servers["results"]):
        result["hook_times"] = {mode: {role: dict(t) for role, t in roles.items()} for mode, roles in got.items()}
        result["hook_times"]["kvdi"]["worker"]["gc_us_per_step"] += 10.0 * k
    gc_lines = [line for line in table(servers).splitlines() if "garbage collections' time" in line]
    assert gc_lines == ["null: garbage collections' time, kvdi - noop, µs a step (scheduler + worker), server by "
                        "server: +4.0, +14.0; median +9.0"]  # fmt: skip


def test_hook_times_since_a_start_leave_out_what_the_start_had_counted(tmp_path: Path) -> None:
    from benchmarks.vllm.bench_serve_switch import reports

    # at the start: warm-up's 100 steps and start-up's collections, all in noop's mode; kvdi's never ran
    _report(tmp_path, 11, "noop", {"noop": {"build_connector_meta": [100, 900_000]}}, {"noop": [40, 4, 2, 9_000_000]})
    start = reports(tmp_path)
    scheduler = {"noop": {"build_connector_meta": [300, 1_100_000]}, "kvdi": {"build_connector_meta": [100, 400_000]}}
    _report(tmp_path, 11, "noop", scheduler, {"noop": [42, 4, 2, 9_200_000], "kvdi": [3, 0, 0, 300_000]})
    got = hook_times(tmp_path, start)
    assert got["noop"]["scheduler"]["steps"] == 200
    assert got["noop"]["scheduler"]["us_per_step"] == pytest.approx(1.0)
    assert got["noop"]["scheduler"]["gc_us_per_step"] == pytest.approx(1.0)
    assert got["noop"]["scheduler"]["gc_per_kstep"] == pytest.approx([10.0, 0.0, 0.0])
    assert got["kvdi"]["scheduler"]["gc_us_per_step"] == pytest.approx(3.0)
    assert hook_times(tmp_path)["noop"]["scheduler"]["steps"] == 300  # without a start: everything counted
    # a mode that took no step since the start is left out, not divided by zero
    _report(tmp_path, 11, "noop", {"noop": {"build_connector_meta": [100, 900_000]}}, {"noop": [40, 4, 2, 9_000_000]})
    assert hook_times(tmp_path, start) == {}


def test_a_pass_probes_the_host_unless_the_pass_before_it_was_quiet() -> None:
    from benchmarks.vllm.bench_serve_switch import needs_probe

    assert needs_probe(None, 5.0)  # a server's first pass
    assert not needs_probe(0.0, 5.0) and not needs_probe(5.0, 5.0)
    assert needs_probe(5.1, 5.0)


def _passes(scale: float) -> dict[str, dict[str, float]]:
    return {phase: {f: 2.0 * scale for f in FIGURES} | {"completed": 32.0} for phase in ("cold", "hit", "load")}


def _doc(ratios: list[float], config: str = "null") -> dict[str, Any]:
    rounds = [{"noop": _passes(1.0), "kvdi": _passes(r)} for r in ratios]
    return {"minutes": 1.0, "results": [{"config": config, "rounds": rounds, "hook_times": {}}]}


@pytest.mark.parametrize(
    ("ratios", "verdict"),
    [([1.0, 1.01, 0.99, 1.0], "pass"), ([1.2, 1.21, 1.19, 1.2], "FAIL"), ([0.9, 1.2, 0.95, 1.15], "undecided")],
)
def test_each_pass_is_judged_on_its_within_round_ratios(ratios: list[float], verdict: str) -> None:
    lines = table(_doc(ratios)).splitlines()
    judged = [line for line in lines if line.startswith("  kvdi null")]
    assert len(judged) == 3  # cold, hit, load
    assert all(line.rstrip().endswith(f"{verdict} (<= 1.03)") for line in judged)


def test_a_store_is_judged_on_hit_and_load_only_and_multi_turn_against_one() -> None:
    doc = _doc([1.04, 1.04, 1.04], "shared_storage")
    mt = [{m: {f: v for f in MT_FIGURES} | {"requests": 120.0} for m, v in (("noop", 4.0), ("kvdi", 3.6))}] * 3
    doc["results"].append({"config": "cpu_offload", "multi_turn_rounds": mt})
    lines = table(doc).splitlines()
    store = [line.rstrip() for line in lines if line.startswith("  kvdi shared_storage")]
    assert [line.split()[-1] for line in store] == ["-", "1.05)", "1.15)"]  # cold: no bar; hit, load: pass
    assert all("pass" in line for line in store[1:])
    (multi,) = [line for line in lines if line.startswith("  kvdi cpu_offload")]
    assert "0.900 [0.900-0.900]" in multi and multi.rstrip().endswith("pass (<= 1.0)")
    assert not [line for line in lines if line.startswith("  server side")]  # runs before vLLM's figures were kept


def test_a_multi_turn_table_shows_vllms_own_figures_beside_the_clients() -> None:
    server = {"server_ttft_p50_ms": 20.0, "server_ttft_p90_ms": 40.0, "engine_request_ms": 60.0}
    mt = [{"noop": {f: 4.0 for f in MT_FIGURES} | server,
           "kvdi": {f: 4.4 for f in MT_FIGURES} | {k: v / 2 for k, v in server.items()}}] * 3  # fmt: skip
    steps = {m: {"scheduler": {"steps": n, "us_per_step": 2.0, "top": [("build_connector_meta", 1.0)]}}
             for m, n in (("noop", 900), ("kvdi", 1400))}  # fmt: skip
    result = {"config": "cpu_offload", "multi_turn_rounds": mt, "hook_times": steps}
    lines = table({"results": [result], "minutes": 1.0})
    assert "  kvdi scheduler     2.0 over 1400 steps (build_connector_meta 1.0)" in lines.splitlines()
    (bar,) = [line for line in lines.splitlines() if line.startswith("  kvdi cpu_offload")]
    assert bar.rstrip().endswith("FAIL (<= 1.0)")  # the bar is on the client's figures
    (side,) = [line for line in lines.splitlines() if line.startswith("  server side")]
    assert side.split()[5:] == ["server_ttft_p50", "0.500", "[0.500-0.500]", "server_ttft_p90", "0.500",
                                "[0.500-0.500]", "engine_request", "0.500", "[0.500-0.500]"]  # fmt: skip


def test_kvdi_counters_are_summed_over_label_sets_and_only_counters_kept() -> None:
    page = "\n".join([
        "# HELP vllm:kvdi_saved_blocks_total blocks written",
        'vllm:kvdi_saved_blocks_total{engine="0",role="worker"} 3.0',
        'vllm:kvdi_saved_blocks_total{engine="0",role="scheduler"} 4.0',
        'vllm:kvdi_lookups_total{engine="0"} 32.0',
        'vllm:kvdi_in_flight_bytes{engine="0"} 1024.0',
        'vllm:kvdi_save_seconds_count{engine="0"} 9.0',
        'vllm:prompt_tokens_total{engine="0"} 800.0',
    ])  # fmt: skip
    assert kvdi_counters(page) == {"saved_blocks": 7.0, "lookups": 32.0}


def test_thread_cpu_splits_the_main_thread_from_the_others() -> None:
    burnt, done = threading.Event(), threading.Event()

    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.15:
            pass
        burnt.set()
        done.wait(10)  # alive while it is read: a thread that exited leaves /proc/<pid>/task

    main_before, other_before = thread_cpu_ms(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    try:
        assert burnt.wait(10)
        main_after, other_after = thread_cpu_ms(os.getpid())
    finally:
        done.set()
        worker.join()
    assert other_after - other_before >= 100  # the thread's 150 ms, at the clock tick's resolution
    assert main_after - main_before < other_after - other_before
    assert thread_cpu_ms(2**22 + 1) == (0.0, 0.0)  # no such process: nothing to say


def test_a_pass_is_stalled_when_its_client_got_whole_responses_and_the_table_counts_reruns() -> None:
    assert stalled({"client ITL p50": 0.003})
    assert not stalled({"client ITL p50": 2.1})
    doc = _doc([1.0, 1.0])
    rounds = doc["results"][0]["rounds"]
    rounds[0]["kvdi"]["hit"] |= {"stalls": 2.0, "stalled": 0.0, "cpu worker main": 2500.0, "kvdi lookups": 32.0}
    rounds[1]["noop"]["hit"] |= {"stalls": 4.0, "stalled": 1.0}
    lines = table(doc).splitlines()
    hit = lines[lines.index(next(line for line in lines if line.startswith("null hit"))) :]
    assert "passes run again, stalled (client saw whole responses at once): noop 4, kvdi 2; kept stalled: noop 1, " \
           "kvdi 0" in hit[4]  # fmt: skip
    assert hit[3].startswith("    kvdi per pass (median): worker main 1250, kvdi lookups 16")  # median of 2500, 0


def test_a_pass_runs_again_when_stalled_or_stolen_a_bounded_number_of_times_and_never_a_stores_cold_one() -> None:
    quiet, stolen = {"client ITL p50": 5.0, "steal %": 1.0}, {"client ITL p50": 5.0, "steal %": 12.0}
    both = {"client ITL p50": 0.003, "steal %": 30.0}
    assert run_again(quiet, 0, 0, 5.0, "hit", "redis") is None
    assert run_again(stolen, 0, 0, 5.0, "hit", "redis") == "stolen"
    assert run_again(stolen, 0, 0, 15.0, "hit", "redis") is None  # within a looser bound
    assert run_again(stolen, 0, 4, 5.0, "hit", "redis") is None  # MAX_STOLEN reruns spent: kept, counted
    assert run_again(both, 0, 0, 5.0, "load", "redis") == "stalled"
    assert run_again(both, 4, 0, 5.0, "load", "redis") == "stolen"
    assert run_again(both, 0, 0, 5.0, "cold", "redis") is None  # the store holds the prompts now
    assert run_again(both, 0, 0, 5.0, "cold", "null") == "stalled"  # null stores nothing
    assert run_again({"client ITL p50": 5.0}, 0, 0, 5.0, "hit", "null") is None  # a pass that read no steal


def test_the_table_gives_each_modes_steal_and_the_passes_run_again_for_it() -> None:
    doc = _doc([1.0, 1.0])
    assert not any("host steal" in line for line in table(doc).splitlines())  # runs from before: no line
    rounds = doc["results"][0]["rounds"]
    for r, (noop, kvdi) in zip(rounds, [(0.5, 2.0), (1.5, 7.0)], strict=True):
        r["noop"]["hit"] |= {"steal %": noop, "stolen": 1.0}
        r["kvdi"]["hit"] |= {"steal %": kvdi, "stolen": 0.0, "stolen kept": float(kvdi > 5)}
    steal = [line for line in table(doc).splitlines() if "host steal" in line]
    assert steal == ["    host steal %, median over rounds: noop 1.0 (most 1.5), kvdi 4.5 (most 7.0); passes run "
                     "again for it: noop 2, kvdi 0; kept over the bound: noop 0, kvdi 1"]  # fmt: skip


def test_a_multi_turn_run_without_the_clients_modules_is_one_line_and_exit_2_before_any_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.vllm import bench_serve_multi_turn, bench_serve_switch

    monkeypatch.setattr(bench_serve_multi_turn, "CLIENT_MODULES", ("json", "kvdi_no_such_module"))
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    assert bench_serve_switch.main(["--rounds", "0", "--multi-turn", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("--multi-turn 2: vLLM's multi-turn client cannot run: the client imports ")
    assert "kvdi_no_such_module: not here" in err[0] and "json" not in err[0] and "pip install" in err[0]
    assert os.getpriority(os.PRIO_PROCESS, 0) == priority  # said before the client's priority was raised


def test_engine_on_worker_without_pin_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.vllm import bench_serve_switch

    assert bench_serve_switch.main(["--rounds", "0", "--multi-turn", "2", "--engine-on-worker"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--engine-on-worker: places the engine core of a pinned run; allowed only with --pin"]


def _servers(*per_server: list[float]) -> dict[str, Any]:
    results = [_doc(ratios)["results"][0] | {"server": k} for k, ratios in enumerate(per_server)]
    return {"minutes": 1.0, "args": {"servers": str(len(per_server))}, "results": results}


def test_with_several_servers_the_verdict_rests_on_the_interval_over_servers() -> None:
    # each server steady within itself (its rounds alone would pass), but the servers disagree: undecided
    lines = table(_servers([1.0, 1.0, 1.0], [1.06, 1.06, 1.06], [0.97, 0.97, 0.97])).splitlines()
    assert "null hit (9 rounds, 3 servers)" in "\n".join(lines)
    assert "3 fresh servers per configuration" in lines[0] and "one server" in table(_doc([1.0, 1.0])).splitlines()[0]
    over = [line for line in lines if line.startswith("  over servers")]
    assert len(over) == 3 and all(line.rstrip().endswith("undecided (<= 1.03)") for line in over)
    assert all(line.rstrip().endswith("over servers") for line in lines if line.startswith("  kvdi null"))
    # servers that agree decide it, however few rounds each ran
    lines = table(_servers([1.0], [1.005], [0.995], [1.0])).splitlines()
    over = [line for line in lines if line.startswith("  over servers")]
    assert all(line.rstrip().endswith("pass (<= 1.03)") for line in over)
    assert "1.000 [0.99" in over[0]


def test_servers_hook_times_are_one_line_a_run() -> None:
    doc = _servers([1.0], [1.0])
    for k, extra in enumerate((40.0, 60.0)):
        doc["results"][k]["hook_times"] = {
            "noop": {"scheduler": {"us_per_step": 5.0}, "worker": {"us_per_step": 5.0}},
            "kvdi": {"scheduler": {"us_per_step": 5.0 + extra}, "worker": {"us_per_step": 5.0}},
        }
    hooks = [line for line in table(doc).splitlines() if "inside the switched hooks" in line]
    assert hooks == ["null: time inside the switched hooks, kvdi - noop, µs a step (scheduler + worker), server by "
                     "server: +40.0, +60.0; median +50.0"]  # fmt: skip


def test_rounds_are_numbered_on_from_server_to_server_and_from_the_first_round() -> None:
    from benchmarks.vllm.bench_serve_switch import rounds_of

    assert [list(rounds_of(k, 1)) for k in range(3)] == [[0], [1], [2]]
    assert [list(rounds_of(k, 2, first_round=14)) for k in range(2)] == [[14, 15], [16, 17]]


@pytest.mark.parametrize(
    "argv",
    [["--rounds", "1"], ["--rounds", "1", "--slices", "3", "--prompts", "12"], ["--rounds", "2", "--servers", "0"],
     ["--rounds", "2", "--servers", "65"], ["--rounds", "2", "--first-round", "-1"],
     ["--rounds", "2", "--first-round", "100001"], ["--rounds", "2", "--max-steal", "-1"],
     ["--rounds", "2", "--max-steal", "101"], ["--rounds", "2", "--steal-wait-s", "3601"]],
)  # fmt: skip
def test_one_round_needs_an_even_slicing_and_servers_are_bounded(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.vllm import bench_serve_switch

    assert bench_serve_switch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and any(name in err[0] for name in ("--rounds 1", "--servers", "--first-round", "--max-steal"))
