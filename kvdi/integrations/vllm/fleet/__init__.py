"""kvdi seen by the fleet inside vLLM: KV cache events, hit sources, Prometheus series and stats files.

- :mod:`.events`: :class:`~.events.SchedulerFleet` and :class:`~.events.WorkerFleet`, vLLM's KV cache
  events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), hit sources and ``reset_cache``
  (imports vLLM);
- :mod:`.ledger`: the bookkeeping behind the events, joined across the scheduler and the worker ranks;
- :mod:`.counters`: what each step adds for Prometheus (miss blocks, per-step seconds, gauges);
- :mod:`.prom`: kvdi's Prometheus series (``build_prom_metrics``) and its stats envelope (imports vLLM);
- :mod:`.stats`: per-step counter deltas and the ``kvdi_stats_dir`` files.
"""
