"""A prefill engine and a decode engine in one process, sharing one KV store (disaggregated serving).

Run it: ``python containers/prefill_decode_pair.py [--store-dir DIR]``. The prefill engine
(``kv_role=kv_producer``) computes the prompts and saves their KV; the decode engine
(``kv_role=kv_consumer``) loads it and computes only the last block of each prompt. Both
generate greedily; the script prints both token lists and exits 0 when they match and the
decode engine really loaded tokens. Every other setting comes from ``KVDI_*`` env (or
``KVDI_SETTINGS_FILE``), so the same declaration runs on any connector whose store both
engines can reach (``shared_storage`` by default).

Copy this file to compose kvdi into a larger application: the pair is one
``DeclarativeContainer``; each half is a whole :class:`kvdi.containers.EngineContainer`.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from dependency_injector import containers, providers

from kvdi.containers import EngineContainer
from kvdi.settings import KvdiSettings, load_settings


def engine_settings(role: str, store_dir: str, num_blocks: int) -> KvdiSettings:
    """Settings of one half: env and file settings, with this half's role and the shared store."""
    return load_settings(kv_role=role, shared_storage={"path": store_dir}, allocator={"num_blocks": num_blocks})


class PrefillDecodePair(containers.DeclarativeContainer):
    """Two engines over one store: ``prefill`` saves KV, ``decode`` loads it."""

    config = providers.Configuration()

    prefill_settings = providers.Singleton(engine_settings, "kv_producer", config.store_dir, config.num_blocks)
    decode_settings = providers.Singleton(engine_settings, "kv_consumer", config.store_dir, config.num_blocks)

    prefill = providers.Container(EngineContainer, settings=prefill_settings)
    decode = providers.Container(EngineContainer, settings=decode_settings)


def run(store_dir: str, prompts: int = 2, prompt_len: int = 200, new_tokens: int = 6) -> int:
    """Prefill on one engine, decode on the other; print the tokens; 0 if they match and KV was loaded."""
    app = PrefillDecodePair()
    app.config.from_dict({"store_dir": store_dir, "num_blocks": 64 * prompts})
    rng = random.Random(0)
    vocab = app.prefill_settings().model.vocab_size
    batch = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    try:
        prefilled = app.prefill.engine().generate(batch, new_tokens)
        decoded = app.decode.engine().generate(batch, new_tokens)
    finally:
        app.shutdown_resources()
    match = True
    for i, (p, d) in enumerate(zip(prefilled, decoded, strict=True)):
        same = p.ok and d.ok and p.output_token_ids == d.output_token_ids
        match = match and same and d.num_loaded_tokens > 0
        print(f"prompt {i}: prefill {list(p.output_token_ids)}")
        print(
            f"prompt {i}: decode  {list(d.output_token_ids)} (loaded {d.num_loaded_tokens} tokens, "
            f"computed {d.num_computed_prompt_tokens}){'' if d.ok else ' error: ' + str(d.error)}"
        )
    print(f"match: {'yes' if match else 'no'}")
    return 0 if match else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--store-dir", type=Path, default=None, help="shared store directory (default: a temp dir)")
    args: Any = parser.parse_args(argv)
    if args.store_dir is not None:
        return run(str(args.store_dir))
    with tempfile.TemporaryDirectory(prefix="kvdi-pair-") as tmp:
        return run(tmp)


if __name__ == "__main__":
    sys.exit(main())
