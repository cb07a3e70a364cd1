"""Every snippet of the README and the docs pages that needs no server runs as written.

- ``python`` blocks run in a fresh interpreter (a block with ``def test_`` runs under pytest,
  with kvdi's plugin); blocks that import vLLM are left to the vLLM suite;
- ``bash`` blocks: every ``kvdi ...`` command runs and exits 0 (``export`` lines apply to the
  rest of the block); servers, ``make``, ``curl`` and the like are not run here;
- ``text`` blocks of ``$ command`` + one output line: the command prints exactly that line.

Paths under ``/tmp/kvdi-`` in a snippet are moved under the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    *(f"docs/{name}" for name in ("configuration.md", "connectors.md", "vllm.md", "sizing.md", "operations.md")),
    *(f"docs/{name}" for name in ("deployment.md", "troubleshooting.md", "migration.md")),
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_RUN_HERE = ("make", "python", "curl", "sudo", "redis-cli", "vllm", ".ci/vllm-tests.sh", "install")


def blocks(kind: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        found += [
            (f"{page}:{text[: m.start()].count(chr(10)) + 1}", m[2]) for m in FENCE.finditer(text) if m[1] == kind
        ]
    return found


def commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines and quotes spanning lines joined, comments dropped."""
    out: list[str] = []
    pending = ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if words:
            out.append(pending)
        pending = ""
    return out


def program(command: str) -> str:
    """The program a command runs, past leading VAR=value assignments."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    return next((w for w in words if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)), "")


def clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDI_") and k != "VLLM_USE_V1"}
    bin_dir = str(Path(sys.executable).parent)
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp), XDG_CACHE_HOME=str(tmp / "cache"), OMP_NUM_THREADS="1")
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    return env


def local(text: str, tmp: Path) -> str:
    return text.replace("/tmp/kvdi-", f"{tmp}/kvdi-")


def single_line_outputs(block: str) -> bool:
    lines = block.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    return bool(starts) and all(b - a == 2 for a, b in zip(starts, [*starts[1:], len(lines)], strict=True))


def imports_vllm(code: str) -> bool:
    return re.search(r"^\s*(from|import) vllm\b", code, re.M) is not None


# Blocks left to other suites: Python importing vLLM (tests/real_vllm runs the adapter with the same
# settings), bash blocks without a kvdi command (servers, installs), outputs that vary between runs.
PYTHON = [(where, code) for where, code in blocks("python") if not imports_vllm(code)]
BASH = [(where, b) for where, b in blocks("bash") if any(program(c) == "kvdi" for c in commands(b))]
TEXT = [(where, b) for where, b in blocks("text") if single_line_outputs(b)]


def test_the_pages_have_snippets_and_the_readme_is_short() -> None:
    assert len(PYTHON) >= 6 and len(BASH) >= 6 and len(TEXT) >= 2
    assert len((ROOT / "README.md").read_text().splitlines()) < 250


@pytest.mark.parametrize(("where", "code"), PYTHON, ids=[w for w, _ in PYTHON])
def test_python_snippet_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / ("test_snippet.py" if "def test_" in code else "snippet.py")
    script.write_text(local(code, tmp_path))
    command = (
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
        if "def test_" in code
        else [sys.executable, str(script)]
    )
    done = subprocess.run(command, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{where}\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize(("where", "block"), BASH, ids=[w for w, _ in BASH])
def test_bash_snippet_kvdi_commands_succeed(where: str, block: str, tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    ran = 0
    for command in commands(local(block, tmp_path)):
        words = shlex.split(command.replace("\\\n", " "), comments=True)
        if words[0] == "export":
            for assignment in words[1:]:
                name, _, value = assignment.partition("=")
                env[name] = os.path.expanduser(value)
            continue
        if program(command) != "kvdi":
            assert program(command).split("/")[-1] in NOT_RUN_HERE or program(command).startswith("."), command
            continue
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{where}: {command}\n{done.stdout}\n{done.stderr}"
        ran += 1
    assert ran


@pytest.mark.parametrize(("where", "block"), TEXT, ids=[w for w, _ in TEXT])
def test_documented_output_is_what_the_command_prints(where: str, block: str, tmp_path: Path) -> None:
    lines = block.rstrip("\n").splitlines()
    for i in (i for i, line in enumerate(lines) if line.startswith("$ ")):
        command, expected = lines[i][2:], lines[i + 1]
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300
        )
        assert (done.stdout + done.stderr).strip() == expected, f"{where}: {command}"


def test_the_readme_server_command_is_the_one_kvdis_tests_run(kvdi_env: Path) -> None:
    """The README's `vllm serve` (run word for word by tests/real_vllm/test_vllm_serve.py's readme_server) binds
    loopback, fits a 600-token prompt, and carries a config kvdi reads."""
    from kvdi.settings import load_settings
    from kvdi.settings.vllm_compat import adapter_overrides
    from tests.real_vllm.serve_support import readme_command, readme_serve_block

    assert "export VLLM_CPU_KVCACHE_SPACE=1" in readme_serve_block()
    words = readme_command(Path("model"), 8000, Path("/store"))
    given = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    assert words[1] == "serve" and given["--host"] == "127.0.0.1"
    assert int(given["--max-model-len"]) >= 600 + 16
    overrides = adapter_overrides(json.loads(given["--kv-transfer-config"]), "README")
    assert load_settings(**overrides).kv_connector == "shared_storage"
