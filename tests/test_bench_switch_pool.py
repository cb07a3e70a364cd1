"""Pooling bench_serve_switch runs (vLLM-free): only results files of the same kvdi code and of the stall rule, and
the pooled interval over every round of every run."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.vllm.switch_pool import PoolError, check_same_code, check_same_setup, load_run, main, pooled


def _pass(itl: float, stalls: bool = True) -> dict[str, float]:
    figures = {"server ITL p50": itl, "server ITL p90": 2 * itl, "server ITL mean": 1.1 * itl}
    return {**figures, "stalls": 0.0, "stalled": 0.0} if stalls else figures


def _run(config: str, kvdi_itl: list[float], stalls: bool = True) -> dict[str, Any]:
    """A run of ``config`` whose noop passes take 2.0 ms and kvdi's ``kvdi_itl`` (one round each)."""
    rounds = [{m: {p: _pass(itl if m == "kvdi" else 2.0, stalls) for p in ("cold", "hit", "load")}
               for m in ("noop", "kvdi")} for itl in kvdi_itl]  # fmt: skip
    return {"benchmark": "bench_serve_switch", "results": [{"config": config, "rounds": rounds}]}


def _write(path: Path, first_line: str, doc: dict[str, Any] | None) -> Path:
    lines = [first_line, "# PYTHONPATH=$PWD python -m benchmarks.vllm.bench_serve_switch ..."]
    path.write_text("\n".join([*lines, json.dumps(doc)] if doc else lines) + "\n# rc=0\n")
    return path


def test_a_run_is_taken_only_with_its_commit_its_document_and_the_stall_rule(tmp_path: Path) -> None:
    good = _write(tmp_path / "a.txt", "# a: main at 1234abc, 07:17 UTC", _run("null", [2.0, 2.1]))
    commit, doc = load_run(good)
    assert commit == "1234abc" and doc["results"][0]["config"] == "null"
    cases = {
        "no commit": (_write(tmp_path / "b.txt", "# b: 07:17 UTC", _run("null", [2.0, 2.1])), "names no 'main at"),
        "no document": (_write(tmp_path / "c.txt", "# c: main at 1234abc", None), "no bench_serve_switch run"),
        "before the stall rule": (
            _write(tmp_path / "d.txt", "# d: main at 1234abc", _run("null", [2.0], stalls=False)),
            "no stall counts",
        ),
        "missing": (tmp_path / "e.txt", "cannot be read"),
        "cut short": (_write(tmp_path / "f.txt", "# f: main at 1234abc", None), "not one bench_serve_switch writes"),
    }
    cut = cases["cut short"][0]
    cut.write_text(cut.read_text() + '{"benchmark": "bench_serve_switch", "results": [{"config": "nu\n')
    for case, (path, why) in cases.items():
        with pytest.raises(PoolError, match=why):
            load_run(path)
        print(case, "refused")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_runs_pool_only_when_their_commits_share_kvdi_and_the_switch_connector(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "kvdi").mkdir(parents=True)
    (repo / "docs").mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.invalid")
    _git(repo, "config", "user.name", "t")
    commits = []
    for path, text in (("kvdi/a.py", "x = 1\n"), ("docs/b.md", "figures\n"), ("kvdi/a.py", "x = 2\n")):
        (repo / path).write_text(text)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", path)
        commits.append(_git(repo, "rev-parse", "--short", "HEAD"))
    first, docs_only, kvdi_changed = commits
    check_same_code([first, docs_only, first], repo)  # a docs commit measured the same code
    with pytest.raises(PoolError, match=f"{first} and {kvdi_changed} differ in kvdi"):
        check_same_code([first, docs_only, kvdi_changed], repo)
    with pytest.raises(PoolError, match="git cannot compare"):
        check_same_code([first, "0000000"], repo)


def test_the_pooled_interval_covers_every_round_of_every_run_and_the_verdict_rests_on_servers() -> None:
    quiet = _run("null", [2.0, 2.02, 1.98, 2.0])  # ratios 1.0, 1.01, 0.99, 1.0
    noisy = _run("null", [2.2, 1.8])  # ratios 1.1, 0.9
    table = pooled([("quiet", quiet), ("noisy", noisy)])
    rows = {line.split()[0]: line for line in table.splitlines() if "rounds" in line and line.startswith("  ")}
    assert "4 rounds" in rows["quiet"] and "2 rounds" in rows["noisy"] and "6 rounds" in rows["rounds"]
    hit = table.split("null hit")[1].split("null load")[0]
    pooled_row = next(line for line in hit.splitlines() if line.strip().startswith("rounds pooled"))
    centre = math.exp(sum(math.log(x) for x in (1.0, 1.01, 0.99, 1.0, 1.1, 0.9)) / 6)
    assert f"{centre:.3f} [" in pooled_row and "<=" not in pooled_row  # shown, not judged
    servers_row = next(line for line in hit.splitlines() if line.strip().startswith("over servers"))
    assert " 2 servers" in servers_row
    assert servers_row.rstrip().endswith("pass (<= 1.03)")  # two servers that agree (1.0 and 0.995)
    spread = next(line for line in hit.splitlines() if line.strip().startswith("SD: a round in its server"))
    # within: the noisy run's +-0.10 in log (quiet's +-0.01), 4 degrees of freedom: 7.1 %; servers alike: 0
    assert spread.split()[-3:] == ["7.1%", "/", "0.0%"]
    # each run steady in its rounds, their servers apart: pooled rounds look narrow, the servers decide nothing
    apart = pooled([("quiet", quiet), ("high", _run("null", [2.12, 2.13, 2.11, 2.12]))])
    hit = apart.split("null hit")[1].split("null load")[0]
    assert next(x for x in hit.splitlines() if "over servers" in x).rstrip().endswith("undecided (<= 1.03)")
    runs = next(x for x in hit.splitlines() if "over runs" in x)  # each run's mean of its servers' means
    assert " 2 runs" in runs and f"{math.exp((0 + math.log(1.06)) / 2):.3f} [" in runs and "<=" not in runs
    mt = {"benchmark": "bench_serve_switch", "results": [{"config": "cpu_offload", "multi_turn_rounds": [
        {m: {"ttft_p50_ms": 50.0 * k, "ttft_p90_ms": 90.0 * k, "run_s": 8.0 * k} for m, k in (("noop", 1), ("kvdi", 2))}
        for _ in range(3)]}]}  # fmt: skip
    assert "FAIL (<= 1.0)" in pooled([("mt", mt), ("mt2", mt)]).split("multi-turn cpu_offload")[1]


def test_a_run_of_several_servers_counts_each_server_once() -> None:
    run = _run("null", [2.0, 2.0])
    run["results"] = [run["results"][0] | {"server": k} for k in range(3)]  # 3 servers of 2 rounds
    hit = pooled([("many", run), ("one", _run("null", [2.0, 2.0]))]).split("null hit")[1].split("null load")[0]
    assert "many (3 servers)" in hit and " 4 servers" in hit and " 8 rounds" in hit


def test_the_hooks_extra_time_is_put_against_the_do_nothing_connectors_step() -> None:
    run = _run("cpu_offload", [2.0, 2.0])  # noop's server ITL mean: 2.2 ms
    run["results"][0]["hook_times"] = {
        "noop": {"scheduler": {"us_per_step": 3.0}, "worker": {"us_per_step": 12.0}},
        "kvdi": {"scheduler": {"us_per_step": 15.0}, "worker": {"us_per_step": 22.0}},
    }
    line = next(x for x in pooled([("fresh", run)]).splitlines() if x.strip().startswith("cpu_offload fresh"))
    assert "+22.0 µs a step =  1.00 % of a 2.20 ms step" in line


def test_a_run_that_cannot_be_pooled_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _write(tmp_path / "old.txt", "# old: main at 1234abc", _run("null", [2.0, 2.1], stalls=False))
    assert main([str(old)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "old.txt: its passes carry no stall counts" in err and "Traceback" not in err
    run = {**_run("null", [2.0, 2.1]), "started": "2026-12-06T07:17:30Z"}
    one = _write(tmp_path / "one.txt", "# one: main at 1234abc", run)
    copy = _write(tmp_path / "copy.txt", "# copy: main at 1234abc", run)
    assert main([str(one), str(copy)]) == 2
    assert "hold the same run (started 2026-12-06T07:17:30Z)" in capsys.readouterr().err
    quiet = {**run, "started": "2026-12-06T12:00:00Z", "args": {"stats_dir": "False"}}
    without = _write(tmp_path / "without.txt", "# without: main at 1234abc", quiet)
    assert main([str(one), str(without)]) == 2  # a run before --stats-dir had the stats files on
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one.txt ran with kvdi's stats files on, " in err and "without.txt without" in err
    placed = {**run, "started": "2026-12-06T14:12:00Z", "args": {"engine_on_worker": "True"}}
    moved = _write(tmp_path / "moved.txt", "# moved: main at 1234abc", placed)
    assert main([str(one), str(moved)]) == 2  # a run before --engine-on-worker had the engine core off the worker
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"{moved} ran the engine core on the worker's cores, {one} beside the API server" in err
    )


def test_runs_of_another_workload_are_not_pooled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = {"prompts": "32", "output_len": "128", "settle_s": "1.0", "reserved_cpus": "1", "pin": "True"}
    first = {**_run("null", [2.0, 2.1]), "started": "2026-12-06T07:00:00Z", "args": args}
    second = {**_run("null", [2.2, 1.9]), "started": "2026-12-06T08:00:00Z", "args": args}
    paths = [_write(tmp_path / f"{name}.txt", f"# {name}: main at 1234abc", doc)
             for name, doc in (("first", first), ("second", second))]  # fmt: skip
    check_same_setup(paths, [first, second])  # the same arguments: pooled
    for key, value in (("prompts", "64"), ("pin", "False"), ("output_len", "256")):
        longer = {**second, "args": {**args, key: value}}
        more = _write(tmp_path / "more.txt", "# more: main at 1234abc", longer)
        assert main([str(paths[0]), str(more)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"first.txt ran with {key} {args[key]}, " in err
        assert f"more.txt with {key} {value}: not the same workload" in err
    sliced = {**second, "args": {**args, "slices": 4}}  # runs from before --slices were unsliced: 1
    with pytest.raises(PoolError, match="first.txt ran with slices 1, .*second.txt with slices 4: not the same work"):
        check_same_setup(paths, [first, sliced])
    check_same_setup(paths, [first, {**second, "args": {**args, "slices": 1}}])
    unrecorded = {**second, "args": {k: v for k, v in args.items() if k != "settle_s"}}
    with pytest.raises(PoolError, match="with settle_s not recorded: not the same workload"):
        check_same_setup(paths, [first, unrecorded])


def test_the_hook_time_of_a_run_of_several_servers_is_their_median_with_its_range() -> None:
    run = _run("null", [2.0])
    run["results"] = [run["results"][0] | {"server": k} for k in range(3)]
    for result, extra in zip(run["results"], (30.0, 44.0, 50.0), strict=True):
        result["hook_times"] = {
            "noop": {"worker": {"us_per_step": 10.0}},
            "kvdi": {"worker": {"us_per_step": 10 + extra}},
        }
    line = next(x for x in pooled([("many", run)]).splitlines() if x.strip().startswith("null many"))
    assert "+44.0 µs a step =  2.00 % of a 2.20 ms step (median of 3 servers, +30.0 to +50.0 µs)" in line
