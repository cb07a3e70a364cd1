"""kvdi's log lines inside vLLM read like vLLM's own: process, pid, level, timestamp, file and line (issue 32).

No engine: kvdi's plugin hook runs in this process, as vLLM runs it in each of its processes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest

from tests.real_vllm.vllm_support import require_vllm

require_vllm()


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """The ``kvdi`` and ``vllm`` loggers as they were: this test's handlers write to its own captured stream,
    which later tests in this process must not reach."""
    saved = [(log, list(log.handlers), log.level, log.propagate) for log in map(logging.getLogger, ("kvdi", "vllm"))]
    yield
    for log, handlers, level, propagate in saved:
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


@pytest.mark.usefixtures("logging_restored")
def test_a_kvdi_warning_comes_out_in_vllms_format(capsys: pytest.CaptureFixture[str]) -> None:
    """kvdi's plugin registered, vLLM's logging configured after it (as vLLM does): a ``kvdi.*`` warning is one
    line of vLLM's format on vLLM's stream."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    from kvdi.integrations.vllm.plugin import register

    register()
    configure_logging(LoggingConfig())
    logging.getLogger("kvdi.connectors.store.worker").warning("saving KV failed, blocks not stored")
    out = capsys.readouterr().out
    assert re.search(
        r"pid=\d+\) WARNING \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] saving KV failed, blocks not stored", out
    ), out
