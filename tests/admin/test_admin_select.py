"""``kvdi store`` by layout and age, its dry run by default for filters, its output where no one watches a terminal."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.testing.redis_server import RedisServer
from tests.admin.helpers import FINGERPRINTS, frame, key, kvdi

OBJECTS = 10  # frames alternate between two layouts: 5 each
DAY = 86_400


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """OBJECTS frames of two layouts; the first four last used two days ago."""
    root = tmp_path / "kv"
    files = FileBlockStore(root)
    assert files.put_many([(key(i), [frame(i)]) for i in range(OBJECTS)]) == OBJECTS
    files.close()
    old = time.time() - 2 * DAY
    for i in range(4):
        name = key(i).hex()
        os.utime(root / name[:2] / name, (old, old))
    return root


def env(root: Path) -> dict[str, str]:
    return {"KVDI_KV_CONNECTOR": "shared_storage", "KVDI_SHARED_STORAGE__PATH": str(root)}


def _objects(root: Path) -> set[str]:
    return {p.name for p in root.glob("??/*") if not p.name.startswith(".")}


def test_stats_of_one_layout_counts_only_its_objects(store: Path) -> None:
    """``stats --layout <prefix>`` counts the objects whose frames name that layout, and lists only it."""
    fp = FINGERPRINTS[1].hex()
    out = kvdi("store", "stats", "--json", "--layout", fp[:8], env=env(store))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["objects"] == OBJECTS // 2 and list(info["layouts"]) == [fp]


def test_clear_older_than_is_a_dry_run_until_yes(store: Path) -> None:
    """``clear --older-than 1d`` lists the four old objects and removes nothing; with ``--yes`` it removes those
    four and keeps the recent ones."""
    before = _objects(store)
    dry = kvdi("store", "clear", "--older-than", "1d", env=env(store))
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("would remove: ") == 4 and "add --yes" in dry.stdout
    assert _objects(store) == before
    done = kvdi("store", "clear", "--older-than", "1d", "--yes", env=env(store))
    assert done.returncode == 0, done.stderr
    assert _objects(store) == before - {key(i).hex() for i in range(4)}


def test_clear_of_one_layout_and_age_removes_only_both(store: Path) -> None:
    """Both filters together select objects of that layout that are also old (keys 1 and 3)."""
    done = kvdi("store", "clear", "--layout", FINGERPRINTS[1].hex(), "--older-than", "36h", "--yes", env=env(store))
    assert done.returncode == 0, done.stderr
    assert {key(i).hex() for i in range(OBJECTS)} - _objects(store) == {key(1).hex(), key(3).hex()}


@pytest.mark.parametrize(("option", "value"), [("--older-than", "soon"), ("--layout", "xyz")])
def test_a_bad_filter_is_one_line_naming_the_option(store: Path, option: str, value: str) -> None:
    """A bad ``--older-than`` or ``--layout``: exit 2, one line naming the option and its value."""
    out = kvdi("store", "stats", option, value, env=env(store))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert f"{option}={value!r}" in out.stderr and "Traceback" not in out.stderr


def test_progress_and_summary_lines_outside_a_terminal(store: Path) -> None:
    """Run in a pipe (no terminal), ``verify`` and ``stats`` print a progress line on stderr and a summary line."""
    verify = kvdi("store", "verify", env=env(store))
    assert verify.returncode == 0, verify.stderr
    assert f"kvdi store verify: {OBJECTS}/{OBJECTS} objects (100%)" in verify.stderr
    stats = kvdi("store", "stats", env=env(store))
    assert f"kvdi store stats: {OBJECTS}/{OBJECTS} objects (100%)" in stats.stderr
    assert stats.stdout.rstrip().splitlines()[-1].startswith(f"shared_storage at {store}: {OBJECTS} objects")


def test_stats_prints_modes_in_octal(store: Path) -> None:
    """The store's file mode (a setting) and its folder's mode (as found) read as octal, not decimal."""
    out = kvdi("store", "stats", "--json", env=env(store))
    info = json.loads(out.stdout)
    assert info["settings"]["shared_storage"]["mode"] == "0o600"
    assert info["server"]["folder_mode"] == oct(os.stat(store).st_mode & 0o777)
    assert "384" not in kvdi("store", "stats", env=env(store)).stdout


@pytest.mark.redis
def test_redis_stats_show_the_servers_policy_and_the_keys_ttl(redis_server: RedisServer) -> None:
    """Redis stats show the server's ``maxmemory_policy`` and the TTL the engines wrote with (one hour here), not
    the CLI's own ``ttl_s`` default (one day)."""
    from kvdi.connectors.redis import RedisBlockStore
    from kvdi.settings import RedisSettings

    writer = RedisBlockStore(RedisSettings(url=redis_server.url, ttl_s=3600))  # type: ignore[arg-type]
    assert writer.put_many([(key(i), [frame(i)]) for i in range(4)]) == 4
    writer.close()
    out = kvdi("store", "stats", "--json", env={"KVDI_KV_CONNECTOR": "redis", "KVDI_REDIS__URL": redis_server.url})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    (node,) = info["server"]["nodes"].values()
    assert node["maxmemory_policy"] == "noeviction"  # redis-server's default
    assert 3500 < info["server"]["ttl"]["min_s"] <= info["server"]["ttl"]["max_s"] <= 3600
    assert "ttl_s" not in info["settings"]["redis"]


def test_a_misspelt_connector_option_is_named_as_written(store: Path) -> None:
    """``--connector redsi`` is blamed on ``--connector`` (not on KVDI_KV_CONNECTOR, which the user did not set), with a
    did-you-mean."""
    out = kvdi("store", "stats", "--connector", "redsi", env={})
    assert out.returncode == 2 and "--connector='redsi'" in out.stderr and "(did you mean 'redis'?)" in out.stderr
    assert "KVDI_KV_CONNECTOR" not in out.stderr
